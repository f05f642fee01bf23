"""Issue 44 part 6: one service's TP group across hosts (--nnodes, --node-rank, --dist-init-addr),
drilled on loopback as two "nodes" on one machine: node 0 runs the prefill service in this process,
node 1 is `python -m prefill_service ... --node-rank 1`, a separate OS process; the pair's tokens equal
HF greedy. Node 1 without the key file is refused, one with another key cannot join, and node 1
killed ends node 0's service cleanly. The flag checks are fast unit tests (default tier)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.kv_transfer import receiver, sender
from common.parallel import launch, nodes
from decode_service.config import DecodeConfig
from prefill_service.config import PrefillConfig
from tests.grpc_harness import GrpcPair, wait_for
from tests.tp_harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3]]


def _key_file(tmp_path, name: str = "tp.key", key: str | None = None) -> str:
    path = tmp_path / name
    path.write_text((key or secrets.token_hex(32)) + "\n")
    path.chmod(0o600)
    return str(path)


def _config(**kw) -> PrefillConfig:
    return PrefillConfig("unused", **kw)


# ---- the flags, refused before anything loads (default tier) ----------------------------------------
@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(nnodes=0), "--nnodes must be >= 1"),
        (dict(tp_size=2, nnodes=2, node_rank=2), r"--node-rank must be in \[0, --nnodes\)"),
        (dict(node_rank=-1), "--node-rank must be in"),
        (dict(tp_size=3, nnodes=2), r"--tp-size \(3\) must be divisible by --nnodes \(2\)"),
        (dict(tp_size=2, nnodes=2), "needs --dist-init-addr"),
        (dict(tp_size=2, nnodes=2, dist_init_addr="127.0.0.1"), "must be HOST:PORT"),
        (dict(tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:http"), "must be HOST:PORT"),
        (dict(tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:70000"), "must be HOST:PORT"),
        (dict(tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:0"), "needs a fixed port"),
        (dict(tp_size=2, nnodes=2, dist_init_addr="0.0.0.0:5000"), "not a wildcard"),
        (dict(tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:5000"), "needs --tp-key-file"),
        (dict(tp_size=2, dist_init_addr="127.0.0.1:5000", tp_port=5001), "not both"),
    ],
)
def test_bad_node_flags_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        launch.check_settings(_config(**kw))


def test_the_key_file_is_checked_before_loading(tmp_path):
    good = dict(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="[::1]:5000")
    launch.check_settings(_config(**good, tp_key_file=_key_file(tmp_path)))
    with pytest.raises(ValueError, match="too short"):
        launch.check_settings(_config(**good, tp_key_file=_key_file(tmp_path, "short", "abc")))
    loose = _key_file(tmp_path, "loose")
    os.chmod(loose, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        launch.check_settings(_config(**good, tp_key_file=loose))
    with pytest.raises(ValueError, match="cannot open"):
        launch.check_settings(_config(**good, tp_key_file=str(tmp_path / "missing")))
    shm_over_nodes = _config(**good, tp_key_file=_key_file(tmp_path), disaggregation_transfer_backend="shm")
    launch.check_settings(shm_over_nodes)  # the nodes are fine; the KV transport refuses (both sides)
    with pytest.raises(ValueError, match="shm is one host's"):
        receiver.check(shm_over_nodes)
    with pytest.raises(ValueError, match="shm is one host's"):
        sender.make_sender(shm_over_nodes)


def test_each_node_runs_its_share_of_the_ranks():
    config = _config(tp_size=6, nnodes=3, node_rank=2, dist_init_addr="[::1]:5000")
    assert list(nodes.ranks_of_node(config)) == [4, 5]
    assert nodes.store_address(config) == ("::1", 5000)
    assert nodes.store_address(_config(tp_port=7)) == ("127.0.0.1", 7)
    assert list(nodes.ranks_of_node(DecodeConfig("unused", prefill_addr="x:1", tp_size=2))) == [0, 1]
    assert nodes.local_address("127.0.0.1", 5000) == "127.0.0.1"


def test_a_node_without_the_key_file_is_refused_before_loading(capsys):
    from prefill_service.__main__ import main

    argv = ["--model-path", "/nonexistent", "--tp-size", "2", "--nnodes", "2", "--node-rank", "1"]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--dist-init-addr", "127.0.0.1:5000"])
    assert exit_.value.code == 2
    assert "needs --tp-key-file" in capsys.readouterr().err


def _idle_rank(rank: int, port: int, key: str, queue) -> None:
    from common.parallel.tp_group import TPGroup

    try:
        tp = TPGroup.init(rank, 2, f"tcp://127.0.0.1:{port}", key=key, timeout_s=2)
        if rank == 0:
            time.sleep(4)  # idle past the group's timeout before each message
        got = tp.broadcast_object(("step", 1) if rank == 0 else None)
        if rank == 0:
            time.sleep(4)
        queue.put((rank, got, tp.scatter_object([("a",), ("b",)] if rank == 0 else None)))
    except BaseException as e:  # noqa: BLE001 (reported to the test)
        queue.put((rank, f"{type(e).__name__}: {e}", None))


def test_a_follower_waits_out_an_idle_rank_0():
    """The group's timeout bounds a collective, not the wait for rank 0's next message: a service
    (local or across nodes) may idle longer than it without losing its followers."""
    import torch.multiprocessing as mp

    from common.parallel.tp_auth import new_key

    ctx, port, key = mp.get_context("spawn"), free_port(), new_key()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_idle_rank, args=(r, port, key, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(queue.get(timeout=120) for _ in procs)
        assert got == [(0, ("step", 1), ("a",)), (1, ("step", 1), ("b",))]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


# ---- two nodes on loopback (drills) ------------------------------------------------------------------
def _node(
    path: str, rank: int, port: int, key_file: str | None, service: str = "prefill", ep_size: int = 1
) -> subprocess.Popen:
    """Node `rank` of a 2-node group: `python -m prefill_service --node-rank rank` (or decode_service)."""
    flags = ["--model-path", path, "--tp-size", "2", "--nnodes", "2", "--node-rank", str(rank)]
    flags += ["--dist-init-addr", f"127.0.0.1:{port}", "--linear-layout", "mkl", "--torch-threads", "1"]
    flags += ["--tp-key-file", key_file] if key_file else []
    flags += ["--ep-size", str(ep_size)] if ep_size > 1 else []
    if service == "decode":  # the same flags as node 0's (its prefill address is not used here)
        flags += ["--prefill-addr", "127.0.0.1:1", "--disable-overlap-schedule"]
    return subprocess.Popen([sys.executable, "-m", f"{service}_service", *flags, "--debug-checks"], cwd=ROOT)


def _node0_kw(port: int, key_file: str, ep_size: int = 1) -> dict:
    return dict(
        tp_size=2,
        nnodes=2,
        dist_init_addr=f"127.0.0.1:{port}",
        tp_key_file=key_file,
        linear_layout="mkl",
        ep_size=ep_size,
    )


def _end(proc: subprocess.Popen, timeout: float = 30) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("variant,ep_size", [("qwen3", 1), ("qwen3-moe", 2), ("deepseek-v3", 2)])
def test_groups_across_two_nodes_match_hf_greedy(checkpoint, tmp_path, variant, ep_size):
    """Prefill and decode each TP 2 over two nodes: node 0 of each in this process, node 1 of each a
    process of its own; node 1 ends (exit 0) when its node 0 stops the group. The MoE families with
    their experts split between the nodes (EP 2), DeepSeek's latent whole on both."""
    path, key_file = checkpoint(variant), _key_file(tmp_path)
    ports = {"prefill": free_port(), "decode": free_port()}
    node1 = [_node(path, 1, port, key_file, service, ep_size) for service, port in ports.items()]
    try:
        pair = GrpcPair(
            path,
            overlap=False,
            prefill_kw=_node0_kw(ports["prefill"], key_file, ep_size),
            decode_kw=_node0_kw(ports["decode"], key_file, ep_size),
        )
        try:
            for service in (pair.prefill, pair.decode):
                assert service.runner.kv_pool.k[0].shape[1] == 1  # 1 of 2 KV heads, or the whole latent
                assert service.tp_ranks.procs == []  # node 0's only rank is this process
            pair.check_against_oracle(path, PROMPTS, 10)
        finally:
            pair.close()
        assert [_end(p) for p in node1] == [0, 0], "node 1 should end with the group"
    finally:
        for p in node1:
            _end(p, 0)


def test_a_node_with_another_key_cannot_join(checkpoint, tmp_path):
    path, port = checkpoint("qwen3"), free_port()
    node1 = _node(path, 1, port, _key_file(tmp_path, "stranger.key"))
    try:
        from prefill_service.server import PrefillService

        config = PrefillConfig(path, port=0, **_node0_kw(port, _key_file(tmp_path)))
        with pytest.raises(PermissionError, match="rank 1 does not hold this launch's key"):
            PrefillService(config)
        assert _end(node1) != 0
    finally:
        _end(node1, 0)


def test_killing_node_1_ends_node_0s_service_cleanly(checkpoint, tmp_path):
    path, port, key_file = checkpoint("llama"), free_port(), _key_file(tmp_path)
    node1 = _node(path, 1, port, key_file)
    try:
        pair = GrpcPair(path, prefill_kw=_node0_kw(port, key_file), decode_kw=dict(linear_layout="mkl"))
        try:
            pair.check_against_oracle(path, PROMPTS[:1], 4)
            os.kill(node1.pid, signal.SIGKILL)
            node1.wait()
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                pair.collect(pair.generate(PROMPTS[1], 4, rid="after", ignore_eos=True))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            wait_for("NOT_SERVING", lambda: not pair.stub.HealthCheck(pb.HealthCheckRequest()).healthy, timeout=10)
            assert time.monotonic() - started < 30
        finally:
            pair.channel.close()
            pair.decode.stop()
            pair.prefill.stop()
    finally:
        _end(node1, 0)
