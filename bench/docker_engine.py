"""A Docker engine for the compose check: found, or installed and started; a base image made from Debian.

Everything here runs on the host. On a Debian machine where the check runs as root and no engine is
installed, Debian's packages are installed (`docker.io`, `docker-compose`, `debootstrap`: engine
20.10, compose v1). A daemon is started when none answers (`dockerd --iptables=false --ip-masq=false
--bridge=none`: user-defined bridge networks, which compose makes, work without iptables) and stopped
again by `Engine.close`. When the base image cannot be pulled (no Docker Hub), a stand-in is made
with debootstrap from the Debian mirror apt already uses (read from the host's apt sources, never
written down here): bookworm minbase with python3.11, its venv module, CA certificates and libibverbs1,
`python` on PATH, imported as one layer.

    python -m bench.docker_engine base [--tag TAG]     # make (or keep) the stand-in base image
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

STAND_IN_BASE = "disagg-serve-base:bookworm-py311"
DEBIAN_PACKAGES = ["docker.io", "docker-compose", "debootstrap"]
BASE_PACKAGES = "python3.11,python3.11-venv,python3-distutils,ca-certificates,libibverbs1"


class EngineUnavailable(RuntimeError):
    """No Docker engine can run here; the message says why."""


def log(msg: str) -> None:
    print(f"[compose-check] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}... exited {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}")
    return proc


def _daemon_answers() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=20, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _compose_command() -> list[str] | None:
    """Compose v2 (`docker compose`) where the plugin is there, else v1 (`docker-compose`)."""
    if shutil.which("docker") and run(["docker", "compose", "version"], timeout=20, check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def debian_mirror() -> str | None:
    """The Debian archive URI apt is set to use (deb822 .sources files or one-line lists)."""
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        for line in open(path):
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
        if os.path.isfile(path):
            for line in open(path):
                parts = line.split()
                if parts[:1] == ["deb"] and "security" not in line:
                    return next(p for p in parts[1:] if "://" in p)
    return None


class Engine:
    """A usable engine: `compose` is the compose command; `close()` undoes what `start()` started."""

    def __init__(self) -> None:
        self.compose: list[str] = []
        self.daemon: subprocess.Popen | None = None
        self.installed: list[str] = []
        self.timings: dict[str, float] = {}

    def start(self) -> Engine:
        t0 = time.time()
        if not (_daemon_answers() and _compose_command()):  # a working engine is used as it is
            exes = ("dockerd", "docker-compose", "debootstrap")
            missing = [p for p, exe in zip(DEBIAN_PACKAGES, exes) if not shutil.which(exe)]
            if missing:
                self._install(missing)
        self.timings["install_s"] = time.time() - t0
        if not _daemon_answers():
            self._start_daemon()
        self.compose = _compose_command() or []
        if not self.compose:
            raise EngineUnavailable("no compose command (docker compose v2 or docker-compose v1)")
        self.timings["engine_s"] = time.time() - t0
        return self

    def _install(self, packages: list[str]) -> None:
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            raise EngineUnavailable(f"missing {packages} and not root on a Debian host: cannot install them")
        log(f"installing Debian's {' '.join(packages)}")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        run(["apt-get", "update", "-qq"], timeout=600, env=env)
        proc = run(["apt-get", "install", "-y", "-qq", *packages], timeout=900, check=False, env=env)
        if proc.returncode != 0:
            raise EngineUnavailable(f"apt-get install {' '.join(packages)} failed: {proc.stderr[-1000:]}")
        self.installed = packages

    def _start_daemon(self) -> None:
        if os.geteuid() != 0 or not shutil.which("dockerd"):
            raise EngineUnavailable("no Docker daemon answers and this is not root with dockerd: cannot start one")
        log("starting dockerd --iptables=false --ip-masq=false --bridge=none")
        logf = open(os.path.join(tempfile.gettempdir(), "compose-check-dockerd.log"), "w")
        self.daemon = subprocess.Popen(
            ["dockerd", "--iptables=false", "--ip-masq=false", "--bridge=none"],
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.daemon.poll() is not None:
                raise EngineUnavailable(f"dockerd exited with {self.daemon.returncode}; see {logf.name}")
            if _daemon_answers():
                return
            time.sleep(0.5)
        self.close()
        raise EngineUnavailable(f"dockerd did not answer within 60 s; see {logf.name}")

    def close(self) -> None:
        """Stop the daemon this run started (containers are gone by then); installed packages stay."""
        if self.daemon is not None and self.daemon.poll() is None:
            log("stopping the dockerd this check started")
            self.daemon.terminate()
            try:
                self.daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait(timeout=10)
        self.daemon = None


def image_exists(tag: str) -> bool:
    return run(["docker", "image", "inspect", tag], timeout=30, check=False).returncode == 0


def image_size(tag: str) -> int:
    return int(run(["docker", "image", "inspect", "--format", "{{.Size}}", tag], timeout=30).stdout.strip())


def base_image(wanted: str, stand_in: str = STAND_IN_BASE) -> str:
    """`wanted` if it is here or can be pulled, else the stand-in made from Debian packages."""
    if image_exists(wanted) or run(["docker", "pull", wanted], timeout=120, check=False).returncode == 0:
        return wanted
    log(f"{wanted} cannot be pulled: using the stand-in {stand_in} made from Debian packages")
    if not image_exists(stand_in):
        make_stand_in(stand_in)
    return stand_in


def make_stand_in(tag: str) -> None:
    mirror = debian_mirror()
    if not shutil.which("debootstrap") and os.geteuid() == 0 and shutil.which("apt-get"):
        Engine()._install(["debootstrap"])
    if not mirror or not shutil.which("debootstrap") or os.geteuid() != 0:
        raise EngineUnavailable(
            "cannot make a base image: needs root, debootstrap and a Debian mirror in apt's sources"
        )
    root = tempfile.mkdtemp(prefix="disagg-base-")
    try:
        log(f"debootstrap bookworm minbase with {BASE_PACKAGES}")
        run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", root, mirror], timeout=1200)
        for name in ("python", "python3"):
            os.symlink("/usr/bin/python3.11", os.path.join(root, "usr/local/bin", name))
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
            for path in glob.glob(os.path.join(root, junk, "*")):
                shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        changes = ["ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8"]
        cmd = ["docker", "import"] + [a for c in changes for a in ("-c", c)] + ["-", tag]
        proc = subprocess.run(cmd, stdin=tar.stdout, capture_output=True, text=True, timeout=600)
        tar.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"docker import failed: {proc.stderr[-1000:]}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.docker_engine")
    p.add_argument("what", choices=["base"])
    p.add_argument("--tag", default=STAND_IN_BASE)
    args = p.parse_args(argv)
    engine = Engine().start()
    try:
        if not image_exists(args.tag):
            make_stand_in(args.tag)
        print(f"{args.tag}: {image_size(args.tag) / 1e6:.0f} MB")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
