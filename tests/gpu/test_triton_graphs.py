"""On CUDA: the Triton attention kernels compiled (not interpreted), and the decode step, EAGLE's
chain draft steps and verify and the draft extend replayed from captured CUDA graphs, against HF
greedy. The same logic runs on CPU in tests/test_triton_attention.py (interpreter) and
tests/test_cuda_graph_runner.py (static buffers without capture)."""

from __future__ import annotations

import pytest

from common.engine.draft_runner import SpecArgs
from common.engine.sampling import SamplingParams
from common.tools.eagle_checkpoint import build as build_head
from tests.decode_harness import Pair
from tests.oracle import hf_greedy

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3], list(range(60, 80)), list(range(100, 160))]


def _run(pair: Pair, n: int) -> dict:
    for i, p in enumerate(PROMPTS):
        pair.submit(str(i), p, SamplingParams(max_new_tokens=n, ignore_eos=True))
    pair.wait([str(i) for i in range(len(PROMPTS))])
    return dict(pair.out.tokens)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("graphs", [True, False])
def test_triton_decode_on_cuda_matches_hf_greedy(checkpoint, overlap, graphs):
    path = checkpoint("llama")
    pair = Pair(path, overlap=overlap, device="cuda", dtype="float32", attention_backend="triton", cuda_graph=graphs)
    out = _run(pair, 24)
    for i, p in enumerate(PROMPTS):
        assert out[str(i)] == hf_greedy(path, p, 24), f"prompt {i}"
    decode_graphs = pair.worker.runner.decode_graphs
    if graphs:
        assert decode_graphs.graphs and sum(decode_graphs.runs.values()) > 0
    else:
        assert decode_graphs is None
    pair.close()


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("topk,steps,nodes", [(1, 3, 4), (4, 3, 8)])
def test_triton_eagle_on_cuda_matches_hf_greedy(checkpoint, tmp_path, topk, steps, nodes, graphs):
    """With graphs: every draft step (a chain's, or a tree's at each depth), every verify (chain or tree)
    and every draft extend, replayed."""
    path = checkpoint("llama")
    spec = SpecArgs("EAGLE3", build_head(path, "EAGLE3", str(tmp_path / "head")), steps, topk, nodes)
    pair = Pair(path, device="cuda", dtype="float32", spec=spec, attention_backend="triton", cuda_graph=graphs)
    out = _run(pair, 20)
    for i, p in enumerate(PROMPTS):
        assert out[str(i)] == hf_greedy(path, p, 20), f"prompt {i}"
    if graphs:
        runner = pair.worker.runner
        drafts = [runner.draft.decode_graphs] if topk == 1 else runner.draft.tree_graphs  # a tree: one per depth
        replayed = [runner.draft.extend_graphs, runner.verify_graphs, *drafts]
        assert all(g.graphs and sum(g.runs.values()) > 0 for g in replayed)
    pair.close()
