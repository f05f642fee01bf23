"""compose.yaml and the Dockerfile stay honest: structure, and commands our real CLIs accept."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from common import api_keys
from common.tools import health_probe
from common.tools import keygen as keygen_tool
from decode_service.config import build_parser as decode_parser
from decode_service.config import parse_args as parse_decode
from prefill_service.config import build_parser as prefill_parser
from prefill_service.config import parse_args as parse_prefill
from tests.grpc_harness import GrpcPair
from tests.test_smg_gateway import _smg_binary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compose(name: str = "compose.yaml") -> dict:
    with open(os.path.join(ROOT, name)) as f:
        return yaml.safe_load(f)


FORMS = ("compose.yaml", "compose.cpu.yaml")  # the GPU form (docker compose up) and the CPU form


def _expand(arg: str) -> str:
    return (
        arg.replace("${MODEL_NAME:-model}", "model")
        .replace("${TRANSFER_BACKEND:-grpc}", "grpc")
        .replace("${DECODE_TP_SIZE:-1}", "1")
        .replace("${PREFILL_TP_SIZE:-1}", "1")
        .replace("${TORCH_THREADS:-0}", "0")
        .replace("${QUANTIZATION:-none}", "none")
        .replace("${KV_CACHE_DTYPE:-auto}", "auto")
    )


def test_compose_structure():
    services = _compose()["services"]
    assert set(services) == {"keygen", "prefill", "decode", "smg"}
    for name in ("prefill", "decode"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
        assert any(v.endswith(":/models:ro") for v in services[name]["volumes"])
        probe = services[name]["healthcheck"]["test"]
        assert probe[:4] == ["CMD", "python", "-m", "common.tools.health_probe"]
    assert services["decode"]["depends_on"] == {"prefill": {"condition": "service_healthy"}}
    assert services["smg"]["depends_on"] == {"decode": {"condition": "service_healthy"}}
    assert any(v.endswith(":/models:ro") for v in services["smg"]["volumes"])  # reads tokenizer_path itself


@pytest.mark.parametrize("form", FORMS)
def test_services_come_back_and_prefill_scales(form):
    """A crashed service restarts by itself (the one-shot keygen does not); prefill publishes no fixed host
    port (--scale prefill=N) and decode finds its replicas through compose's DNS; decode's container
    health is its readiness (a prefill replica serving), counted after the start period."""
    services = _compose(form)["services"]
    assert "restart" not in services["keygen"]
    for name in ("prefill", "decode", "smg"):
        assert services[name]["restart"] == "unless-stopped", name
    for port in services["prefill"]["ports"]:
        host = str(port).rsplit(":", 1)[0]
        assert host == "127.0.0.1:", port  # loopback, the host port left free per replica
    command = services["decode"]["command"]
    assert command[command.index("--prefill-addr") + 1] == "dns:///prefill:30001"
    for name in ("prefill", "decode"):
        check = services[name]["healthcheck"]
        assert check["retries"] * int(check["interval"].rstrip("s")) <= 30 and int(check["start_period"][:-1]) >= 120
    assert services["decode"]["healthcheck"]["test"][5] == "sglang.grpc.scheduler.SglangScheduler"  # readiness


def test_the_cpu_form_is_the_gpu_form_without_gpus():
    """compose.cpu.yaml: the same services, volumes, ports, probes and restart policies; only the GPU
    reservations, the device, the sizes, the image tag, the build and the CPU-only flags (threads, weights,
    KV: one value on both services, float32 by default) go their own way."""
    gpu, cpu = _compose()["services"], _compose("compose.cpu.yaml")["services"]
    assert set(cpu) == set(gpu)
    for name in gpu:
        g, c = dict(gpu[name]), dict(cpu[name])
        assert "deploy" not in c, name
        g.pop("deploy", None)
        assert c.pop("image") == "disagg-serve:cpu" and g.pop("image") == "disagg-serve:latest"
        if name == "keygen":
            assert c.pop("build") == {
                "context": ".",
                "args": {"VARIANT": "cpu", "BASE_IMAGE": "${BASE_IMAGE:-python:3.11-slim}"},
            }
            g.pop("build")
        if name in ("prefill", "decode"):
            assert c["volumes"][-1] == "cache:/home/disagg/.cache"  # the layout table outlives a restart
            c["volumes"] = c["volumes"][:-1]
            gc, cc = g.pop("command"), c.pop("command")
            assert cc[cc.index("--device") + 1] == "cpu" and gc[gc.index("--device") + 1] == "cuda"
            flags = lambda cmd: [a for a in cmd if a.startswith("--")]  # noqa: E731
            cpu_only = ("--torch-threads", "--quantization", "--kv-cache-dtype")  # CPU threads, weights and KV
            assert [f for f in flags(cc) if f not in cpu_only] == flags(gc), name
        assert c == g, name
    for flag in ("--quantization", "--kv-cache-dtype"):  # one value for both (shm refuses KV of another width)
        p_cmd, d_cmd = cpu["prefill"]["command"], cpu["decode"]["command"]
        assert p_cmd[p_cmd.index(flag) + 1] == d_cmd[d_cmd.index(flag) + 1], flag
    args = [_expand(a) for a in cpu["prefill"]["command"]]
    p = prefill_parser().parse_args(args[3:])
    d = decode_parser().parse_args([_expand(a) for a in cpu["decode"]["command"]][3:])
    assert p.device == d.device == "cpu" and p.dtype == d.dtype == "auto" and p.torch_threads == d.torch_threads == 0
    assert p.quantization == d.quantization == "none" and p.kv_cache_dtype == d.kv_cache_dtype == "auto"  # exact
    assert d.prefill_addr == f"dns:///prefill:{p.port}"


@pytest.mark.parametrize("form", FORMS)
def test_compose_v1_reads_both_forms(form):
    """Debian's docker-compose (v1) and the v2 plugin accept the file, where either is installed."""
    import shutil

    if shutil.which("docker-compose"):
        cmd = ["docker-compose"]
    elif (
        shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        cmd = ["docker", "compose"]
    else:
        pytest.skip("no docker-compose (v1) nor docker compose (v2) here")
    proc = subprocess.run([*cmd, "-f", form, "config", "-q"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_service_commands_parse_with_the_real_clis():
    services = _compose()["services"]
    prefill = [_expand(a) for a in services["prefill"]["command"]]
    decode = [_expand(a) for a in services["decode"]["command"]]
    assert prefill[:3] == ["python", "-m", "prefill_service"] and decode[:3] == ["python", "-m", "decode_service"]
    p = prefill_parser().parse_args(prefill[3:])
    d = decode_parser().parse_args(decode[3:])
    assert p.host == d.host == "0.0.0.0" and p.device == d.device == "cuda" and p.dtype == d.dtype == "auto"
    assert p.disaggregation_transfer_backend == d.disaggregation_transfer_backend == "grpc"  # one data plane
    for name, args in (("prefill", p), ("decode", d)):  # the container outlives the drain
        grace = int(services[name]["stop_grace_period"].rstrip("s"))
        assert args.shutdown_grace_s >= 30 and grace > args.shutdown_grace_s, (name, grace)
    for name in ("prefill", "decode"):  # both follow one TRANSFER_BACKEND setting
        assert "${TRANSFER_BACKEND:-grpc}" in services[name]["command"]
    assert d.prefill_addr == f"dns:///prefill:{p.port}" and p.model_path == d.model_path == "/models/model"
    assert p.tp_size == d.tp_size == 1 and "${DECODE_TP_SIZE:-1}" in services["decode"]["command"]  # TP settings
    assert "${PREFILL_TP_SIZE:-1}" in services["prefill"]["command"]
    smg = services["smg"]["command"]
    assert f"http://decode:{d.openai_port}" in smg  # the OpenAI API decode serves (docs/deployment.md)
    assert f"127.0.0.1:{d.openai_port}:{d.openai_port}" in services["decode"]["ports"]
    assert services["decode"]["healthcheck"]["test"][4] == f"127.0.0.1:{d.port}"
    assert services["prefill"]["healthcheck"]["test"][4] == f"127.0.0.1:{p.port}"


@pytest.mark.parametrize("form", ["compose.yaml", "compose.cpu.yaml"])
def test_the_gateway_never_shares_a_network_with_prefill(form):
    """The Mooncake engines listen on every interface of their containers: prefill sits on `kv` alone and
    smg on `front` alone, so the gateway reaches neither prefill nor its engine, and both services say
    so with --disaggregation-network-private (decode's engine: prefill and smg reach it)."""
    with open(os.path.join(ROOT, form)) as f:
        services = yaml.safe_load(f)["services"]
    nets = {name: set(services[name]["networks"]) for name in ("prefill", "decode", "smg")}
    assert nets == {"prefill": {"kv"}, "decode": {"kv", "front"}, "smg": {"front"}}
    for name in ("prefill", "decode"):
        assert "--disaggregation-network-private" in services[name]["command"], name


def test_smg_command_flags_exist():
    smg = _compose()["services"]["smg"]["command"]
    assert smg[:2] == ["smg", "launch"]
    helptext = subprocess.run([_smg_binary(), "launch", "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in [a for a in smg if a.startswith("--")]:
        assert flag in helptext, flag


def test_dockerfile_installs_the_lock_from_a_wheelhouse():
    """The image installs requirements/VARIANT.txt (hash-checked) and the project's wheel from the host's
    wheelhouse, no index; the base is a build argument; the lock holds what compose runs (smg)."""
    text = open(os.path.join(ROOT, "Dockerfile")).read()
    assert text.startswith("#") and re.search(r"^ARG BASE_IMAGE=\S+$", text, re.M)
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${BASE_IMAGE}", "${BASE_IMAGE}"]  # build stage, then the image
    assert "COPY requirements/${VARIANT}.txt" in text and "COPY .wheelhouse/${VARIANT}" in text
    installs = re.findall(r"pip install(?:\\\n|[^\n])*", text)  # with its continuation lines
    assert len(installs) == 2 and all("--no-index" in i for i in installs)
    assert "--require-hashes --no-deps -r /tmp/lock.txt" in installs[0] and "--no-deps disagg-serve" in installs[1]
    assert "COPY .wheelhouse/${VARIANT}-app" in text  # the project's wheel, a layer of its own
    for variant in ("cpu", "cuda"):
        assert re.search(r"^smg==", open(os.path.join(ROOT, "requirements", f"{variant}.txt")).read(), re.M)
    ignore = open(os.path.join(ROOT, ".dockerignore")).read().split()
    assert ignore[ignore.index("*") :] == ["*", "!requirements/*.txt", "!.wheelhouse/"]  # a small build context
    services = _compose()["services"]
    assert services["keygen"]["build"] == "."  # the first service to start builds the image the others run
    assert {s["image"] for s in services.values()} == {"disagg-serve:latest"}


KEY_FLAGS = ("--api-key", "--internal-api-key")


def _image_user() -> tuple[int, str]:
    """The Dockerfile's USER (numeric) and HOME."""
    text = open(os.path.join(ROOT, "Dockerfile")).read()
    return int(re.findall(r"^USER (\d+)", text, re.M)[-1]), re.search(r"\bHOME=(\S+)", text).group(1)


def test_keys_travel_as_files_never_on_a_command_line(tmp_path):
    """keygen makes the internal key once into a volume only prefill and decode mount (read-only);
    they read it with --internal-api-key-file; no key flag or variable anywhere for ps or inspect."""
    compose = _compose()
    for name, service in compose["services"].items():
        command = service["command"]
        assert not any(a in KEY_FLAGS or "KEY" in a for a in command), (name, command)  # nothing for ps to show
        assert not any("KEY" in str(e) for e in service.get("environment", ())), name  # nor docker inspect
    keygen = compose["services"]["keygen"]
    assert keygen["command"][:3] == ["python", "-m", "common.tools.keygen"] and keygen["network_mode"] == "none"
    [key_path] = keygen["command"][3:]
    folder = os.path.dirname(key_path)
    assert keygen["volumes"] == [f"keys:{folder}"] and "keys" in compose["volumes"]
    assert "mkdir -p " + folder in open(os.path.join(ROOT, "Dockerfile")).read()  # the volume takes its owner
    assert not any("keys:" in v for v in compose["services"]["smg"].get("volumes", ()))  # the gateway never sees it
    local = tmp_path / "internal_api_key"
    assert keygen_tool.main([str(local)]) == 0
    for name, parse in {"prefill": parse_prefill, "decode": parse_decode}.items():
        service = compose["services"][name]
        assert f"keys:{folder}:ro" in service["volumes"], name
        if name == "prefill":  # decode starts after prefill is healthy, so after keygen too
            assert service["depends_on"] == {"keygen": {"condition": "service_completed_successfully"}}
        command = service["command"]
        assert command[command.index("--internal-api-key-file") + 1] == key_path
        args = [a.replace(key_path, str(local)) for a in map(_expand, command[3:])]
        assert parse(args).internal_api_key == api_keys.read_key_file(str(local))  # the file as keygen made it


def test_keygen_makes_one_owner_only_key_and_keeps_it(tmp_path):
    path = str(tmp_path / "k")
    assert keygen_tool.ensure_key(path) is True
    key = api_keys.read_key_file(path)
    assert len(key) >= 32 and os.stat(path).st_mode & 0o777 == 0o400
    assert keygen_tool.ensure_key(path) is False and api_keys.read_key_file(path) == key  # a restart keeps it
    other = tmp_path / "bad"
    other.write_text("")
    other.chmod(0o600)
    with pytest.raises(api_keys.KeySourceError, match="empty"):  # an unusable file in the way is an error
        keygen_tool.ensure_key(str(other))


def test_the_image_runs_as_an_unprivileged_user_with_a_writable_home():
    text = open(os.path.join(ROOT, "Dockerfile")).read()
    uid, home = _image_user()
    final = text[text.rindex("\nFROM ") :]  # the image's own stage
    assert uid != 0 and final.rindex("USER ") > final.rindex("pip install")  # runs as uid
    assert f"--uid {uid}" in text and f"--home-dir {home}" in text and "--create-home" in text
    for cache in ("XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert re.search(rf"\b{cache}={re.escape(home)}/", text), cache


def test_health_probe_script(checkpoint):
    pair = GrpcPair(checkpoint("qwen2"))
    try:
        assert health_probe.main([pair.prefill.address]) == 0
        assert health_probe.main([pair.decode.address, "sglang.grpc.scheduler.SglangScheduler"]) == 0
        assert health_probe.main(["127.0.0.1:1", "--timeout", "0.5"]) == 1
        proc = subprocess.run(
            [sys.executable, "-m", "common.tools.health_probe", pair.decode.address],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0 and "SERVING" in proc.stdout
    finally:
        pair.close()


def test_compose_check_skips_loudly_without_an_engine(monkeypatch, capsys):
    """Not root, no docker, no dockerd: the compose check says why it skips (exit 0; --require: 1)."""
    import shutil

    from bench import compose_check
    from bench import docker_engine as de

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(de.EngineUnavailable, match="cannot install"):
        de.Engine().start()
    assert compose_check.main([]) == 0
    assert "COMPOSE CHECK SKIPPED" in capsys.readouterr().err
    assert compose_check.main(["--require"]) == 1
