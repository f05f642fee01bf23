"""Decode's prefix cache and the delta handoff on CUDA (issue 57): follow-up turns served from decode's
cache stay exact in process (eager and with Triton attention replayed from CUDA graphs) and over
Mooncake into device pools (prefill copies out, and writes, positions kv_start.. of its device KV)."""

from __future__ import annotations

import pytest

from common.engine.sampling import SamplingParams
from tests.decode_harness import Pair
from tests.grpc_harness import GrpcPair
from tests.oracle import hf_greedy
from tests.test_decode_prefix_cache import N, _turns


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "triton-graphs"])
def test_follow_up_turns_from_decodes_cache_on_cuda_match_hf(checkpoint, graphs):
    path = checkpoint("llama")
    kw = dict(attention_backend="triton", cuda_graph=True) if graphs else {}
    pair = Pair(path, prefix_cache=True, device="cuda", dtype="float32", **kw)
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    try:
        prompts = _turns(lambda rid, p: pair.submit(rid, p, params), lambda rid: pair.wait([rid]),
                         lambda rid: pair.out.tokens[rid])  # fmt: skip
        hits = pair.scheduler.books.cache.stats.cached_tokens
    finally:
        pair.close()
    assert hits > 0
    for t, p in enumerate(prompts):
        assert pair.out.tokens[f"t{t}"] == hf_greedy(path, p, N), t


@pytest.mark.gpu
def test_delta_handoffs_over_mooncake_into_device_pools_match_hf(checkpoint):
    path = checkpoint("llama")
    kw = dict(device="cuda", dtype="float32")
    pair = GrpcPair(path, prefill_kw=kw, decode_kw=dict(kw, disaggregation_decode_enable_radix_cache=True),
                    transfer="mooncake")  # fmt: skip
    outs = {}

    def submit(rid, p):
        outs[rid] = pair.collect(pair.generate(p, N, ignore_eos=True, rid=rid))[0]

    try:
        prompts = _turns(submit, lambda rid: None, lambda rid: outs[rid])
        assert pair.prefill.kv_notices > 0 and pair.decode.scheduler.books.cache.stats.cached_tokens > 0
    finally:
        pair.close()
    for t, p in enumerate(prompts):
        assert outs[f"t{t}"] == hf_greedy(path, p, N), t


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_follow_up_turns_with_eagle3_from_decodes_cache_on_cuda_match_hf(checkpoint, fitted_head, shape):
    """The head's KV kept in decode's cache on the device and the delta handoff's head KV, with Triton
    attention replayed from CUDA graphs: every turn HF-exact and drafts accepted."""
    from common.engine.draft_runner import SpecArgs
    from tests.test_eagle import chat_prompts

    path = checkpoint("llama")
    first = chat_prompts(path, 1)[0]  # the fitted head accepts runs on chat prompts
    spec = SpecArgs("EAGLE3", fitted_head("llama", "EAGLE3"), 3, *((1, 4) if shape == "chain" else (2, 6)))
    pair = Pair(path, prefix_cache=True, spec=spec, device="cuda", dtype="float32", attention_backend="triton",
                cuda_graph=True)  # fmt: skip
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    try:
        prompts = _turns(lambda rid, p: pair.submit(rid, p, params), lambda rid: pair.wait([rid]),
                         lambda rid: pair.out.tokens[rid], first=first)  # fmt: skip
        hits, (accepted, _) = pair.scheduler.books.cache.stats.cached_tokens, pair.scheduler.spec_stats
    finally:
        pair.close()
    assert hits > 0 and accepted > 0
    for t, p in enumerate(prompts):
        assert pair.out.tokens[f"t{t}"] == hf_greedy(path, p, N), t
