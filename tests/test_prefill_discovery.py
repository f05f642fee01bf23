"""`--prefill-addr dns:///NAME:PORT`: replicas behind a name that resolves to several addresses
(here three loopback addresses, 127.0.0.1-3, on one port), re-resolved while decode runs."""

import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.tools.procs import free_port
from decode_service import prefill_discovery
from decode_service.config import DecodeConfig
from decode_service.server import DecodeService
from prefill_service.config import PrefillConfig
from prefill_service.server import PrefillService
from tests.oracle import hf_greedy
from tests.test_prefill_replicas import _generate, _tokens, _wait_idle

REAL_LOOKUP = prefill_discovery.lookup


def test_entries_expand_to_every_resolved_address(monkeypatch):
    names = {"prefill-headless": ["10.0.0.2", "10.0.0.1"], "v6": ["fd00::1"]}
    monkeypatch.setattr(prefill_discovery, "lookup", lambda host: sorted(names.get(host, [])))
    entries = ["dns:///prefill-headless:30001", "10.0.0.1:30001", "dns:///v6:7", "dns:///nothing:1"]
    assert prefill_discovery.expand(entries) == ["10.0.0.1:30001", "10.0.0.2:30001", "[fd00::1]:7"]
    for bad in ("dns:///name", "dns:///:30001", "dns:///name:port"):
        with pytest.raises(ValueError, match="dns:///NAME:PORT"):
            prefill_discovery.expand([bad])
    assert "127.0.0.1" in REAL_LOOKUP("localhost") and REAL_LOOKUP("no-such-host.invalid") == []


def test_a_replica_added_behind_the_name_takes_calls_without_a_restart(checkpoint, monkeypatch):
    path = checkpoint("qwen2")
    port = free_port()
    behind = ["127.0.0.1", "127.0.0.2"]
    monkeypatch.setattr(prefill_discovery, "lookup", lambda host: list(behind) if host == "prefill" else [])
    replicas = [PrefillService(PrefillConfig(path, host=h, port=port)).start() for h in ("127.0.0.1", "127.0.0.2")]
    config = DecodeConfig(
        path,
        prefill_addr=f"dns:///prefill:{port}",
        port=0,
        prefill_resolve_interval_s=0.2,
        prefill_policy="least_loaded",
    )
    decode = DecodeService(config).start()
    stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(decode.address))

    def run(tag: str, n: int) -> None:
        for i in range(n):
            prompt = [5 + i, 6, 7, 8 + len(tag)]
            ids, reason = _tokens(_generate(stub, prompt, 3, f"{tag}{i}"))
            assert ids == hf_greedy(path, prompt, 3) and reason == "length"

    try:
        run("a", 4)
        assert sorted(p.address for p in decode.prefill.replicas.members) == [f"127.0.0.{i}:{port}" for i in (1, 2)]
        assert all(r.num_prefilled > 0 for r in replicas)
        replicas.append(PrefillService(PrefillConfig(path, host="127.0.0.3", port=port)).start())
        behind.append("127.0.0.3")
        deadline = time.time() + 10
        while len(decode.prefill.replicas.members) < 3:
            assert time.time() < deadline, "the new replica was never picked up"
            time.sleep(0.05)
        run("b", 6)
        assert replicas[2].num_prefilled > 0, [r.num_prefilled for r in replicas]
        behind.remove("127.0.0.1")  # gone from the name: no new calls go there
        replicas[0].stop()
        while len(decode.prefill.replicas.members) > 2:
            assert time.time() < deadline + 10
            time.sleep(0.05)
        before = replicas[0].num_prefilled
        run("c", 3)
        assert replicas[0].num_prefilled == before
        _wait_idle(decode)
    finally:
        decode.stop()
        for r in replicas:
            r.stop()
