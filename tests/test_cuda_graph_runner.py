"""The static buffers of every fixed-shape forward (common/engine/cuda_graph_runner.py) on CPU,
without capture: the same buffers, buckets and padding a CUDA graph replays, so their discipline is
tested here. On a GPU, tests/gpu/test_cuda_path.py replays the captured graphs."""

import pytest
import torch

from common.engine.cuda_graph_runner import batch_buckets
from common.engine.draft_runner import SpecArgs
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams
from common.forward.forward_batch import ForwardBatch
from decode_service.eagle_tree_step import ancestors
from tests.decode_harness import ManualPair, Pair
from tests.oracle import hf_greedy
from tests.test_eagle import FLOOR, accept_length, chat_prompts, heads  # noqa: F401 (fixture)

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3], list(range(60, 80)), [7, 7], list(range(90, 101))]


def test_buckets_cover_every_batch_up_to_the_largest():
    assert batch_buckets(1) == [1] and batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(16) == [1, 2, 4, 8, 16] and batch_buckets(20) == [1, 2, 4, 8, 16, 24]
    for max_bs in range(1, 70):
        buckets = batch_buckets(max_bs)
        assert buckets == sorted(set(buckets)) and buckets[-1] >= max_bs


LENS = [4, 9, 1]  # committed lengths of the 3 requests in the padded-bucket tests (bucket 4)


def _runner_with_rows(path, static: bool, spare: int, spec=None, prefill: bool = False):
    """A runner (static buffers or eager) with 3 requests of LENS tokens and `spare` KV slots each
    beyond them; with `prefill`, their prompt KV written. Returns (runner, table, rows)."""
    runner = ModelRunner(
        RunnerArgs(path, max_total_tokens=256, max_running_requests=6, linear_layout="mkl", spec=spec or SpecArgs(),
                   static_decode_buffers=static)
    )  # fmt: skip
    table, rows = runner.req_to_token_pool.req_to_token, []
    for n in LENS:
        rows.append(runner.req_to_token_pool.alloc())
        runner.req_to_token_pool.write(rows[-1], 0, runner.kv_allocator.alloc(n + spare))
    if prefill:
        runner.forward(ForwardBatch.extend(table, rows, [0, 0, 0], [list(range(3, 3 + n)) for n in LENS]))
    return runner, table, rows


def test_padding_rows_write_only_the_padding_slot_and_real_rows_are_unchanged(checkpoint):
    """A batch of 3 in bucket 4: logits equal the eager forward; the padding row sits at request row 0,
    slot 0; no KV slot but 0 and the real rows' own is written."""
    path = checkpoint("qwen2")
    outs = {}
    for name in ("eager", "static"):
        runner, table, rows = _runner_with_rows(path, name == "static", 1, prefill=True)
        before = runner.kv_pool.k[0].clone()
        fb = ForwardBatch.decode(table, torch.tensor(rows), LENS, torch.tensor([11, 12, 13]))
        logits, hidden = runner.forward(fb)
        assert logits.shape[0] == hidden.shape[0] == 3
        changed = (runner.kv_pool.k[0] != before).any(-1).any(-1).nonzero().flatten().tolist()
        outs[name] = logits, changed, fb.out_cache_loc.tolist()
    graphs = runner.decode_graphs  # the static runner (the last one)
    assert graphs.runs[4] == 1 and not graphs.graphs  # bucket 4, eagerly (CPU: nothing captured)
    assert graphs.req_pool_indices[3] == 0 and graphs.out_cache_loc[3] == 0 and graphs.seq_lens[3] == 1
    torch.testing.assert_close(outs["static"][0], outs["eager"][0], atol=1e-5, rtol=1e-5)
    assert set(outs["static"][1]) <= {0, *outs["static"][2]} and set(outs["static"][2]) <= set(outs["static"][1])


@pytest.mark.parametrize("overlap", [True, False])
def test_serving_through_static_buffers_matches_hf_greedy(checkpoint, overlap):
    """Six requests of mixed lengths join in one step and finish at different steps: the batch shrinks
    from 5-6 rows to 1, through buckets 8, 4, 2 and 1 (stepped by hand, so every run takes them all)."""
    path = checkpoint("llama")
    pair = ManualPair(path, overlap=overlap, decode_reqs=6, static_decode_buffers=True)
    lengths = [10, 3, 14, 6, 1, 8]
    for i, p in enumerate(PROMPTS):
        pair.submit(str(i), p, SamplingParams(max_new_tokens=lengths[i], ignore_eos=True))
    pair.scheduler.step()  # sends the prefill requests
    assert len(pair.pending) == len(PROMPTS)
    pair.prefill()  # all six handoffs arrive before the next step
    sizes = []
    while not pair.scheduler.idle:
        pair.scheduler.step()
        sizes.append(len(pair.scheduler.running_batch))
    pair.close()
    for i, p in enumerate(PROMPTS):
        assert pair.out.tokens[str(i)] == hf_greedy(path, p, lengths[i]), f"prompt {i}"
    runs = pair.worker.runner.decode_graphs.runs  # the padding of a bucket is pinned by the test above
    assert sorted(runs) == [1, 2, 4, 8] and all(n > 0 for n in runs.values()), (runs, sizes)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("overlap", [True, False])
def test_every_architecture_through_static_buffers_matches_hf_greedy(checkpoint, arch, overlap):
    path = checkpoint(arch)
    pair = Pair(path, overlap=overlap, decode_reqs=4, static_decode_buffers=True)
    for i, p in enumerate(PROMPTS[:4]):
        pair.submit(str(i), p, SamplingParams(max_new_tokens=9, ignore_eos=True))
    pair.wait([str(i) for i in range(4)])
    for i, p in enumerate(PROMPTS[:4]):
        assert pair.out.tokens[str(i)] == hf_greedy(path, p, 9), f"prompt {i}"
    assert sum(pair.worker.runner.decode_graphs.runs.values()) > 0
    pair.close()


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_draft_steps_through_static_buffers_equal_eager(checkpoint, heads, shape):
    """The head's draft step through the padded buffers gives the eager hidden for the real rows; the
    padding row writes only draft slot 0. A chain's step is a decode (one token, a hidden in); a
    tree's at depth 2 (K = 2) writes its 2 nodes after the depth-1 pair, over a block of 4 entries."""
    path = checkpoint("llama")
    spec = SpecArgs("EAGLE", heads(path, "EAGLE"), 3, *((1, 4) if shape == "chain" else (2, 4)))
    rows_in = 3 if shape == "chain" else 6
    hidden = torch.randn(rows_in, 64, generator=torch.Generator().manual_seed(0))
    outs = {}
    for static in (False, True):
        runner, table, rows = _runner_with_rows(path, static, 4, spec)
        before = runner.draft.kv_pool.k[0].clone()
        if shape == "chain":
            fb = ForwardBatch.decode(table, torch.tensor(rows), LENS, torch.tensor([11, 12, 13]))
        else:  # node j of depth 2 sees the depth-1 node it grew from (block entry j) and itself (2 + j)
            seen = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool).expand(3, -1, -1)
            depth = torch.ones(3, 2, dtype=torch.int64)
            fb = ForwardBatch.tree(table, torch.tensor(rows), rows, LENS, torch.arange(11, 17), depth, [2, 3], seen)
        out = runner.draft.forward(fb, hidden[:, : runner.config.hidden_size])
        changed = (runner.draft.kv_pool.k[0] != before).any(-1).any(-1).nonzero().flatten().tolist()
        outs[static] = out, changed, fb.out_cache_loc.tolist()
    graphs = runner.draft.decode_graphs if shape == "chain" else runner.draft.tree_graphs[1]
    assert graphs.runs[4] == 1 and graphs.inputs[rows_in:].abs().sum() == 0  # bucket 4; its padding row zeroed
    if shape == "tree":
        assert graphs.seq_lens[3] == 4 and graphs.tree_mask[3].tolist() == [[0, 0, 1, 0], [0, 0, 0, 1]]
    torch.testing.assert_close(outs[True][0], outs[False][0], atol=1e-5, rtol=1e-5)
    assert outs[True][0].shape[0] == rows_in and set(outs[True][1]) <= {0, *outs[True][2]}


@pytest.mark.parametrize("spec_kind", ["EAGLE chain", "EAGLE3 chain", "EAGLE3 tree"])
@pytest.mark.parametrize("overlap", [True, False])
def test_eagle_through_static_buffers_matches_hf_greedy(checkpoint, fitted_head, spec_kind, overlap):
    """Every draft step (a chain's; a tree's K nodes at each depth), every verify (a chain's S + 1
    tokens, a tree's M nodes with their mask) and every draft extend run through static buffers, with
    heads fitted to the target on chat prompts, so verify steps accept runs of drafts here too."""
    algorithm, shape = spec_kind.split()
    path = checkpoint("llama")
    topk, tokens = (1, 4) if shape == "chain" else (2, 6)
    prompts = chat_prompts(path)
    pair = Pair(path, overlap=overlap, decode_reqs=4, static_decode_buffers=True,
                spec=SpecArgs(algorithm, fitted_head("llama", algorithm), 3, topk, tokens))  # fmt: skip
    for i, p in enumerate(prompts):
        pair.submit(str(i), p, SamplingParams(max_new_tokens=24, ignore_eos=True))
    pair.wait([str(i) for i in range(len(prompts))])
    for i, p in enumerate(prompts):
        assert pair.out.tokens[str(i)] == hf_greedy(path, p, 24), (spec_kind, i)
    assert accept_length(pair) >= FLOOR[algorithm], pair.scheduler.spec_stats  # random heads: 1.00-1.03
    runner = pair.worker.runner
    extend_runs = sum(runner.draft.extend_graphs.runs.values())
    draft_runs = sum(runner.draft.decode_graphs.runs.values()) if shape == "chain" else 0
    assert extend_runs > 0 and sum(runner.verify_graphs.runs.values()) > 0  # through their buffers
    assert runner.verify_graphs.per_row == tokens and (runner.verify_graphs.tree_mask is not None) == (shape == "tree")
    tree_runs = [sum(g.runs.values()) for g in runner.draft.tree_graphs]  # one runner per depth 1..S-1
    assert draft_runs > 0 if shape == "chain" else len(tree_runs) == 2 and min(tree_runs) > 0
    pair.close()


def _verify_batch(table, rows, lens, shape):
    """A verify of 4 tokens per request: a chain (extend_fixed) or a tree of 4 nodes (root, two
    children, a grandchild under the second) at depths 0, 1, 1, 2."""
    ids = torch.arange(20, 32)
    if shape == "chain":
        return ForwardBatch.extend_fixed(table, torch.tensor(rows), rows, lens, ids, 4)
    parent = torch.tensor([0, 0, 0, 2]).expand(3, -1)
    anc = ancestors(parent, 2)
    depth = torch.tensor([0, 1, 1, 2]).expand(3, -1)
    return ForwardBatch.tree(table, torch.tensor(rows), rows, lens, ids, depth, list(range(4)), anc)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_padded_verify_equals_eager_and_writes_only_its_slots(checkpoint, heads, shape):
    """The verify (4 tokens per request: a chain, or a tree with its ancestor mask) of 3 requests in
    bucket 4: logits and EAGLE3 features equal the eager forward; the padding row writes only slot 0."""
    path = checkpoint("qwen3")
    spec = SpecArgs("EAGLE3", heads(path, "EAGLE3"), 3, *((1, 4) if shape == "chain" else (2, 4)))
    outs = {}
    for static in (False, True):
        runner, table, rows = _runner_with_rows(path, static, 4, spec, prefill=True)
        before = runner.kv_pool.k[0].clone()
        fb = _verify_batch(table, rows, LENS, shape)
        logits, features = runner.forward_features(fb)
        changed = (runner.kv_pool.k[0] != before).any(-1).any(-1).nonzero().flatten().tolist()
        outs[static] = logits, features, changed, fb.out_cache_loc.tolist()
    graphs = runner.verify_graphs
    assert graphs.runs[4] == 1 and graphs.req_pool_indices[3] == 0 and (graphs.out_cache_loc[12:16] == 0).all()
    if shape == "tree":  # the real rows' masks were copied in, the padding row sees itself only
        assert torch.equal(graphs.tree_mask[:3], fb.tree_mask) and torch.equal(graphs.tree_mask[3], torch.eye(4) > 0)
    torch.testing.assert_close(outs[True][0], outs[False][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[True][1], outs[False][1], atol=1e-5, rtol=1e-5)
    assert outs[True][0].shape[0] == 12 and set(outs[True][2]) <= {0, *outs[True][3]}
