"""compose.yaml and the Dockerfile stay honest: structure, and commands our real CLIs accept."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from common.tools import health_probe
from decode_service.config import build_parser as decode_parser
from prefill_service.config import build_parser as prefill_parser
from tests.grpc_harness import GrpcPair
from tests.test_smg_gateway import _smg_binary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compose() -> dict:
    with open(os.path.join(ROOT, "compose.yaml")) as f:
        return yaml.safe_load(f)


def _expand(arg: str) -> str:
    return (
        arg.replace("${MODEL_NAME:-model}", "model")
        .replace("${TRANSFER_BACKEND:-grpc}", "grpc")
        .replace("${INTERNAL_API_KEY:-}", "")
        .replace("${DECODE_TP_SIZE:-1}", "1")
        .replace("${PREFILL_TP_SIZE:-1}", "1")
    )


def test_compose_structure():
    services = _compose()["services"]
    assert set(services) == {"prefill", "decode", "smg"}
    for name in ("prefill", "decode"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
        assert any(v.endswith(":/models:ro") for v in services[name]["volumes"])
        probe = services[name]["healthcheck"]["test"]
        assert probe[:4] == ["CMD", "python", "-m", "common.tools.health_probe"]
    assert services["decode"]["depends_on"] == {"prefill": {"condition": "service_healthy"}}
    assert services["smg"]["depends_on"] == {"decode": {"condition": "service_healthy"}}
    assert any(v.endswith(":/models:ro") for v in services["smg"]["volumes"])  # reads tokenizer_path itself


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
    assert d.prefill_addr == f"prefill:{p.port}" and p.model_path == d.model_path == "/models/model"
    assert p.tp_size == d.tp_size == 1 and "${DECODE_TP_SIZE:-1}" in services["decode"]["command"]  # TP settings
    assert "${PREFILL_TP_SIZE:-1}" in services["prefill"]["command"]
    smg = services["smg"]["command"]
    assert f"grpc://decode:{d.port}" in smg
    assert services["decode"]["healthcheck"]["test"][4] == f"127.0.0.1:{d.port}"
    assert services["prefill"]["healthcheck"]["test"][4] == f"127.0.0.1:{p.port}"


def test_smg_command_flags_exist():
    smg = _compose()["services"]["smg"]["command"]
    assert smg[:2] == ["smg", "launch"]
    helptext = subprocess.run([_smg_binary(), "launch", "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in [a for a in smg if a.startswith("--")]:
        assert flag in helptext, flag


def test_dockerfile_installs_what_compose_runs():
    text = open(os.path.join(ROOT, "Dockerfile")).read()
    for part in ("common", "prefill_service", "decode_service", "pyproject.toml", "smg"):
        assert part in text
    assert _compose()["services"]["prefill"]["build"] == "."


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
