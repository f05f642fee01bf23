"""Both services with --tp-size (follower processes, gloo on loopback) over real gRPC, at prefill/decode
TP (1,2), (2,1) and (2,2): tokens equal HF greedy for the three architectures, overlap on and off,
plain and with EAGLE; killing a follower turns health NOT_SERVING and fails calls, never hangs."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.grpc_harness import GrpcPair, needs_mooncake, wait_for
from tests.test_eagle import heads  # noqa: F401 (fixture)

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3], list(range(60, 80))]


# (prefill TP, decode TP, arch, overlap). The full matrix, every size pair x architecture x overlap
# mode, plain and with EAGLE (DISAGG_TP_MATRIX=full: 36 pairs of services, ~8 min on 2 cores); by
# default a subset that still covers every size pair, architecture and overlap mode, in budget.
SIZES = [(1, 2), (2, 1), (2, 2)]
ARCHS = ["llama", "qwen2", "qwen3"]
FULL = os.environ.get("DISAGG_TP_MATRIX") == "full"
FULL_PLAIN = [(p, d, arch, overlap) for p, d in SIZES for arch in ARCHS for overlap in (True, False)]
PLAIN = FULL_PLAIN if FULL else [(1, 2, "llama", True), (2, 1, "qwen3", False), (2, 2, "qwen2", False)]


@pytest.mark.parametrize("prefill_tp,decode_tp,arch,overlap", PLAIN)
def test_tp_pairs_match_hf_greedy(checkpoint, prefill_tp, decode_tp, arch, overlap):
    path = checkpoint(arch)
    pair = GrpcPair(
        path,
        overlap=overlap,
        prefill_kw=dict(tp_size=prefill_tp, linear_layout="mkl"),
        decode_kw=dict(tp_size=decode_tp, linear_layout="mkl"),
    )
    try:
        assert pair.decode.runner.kv_pool.k[0].shape[1] == 2 // decode_tp  # rank 0's share of the 2 KV heads
        assert pair.prefill.runner.kv_pool.k[0].shape[1] == 2 // prefill_tp
        pair.check_against_oracle(path, PROMPTS, 10)
        info = pair.stub.GetServerInfo(pb.GetServerInfoRequest())
        assert info.server_args["tp_size"] == decode_tp
    finally:
        pair.close()
    if prefill_tp > 1:
        pair.prefill.worker.check_idle_integrity()


# (prefill TP, decode TP, arch, algorithm, topk, draft tokens, overlap): overlap on drafts an EAGLE
# chain, off an EAGLE3 tree
def _eagle_case(p, d, arch, overlap):
    return (p, d, arch, "EAGLE", 1, 4, True) if overlap else (p, d, arch, "EAGLE3", 2, 6, False)


FULL_EAGLE = [_eagle_case(*case) for case in FULL_PLAIN]
EAGLE = (
    FULL_EAGLE
    if FULL
    else [_eagle_case(*c) for c in [(1, 2, "llama", True), (2, 1, "qwen3", False), (2, 2, "qwen2", True)]]
)


@pytest.mark.parametrize("case", EAGLE)
def test_tp_pairs_with_eagle_match_hf_greedy(checkpoint, heads, case):
    prefill_tp, decode_tp, arch, algorithm, topk, tokens, overlap = case
    path = checkpoint(arch)
    spec = dict(speculative_algorithm=algorithm, speculative_draft_model_path=heads(path, algorithm),
                speculative_num_steps=3, speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens)  # fmt: skip
    pair = GrpcPair(
        path,
        overlap=overlap,
        prefill_kw=dict(tp_size=prefill_tp, linear_layout="mkl", **spec),
        decode_kw=dict(tp_size=decode_tp, linear_layout="mkl", **spec),
    )
    try:
        pair.check_against_oracle(path, PROMPTS, 12)
    finally:
        pair.close()


# (the side whose follower is killed, architecture, what a call after it may fail with): a dead decode
# rank fails calls at the front door; a dead prefill rank leaves decode with no replica (UNAVAILABLE)
DEAD_RANKS = [
    ("decode", "qwen2", (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)),
    ("prefill", "llama", (grpc.StatusCode.UNAVAILABLE,)),
]


@pytest.mark.parametrize("side,arch,codes", DEAD_RANKS)
def test_a_dead_rank_ends_its_service_cleanly(checkpoint, side, arch, codes):
    """A follower killed: its service reports NOT_SERVING (decode's health follows a prefill that
    did), and a call fails in seconds instead of hanging in a collective."""
    path = checkpoint(arch)
    pair = GrpcPair(path, **{f"{side}_kw": dict(tp_size=2, linear_layout="mkl")})
    try:
        pair.check_against_oracle(path, PROMPTS[:1], 4)
        [follower] = getattr(pair, side).tp_ranks.procs
        os.kill(follower.pid, signal.SIGKILL)
        started = time.monotonic()
        wait_for("NOT_SERVING", lambda: not pair.stub.HealthCheck(pb.HealthCheckRequest()).healthy, timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            pair.collect(pair.generate(PROMPTS[1], 4, rid="after", ignore_eos=True))
        assert err.value.code() in codes
        assert time.monotonic() - started < 30
    finally:
        pair.channel.close()
        pair.decode.stop()
        pair.prefill.stop()


def test_a_bad_tp_size_is_refused_before_loading():
    from common.parallel.launch import check_settings
    from decode_service.config import DecodeConfig

    with pytest.raises(ValueError, match="--tp-size must be >= 1"):
        check_settings(DecodeConfig("unused", prefill_addr="127.0.0.1:1", tp_size=0))
    check_settings(
        DecodeConfig(
            "unused",
            prefill_addr="127.0.0.1:1",
            tp_size=2,
            disaggregation_transfer_backend="mooncake",
            disaggregation_network_private=True,
        )
    )


@pytest.mark.parametrize(
    "prefill_tp,decode_tp,eagle,transfer",
    [
        pytest.param(2, 2, False, "mooncake", marks=needs_mooncake),
        pytest.param(1, 2, True, "mooncake", marks=needs_mooncake),
        (2, 2, False, "shm"),
    ],
)
def test_tp_pairs_through_the_transfer_engine_match_hf_greedy(
    checkpoint, heads, prefill_tp, decode_tp, eagle, transfer
):
    """A transfer engine under TP (mooncake, or shm: each rank's pools are its own files): prefill
    writes each decode rank's KV heads straight into that rank's pool (and the head's KV into every
    rank's), one notice per chunk for all of them."""
    path = checkpoint("qwen3")
    spec = {}
    if eagle:
        spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=heads(path, "EAGLE3"),
                    speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)  # fmt: skip
    pair = GrpcPair(
        path,
        transfer=transfer,
        prefill_kw=dict(tp_size=prefill_tp, linear_layout="mkl", **spec),
        decode_kw=dict(tp_size=decode_tp, linear_layout="mkl", **spec),
    )
    try:
        ranks = pair.decode.kv_receiver.destination.tp_ranks
        assert [(r.kv_head_start, r.kv_head_count) for r in ranks] == [(0, 1), (1, 1)]
        assert ranks[0].session != ranks[1].session  # each rank's own engine (or files)
        pair.check_against_oracle(path, PROMPTS, 10)
        assert pair.prefill.kv_notices > 0  # the KV went through the engine, not the stream
    finally:
        pair.close()
