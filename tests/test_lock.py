"""The lock files pin everything, agree with pyproject.toml, and are what set-up, the image and CI install."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCKS = ("cpu", "cpu-dev", "cuda")


def _read(path: str) -> str:
    return open(os.path.join(ROOT, path)).read()


def _pins(name: str) -> dict[str, str]:
    """{package: version} of requirements/NAME.txt; every requirement line is NAME==VERSION with hashes."""
    text = _read(f"requirements/{name}.txt")
    pins = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        line = block.split("\n", 1)[0]
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+) \\", line)
        assert m, f"{name}: not pinned with hashes: {line!r}"
        assert "--hash=sha256:" in block, f"{name}: {line} has no hash"
        pins[m.group(1).lower()] = m.group(2)
    return pins


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


@pytest.mark.parametrize("name", LOCKS)
def test_every_package_is_pinned_with_hashes(name):
    pins = _pins(name)
    assert len(pins) > 40
    text = _read(f"requirements/{name}.txt")
    assert "bash requirements/lock.sh" in text  # the way to refresh it
    assert "://" not in text and "/opt/" not in text  # nothing about the host's indexes or mirrors


def test_the_locks_hold_pyprojects_dependencies():
    import tomllib

    project = tomllib.loads(_read("pyproject.toml"))["project"]
    runtime = _names(project["dependencies"]) | {"smg"}
    extras = _names(project["optional-dependencies"]["dev"] + project["optional-dependencies"]["demo"])
    cpu, dev, cuda = (_pins(n) for n in LOCKS)
    assert runtime <= set(cpu) and runtime <= set(cuda)
    assert runtime | extras <= set(dev)
    assert all(dev[p] == v for p, v in cpu.items()), "cpu-dev.txt drifted from cpu.txt"  # CI runs the image's pins


def test_torch_builds_cpu_and_cuda():
    cpu, dev, cuda = (_pins(n) for n in LOCKS)
    assert cpu["torch"] == dev["torch"] == "2.13.0+cpu"
    assert cuda["torch"] == "2.13.0" and any(p.startswith("nvidia-") for p in cuda)
    assert not any(p.startswith("nvidia-") for p in cpu)
    assert "mooncake-transfer-engine-non-cuda" in cpu and "mooncake-transfer-engine" in cuda


def test_setup_and_ci_install_from_the_lock():
    setup = _read(".ci/setup")
    assert "--require-hashes -r requirements/cpu-dev.txt" in setup
    assert "requirements/cpu-dev.txt" in setup[: setup.index("sha256sum")]  # a new lock re-runs set-up
    assert "--no-deps -e '.[dev,demo]'" in setup  # the project itself adds no unpinned package
    wheelhouse = _read("deploy/docker/wheelhouse.sh")
    assert "--require-hashes" in wheelhouse and "requirements/$variant.txt" in wheelhouse
    lock = _read("requirements/lock.sh")
    for out in LOCKS:
        assert f"-o requirements/{out}.txt" in lock
    for path in ("requirements/lock.sh", "deploy/docker/wheelhouse.sh", "Dockerfile", "compose.cpu.yaml"):
        assert not re.search(r"pypi\.org|pythonhosted|debian\.org", _read(path)), path  # read from the host
