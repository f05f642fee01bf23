"""The decode step's static buffers (common/engine/decode_graphs.py) on CPU, without capture: the
same buffers, buckets and padding a CUDA graph replays, so their discipline is tested here. On a
GPU, tests/gpu/test_cuda_path.py replays the captured graphs."""

import pytest
import torch

from common.engine.decode_graphs import batch_buckets
from common.engine.forward_batch import ForwardBatch
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams
from tests.decode_harness import Pair
from tests.oracle import hf_greedy

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3], list(range(60, 80)), [7, 7], list(range(90, 101))]


def test_buckets_cover_every_batch_up_to_the_largest():
    assert batch_buckets(1) == [1] and batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(16) == [1, 2, 4, 8, 16] and batch_buckets(20) == [1, 2, 4, 8, 16, 24]
    for max_bs in range(1, 70):
        buckets = batch_buckets(max_bs)
        assert buckets == sorted(set(buckets)) and buckets[-1] >= max_bs


def test_padding_rows_write_only_the_padding_slot_and_real_rows_are_unchanged(checkpoint):
    """A batch of 3 in bucket 4: logits equal the eager forward; the padding row sits at request row 0,
    slot 0; no KV slot but 0 and the real rows' own is written."""
    path = checkpoint("qwen2")
    eager = ModelRunner(RunnerArgs(path, max_total_tokens=256, max_running_requests=6, linear_layout="mkl"))
    static = ModelRunner(
        RunnerArgs(path, max_total_tokens=256, max_running_requests=6, linear_layout="mkl", static_decode_buffers=True)
    )
    outs = {}
    for name, runner in (("eager", eager), ("static", static)):
        table = runner.req_to_token_pool.req_to_token
        rows, lens = [], [4, 9, 1]
        for n in lens:
            rows.append(runner.req_to_token_pool.alloc())
            runner.req_to_token_pool.write(rows[-1], 0, runner.kv_allocator.alloc(n + 1))
        runner.forward(ForwardBatch.extend(table, rows, [0, 0, 0], [list(range(3, 3 + n)) for n in lens]))
        before = runner.kv_pool.k[0].clone()
        fb = ForwardBatch.decode(table, torch.tensor(rows), lens, torch.tensor([11, 12, 13]))
        logits, hidden = runner.forward(fb)
        assert logits.shape[0] == hidden.shape[0] == 3
        changed = (runner.kv_pool.k[0] != before).any(-1).any(-1).nonzero().flatten().tolist()
        outs[name] = logits, changed, fb.out_cache_loc.tolist()
    graphs = static.decode_graphs
    assert graphs.runs[4] == 1 and not graphs.graphs  # bucket 4, eagerly (CPU: nothing captured)
    assert graphs.req_pool_indices[3] == 0 and graphs.out_cache_loc[3] == 0 and graphs.seq_lens[3] == 1
    torch.testing.assert_close(outs["static"][0], outs["eager"][0], atol=1e-5, rtol=1e-5)
    assert set(outs["static"][1]) <= {0, *outs["static"][2]} and set(outs["static"][2]) <= set(outs["static"][1])


@pytest.mark.parametrize("overlap", [True, False])
def test_serving_through_static_buffers_matches_hf_greedy(checkpoint, overlap):
    """Six requests of mixed lengths join and finish at different steps, through buckets 1..8."""
    path = checkpoint("llama")
    pair = Pair(path, overlap=overlap, decode_reqs=6, static_decode_buffers=True)
    lengths = [10, 3, 14, 6, 1, 8]
    for i, p in enumerate(PROMPTS):
        pair.submit(str(i), p, SamplingParams(max_new_tokens=lengths[i], ignore_eos=True))
    pair.wait([str(i) for i in range(len(PROMPTS))])
    for i, p in enumerate(PROMPTS):
        assert pair.out.tokens[str(i)] == hf_greedy(path, p, lengths[i]), f"prompt {i}"
    runs = pair.worker.runner.decode_graphs.runs  # which buckets depends on arrival timing; the padding
    assert sum(runs.values()) > 0 and set(runs) == {1, 2, 4, 8}, runs  # of a bucket is pinned by the test above
    pair.close()
