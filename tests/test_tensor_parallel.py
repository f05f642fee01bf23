"""Tensor parallelism on CPU with gloo (common/parallel/): the model split across 2 (and 4) processes
gives HF's greedy tokens for the three architectures, and every rank computes the same tokens."""

from __future__ import annotations

import pytest
import torch

from common.models.config import load_model_config
from common.parallel import tp_shard
from common.parallel.tp_group import TPGroup
from tests.oracle import hf_greedy
from tests.test_eagle import heads  # noqa: F401 (fixture)
from tests.tp_harness import run_ranks

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3]]
NEW = 12


def _generate(tp, path: str, prompts, new_tokens: int):
    from common.engine.colocated import ColocatedLoop
    from common.engine.model_runner import ModelRunner, RunnerArgs
    from common.engine.sampling import SamplingParams

    runner = ModelRunner(RunnerArgs(path, max_total_tokens=512, max_running_requests=4, linear_layout="mkl", tp=tp))
    reqs = ColocatedLoop(runner, chunk_size=16).generate(
        prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    )
    return {"tokens": [r.output for r in reqs], "kv_heads": runner.kv_pool.k[0].shape[1],
            "kv_used": runner.kv_allocator.num_used}  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen2-tied"])  # every architecture: tests/test_tp_service.py
def test_two_ranks_match_hf_greedy(checkpoint, arch):
    path = checkpoint(arch)
    ranks = run_ranks(_generate, 2, path, PROMPTS, NEW)
    want = [hf_greedy(path, p, NEW) for p in PROMPTS]
    assert ranks[0]["tokens"] == want
    assert ranks[1]["tokens"] == want, "every rank samples the same tokens from the gathered logits"
    assert [r["kv_heads"] for r in ranks] == [1, 1]  # 2 KV heads split: one per rank
    assert [r["kv_used"] for r in ranks] == [0, 0]


def test_more_ranks_than_kv_heads_replicate_them(checkpoint):
    """4 ranks, 4 query heads, 2 KV heads: each KV head lives on two ranks."""
    path = checkpoint("qwen3")
    cfg = load_model_config(path)
    assert [list(tp_shard.kv_heads_of(cfg, r, 4)) for r in range(4)] == [[0], [0], [1], [1]]
    ranks = run_ranks(_generate, 4, path, PROMPTS[:2], 8)
    want = [hf_greedy(path, p, 8) for p in PROMPTS[:2]]
    assert all(r["tokens"] == want for r in ranks)


def test_a_size_that_does_not_divide_the_heads_is_refused(checkpoint):
    cfg = load_model_config(checkpoint("llama"))  # 4 heads, 2 KV heads, 128 MLP columns
    with pytest.raises(ValueError, match="--tp-size 3"):
        tp_shard.check_divisible(cfg, 3)
    tp_shard.check_divisible(cfg, 2)


def test_vocab_parallel_embedding_pads_the_last_shard():
    weight = torch.arange(12.0).view(6, 2)  # a vocabulary of 5 rows split in 3s: rank 1 has 3, 4 and a pad row
    emb = tp_shard.VocabParallelEmbedding(tp_shard._rows(weight[:5], 3, 3), 3, 5, TPGroup.single())
    out = emb(torch.tensor([0, 3, 4]))
    assert torch.equal(out, torch.tensor([[0.0, 0.0], [6.0, 7.0], [8.0, 9.0]]))
    assert torch.equal(emb.weight[2], torch.zeros(2))


def _token_map_head(tp, path: str, head: str, token_map: str):
    from common.engine.draft_runner import SpecArgs
    from common.engine.model_runner import ModelRunner, RunnerArgs

    spec = SpecArgs("EAGLE", head, 3, 1, 4, token_map)
    runner = ModelRunner(RunnerArgs(path, max_total_tokens=64, linear_layout="mkl", spec=spec, tp=tp))
    return runner.draft.vocab_lm_head.weight


def test_token_map_rows_come_from_the_whole_lm_head(checkpoint, heads, tmp_path):
    """--speculative-token-map under TP: the hot rows are gathered from every rank's vocabulary shard
    (some hot ids live on each rank), equal to TP 1's."""
    import json

    path = checkpoint("llama")
    (tmp_path / "map.json").write_text(json.dumps(list(range(1, 384, 5))))
    args = (path, heads(path, "EAGLE"), str(tmp_path / "map.json"))
    single = _token_map_head(TPGroup.single(), *args)
    for weight in run_ranks(_token_map_head, 2, *args):
        assert torch.equal(weight, single)
