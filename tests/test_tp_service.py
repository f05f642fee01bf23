"""The decode service with --tp-size 2 (a follower process, gloo on loopback) behind a TP 1 prefill
service, over real gRPC: tokens equal HF greedy for the three architectures, overlap on and off, plain
and with EAGLE; killing the follower turns health NOT_SERVING and fails calls, never hangs."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.grpc_harness import GrpcPair, wait_for
from tests.test_eagle import heads  # noqa: F401 (fixture)

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3], list(range(60, 80))]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("overlap", [True, False])
def test_decode_tp2_matches_hf_greedy(checkpoint, arch, overlap):
    path = checkpoint(arch)
    pair = GrpcPair(path, overlap=overlap, decode_kw=dict(tp_size=2, linear_layout="mkl"))
    try:
        assert pair.decode.runner.kv_pool.k[0].shape[1] == 1  # rank 0 holds one of the 2 KV heads
        pair.check_against_oracle(path, PROMPTS, 10)
        info = pair.stub.GetServerInfo(pb.GetServerInfoRequest())
        assert info.server_args["tp_size"] == 2
    finally:
        pair.close()


@pytest.mark.parametrize("algorithm,topk,tokens", [("EAGLE", 1, 4), ("EAGLE3", 2, 6)])
def test_decode_tp2_with_eagle_matches_hf_greedy(checkpoint, heads, algorithm, topk, tokens):
    path = checkpoint("llama")
    spec = dict(speculative_algorithm=algorithm, speculative_draft_model_path=heads(path, algorithm),
                speculative_num_steps=3, speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens)  # fmt: skip
    pair = GrpcPair(path, prefill_kw=spec, decode_kw=dict(tp_size=2, linear_layout="mkl", **spec))
    try:
        pair.check_against_oracle(path, PROMPTS, 12)
    finally:
        pair.close()


def test_a_dead_rank_ends_the_service_cleanly(checkpoint):
    path = checkpoint("qwen2")
    pair = GrpcPair(path, decode_kw=dict(tp_size=2, linear_layout="mkl"))
    try:
        pair.check_against_oracle(path, PROMPTS[:1], 4)
        [follower] = pair.decode.tp_ranks.procs
        os.kill(follower.pid, signal.SIGKILL)
        started = time.monotonic()
        wait_for("NOT_SERVING", lambda: not pair.stub.HealthCheck(pb.HealthCheckRequest()).healthy, timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            pair.collect(pair.generate(PROMPTS[1], 4, rid="after", ignore_eos=True))
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
        assert time.monotonic() - started < 30
    finally:
        pair.channel.close()
        pair.decode.stop()
        pair.prefill.stop()


def test_tp_settings_it_cannot_serve_are_refused_before_loading():
    from decode_service.config import DecodeConfig
    from decode_service.tp_worker import check_tp_settings

    with pytest.raises(ValueError, match="--tp-size must be >= 1"):
        check_tp_settings(DecodeConfig("unused", prefill_addr="127.0.0.1:1", tp_size=0))
    with pytest.raises(ValueError, match="gRPC only"):
        check_tp_settings(DecodeConfig("unused", prefill_addr="127.0.0.1:1", tp_size=2,
                                       disaggregation_transfer_backend="mooncake"))  # fmt: skip
    check_tp_settings(
        DecodeConfig("unused", prefill_addr="127.0.0.1:1", tp_size=1, disaggregation_transfer_backend="mooncake")
    )
