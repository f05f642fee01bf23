"""Tensor and expert parallelism for Qwen3-MoE and DeepSeek-V3 (common/parallel/moe_shard.py,
tp_shard.py's latent attention): TP 2 with --ep-size 1 (a slice of every expert per rank) and 2
(half the experts whole per rank) gives one rank's logits within fp32 rounding and HF's greedy
tokens, in-process (gloo ranks, as tests/test_tensor_parallel.py) and over the gRPC pair with
prefill TP 2 / decode TP 1 and the reverse; the latent is one replicated KV head, whole on every
rank, handed over from one prefill rank to every decode rank (grpc bytes, shm, Mooncake)."""

from __future__ import annotations

import pytest
import torch

from common.models.config import load_model_config
from common.models.moe import MoeSpec, run_experts
from common.parallel import moe_shard, tp_shard
from common.parallel.tp_group import TPGroup
from tests.grpc_harness import GrpcPair, needs_mooncake
from tests.oracle import hf_greedy
from tests.tp_harness import run_ranks

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3], list(range(100, 120))]
NEW = 12


def _runner(path: str, tp=None, ep_size: int = 1):
    from common.engine.model_runner import ModelRunner, RunnerArgs

    tp = tp or TPGroup.single()
    return ModelRunner(
        RunnerArgs(path, max_total_tokens=512, max_running_requests=4, linear_layout="mkl", tp=tp, ep_size=ep_size)
    )


def _logits_and_tokens(tp, path: str, ep_size: int, prompts, new_tokens: int) -> dict:
    """One rank: extend logits of every prompt position, then greedy generation (colocated loop)."""
    from common.engine.colocated import ColocatedLoop
    from common.engine.sampling import SamplingParams
    from common.forward.forward_batch import ForwardBatch

    runner = _runner(path, tp, ep_size)
    rows = []
    for p in prompts:
        rows.append(runner.req_to_token_pool.alloc())
        runner.req_to_token_pool.write(rows[-1], 0, runner.kv_allocator.alloc(len(p)))
    table = runner.req_to_token_pool.req_to_token
    logits, _ = runner.forward(ForwardBatch.extend(table, rows, [0] * len(prompts), prompts, all_logits=True))
    for r in rows:
        runner.kv_allocator.free(table[r, : len(prompts[rows.index(r)])].tolist())
        runner.req_to_token_pool.free(r)
    reqs = ColocatedLoop(runner, chunk_size=16).generate(
        prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    )
    moe = next(layer.mlp for layer in runner.model.model.layers if hasattr(layer.mlp, "experts_gate_up"))
    return {
        "logits": logits,
        "tokens": [r.output for r in reqs],
        "kv_shape": tuple(runner.kv_pool.k[0].shape[1:]),
        "experts": tuple(moe.experts_gate_up.shape),
        "first_expert": moe.first_expert,
        "kv_used": runner.kv_allocator.num_used,
    }


CASES = [("qwen3-moe", 1), ("qwen3-moe", 2), ("deepseek-v3", 1), ("deepseek-v3", 2), ("deepseek-v3-nolora", 2)]


@pytest.mark.parametrize("variant,ep_size", CASES)
def test_two_ranks_match_one_rank_and_hf_greedy(checkpoint, variant, ep_size):
    path = checkpoint(variant)
    cfg = load_model_config(path)
    single = _logits_and_tokens(TPGroup.single(), path, 1, PROMPTS, NEW)
    ranks = run_ranks(_logits_and_tokens, 2, path, ep_size, PROMPTS, NEW)
    want = [hf_greedy(path, p, NEW) for p in PROMPTS]
    assert single["tokens"] == want
    spec = cfg.moe
    for r, got in enumerate(ranks):
        # exact within fp32 rounding: the all-reduce only reorders the sums of heads and experts
        torch.testing.assert_close(got["logits"], single["logits"], atol=2e-5, rtol=1e-5)
        assert got["tokens"] == want, f"rank {r}"
        assert got["kv_used"] == 0
        e, width, hidden = got["experts"]
        if ep_size == 1:  # every expert, half its columns
            assert (e, width, got["first_expert"]) == (spec.num_experts, spec.intermediate_size, None)
        else:  # half the experts, whole
            assert (e, width, got["first_expert"]) == (spec.num_experts // 2, 2 * spec.intermediate_size, r * e)
        if cfg.mla is not None:  # the latent is replicated: every rank's pool holds it whole
            assert got["kv_shape"] == (1, cfg.head_dim) == single["kv_shape"]
        else:  # 2 KV heads: one per rank
            assert got["kv_shape"] == (1, cfg.head_dim)


def test_local_experts_sum_to_all_experts():
    """run_experts over each half of the experts (first_expert), summed, equals all of them at once."""
    g = torch.Generator().manual_seed(0)
    t, h, inter, e, k = 9, 16, 8, 6, 2
    x = torch.randn(t, h, generator=g)
    gate_up, down = torch.randn(e, 2 * inter, h, generator=g), torch.randn(e, h, inter, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    whole = run_experts(x, ids, weights, gate_up, down)
    halves = sum(run_experts(x, ids, weights, gate_up[a : a + 3], down[a : a + 3], first_expert=a) for a in (0, 3))
    torch.testing.assert_close(halves, whole, atol=1e-5, rtol=1e-5)
    spec = MoeSpec(e, k, inter, True, "softmax", (0,))
    assert [list(moe_shard.local_experts(spec, r, 2, 2)) for r in range(2)] == [[0, 1, 2], [3, 4, 5]]


def test_bad_expert_splits_are_refused(checkpoint):
    spec = load_model_config(checkpoint("qwen3-moe")).moe  # 8 experts of 32 columns
    with pytest.raises(ValueError, match="--ep-size must be 1 or --tp-size"):
        moe_shard.check_experts(spec, 2, 4)
    with pytest.raises(ValueError, match="--ep-size 3 must divide the 8 routed experts"):
        moe_shard.check_experts(spec, 3, 3)
    with pytest.raises(ValueError, match="--tp-size 3 with --ep-size 1 must divide"):
        moe_shard.check_experts(spec, 3, 1)
    moe_shard.check_experts(spec, 2, 2)
    moe_shard.check_experts(spec, 4, 1)


def test_a_bad_ep_size_is_refused_before_loading():
    from common.parallel.launch import check_settings
    from decode_service.config import DecodeConfig

    with pytest.raises(ValueError, match="--ep-size must be 1 or --tp-size"):
        check_settings(DecodeConfig("unused", prefill_addr="127.0.0.1:1", tp_size=2, ep_size=4))
    check_settings(DecodeConfig("unused", prefill_addr="127.0.0.1:1", tp_size=2, ep_size=2))


def test_the_latent_is_one_replicated_head(checkpoint):
    """kv_heads_of gives every rank the latent whole; a TP destination's parts are the handoff's own
    latent tensors for every rank (no copy, no V), and its write plan writes K alone."""
    from types import SimpleNamespace

    from common.kv_transfer import plan
    from common.wire.proto_gen import prefill_pb2

    cfg = load_model_config(checkpoint("deepseek-v3"))
    assert tp_shard.replicated_kv(cfg)
    assert [tp_shard.kv_heads_of(cfg, r, 4) for r in range(4)] == [range(0, 1)] * 4
    latent = [torch.randn(5, 1, cfg.head_dim) for _ in range(cfg.num_layers)]
    handoff = SimpleNamespace(k=latent, v=[torch.empty(5, 1, 0) for _ in latent], draft_k=None)
    dest = prefill_pb2.KvDestination(runs=plan.slot_runs([7, 8, 9, 20, 21]))
    pools = [torch.zeros(cfg.num_layers, 32, 1, cfg.head_dim) for _ in range(2)]
    for r, pool in enumerate(pools):
        region = plan.kv_region(list(pool.unbind(0)), [torch.empty(33, 1, 0)] * cfg.num_layers)
        dest.tp_ranks.add(session=f"rank{r}", kv_head_start=0, kv_head_count=1, target=region)
    parts = plan.rank_parts(dest, handoff)
    assert len(parts) == 2 and all(k is latent and not region.v_ptrs for _, k, _, region, _ in parts)
    for _, k, v, region, _ in parts:
        plan.check_destination(dest, region, 5, cfg.num_layers, cfg.head_dim * 4, with_v=False)
        srcs, dsts, lens = plan.write_plan(k, v, region, dest.runs, 0, 5, 0, cfg.num_layers)
        assert len(srcs) == 2 * cfg.num_layers  # two slot runs per layer, K only
        assert all(n % (cfg.head_dim * 4) == 0 for n in lens)  # whole latent slots


# (prefill TP, decode TP, variant, prefill's --ep-size, decode's --ep-size)
GRPC = [
    (2, 1, "qwen3-moe", 2, 1),
    (1, 2, "qwen3-moe", 1, 1),
    (2, 1, "deepseek-v3", 1, 1),
    (1, 2, "deepseek-v3", 1, 2),
]


@pytest.mark.parametrize("prefill_tp,decode_tp,variant,prefill_ep,decode_ep", GRPC)
def test_tp_pairs_match_hf_greedy(checkpoint, prefill_tp, decode_tp, variant, prefill_ep, decode_ep):
    """Over real gRPC (KV as bytes): a TP 2 prefill hands over rank 0's KV (DeepSeek: its latent, the
    same on both ranks, with no gather), a TP 2 decode gives every rank its heads (the latent whole)."""
    path = checkpoint(variant)
    pair = GrpcPair(
        path,
        prefill_kw=dict(tp_size=prefill_tp, ep_size=prefill_ep, linear_layout="mkl", max_chunk_bytes=4096),
        decode_kw=dict(tp_size=decode_tp, ep_size=decode_ep, linear_layout="mkl"),
    )
    try:
        pair.check_against_oracle(path, PROMPTS, 10)
    finally:
        pair.close()
    if prefill_tp > 1:
        pair.prefill.worker.check_idle_integrity()


@pytest.mark.parametrize("transfer", ["shm", pytest.param("mooncake", marks=needs_mooncake)])
def test_the_latent_is_written_into_every_decode_rank(checkpoint, transfer):
    """A transfer engine with a TP 2 decode: both ranks name their own latent pool (the whole head),
    and prefill writes the same latent into each; tokens equal HF greedy."""
    path = checkpoint("deepseek-v3")
    pair = GrpcPair(
        path,
        transfer=transfer,
        prefill_kw=dict(tp_size=2, ep_size=2, linear_layout="mkl"),
        decode_kw=dict(tp_size=2, linear_layout="mkl"),
    )
    try:
        ranks = pair.decode.kv_receiver.destination.tp_ranks
        assert [(r.kv_head_start, r.kv_head_count) for r in ranks] == [(0, 1), (0, 1)]
        assert ranks[0].session != ranks[1].session and not ranks[0].target.v_ptrs
        pair.check_against_oracle(path, PROMPTS, 10)
        assert pair.prefill.kv_notices > 0
    finally:
        pair.close()
