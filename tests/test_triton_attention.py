"""The Triton attention kernels (common/attention/triton_kernels.py) against the torch reference
backend, on CPU under Triton's interpreter (set in conftest.py before Triton loads): ragged lengths
from 1 to 300+, GQA and MHA, head sizes that are not powers of two, prefixes, split-K decode, EAGLE
tree masks, and KV slots scattered through the pool as a long-running server leaves them."""

import pytest
import torch

from common.attention import TorchReferenceBackend
from common.attention.triton_backend import TritonBackend, decode_splits
from common.engine.draft_runner import SpecArgs
from common.engine.kv_pool import KVPool
from common.engine.req_to_token_pool import ReqToTokenPool
from common.engine.sampling import SamplingParams
from common.forward.forward_batch import ForwardBatch
from tests.decode_harness import Pair
from tests.oracle import hf_greedy
from tests.test_attention_batched import _model_logits
from tests.test_eagle import PROMPTS, _run, heads  # noqa: F401 (fixture)

pytest.importorskip("triton", reason="the triton package is a dev dependency (.ci/setup installs it)")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="CPU runs need TRITON_INTERPRET=1 before triton loads (tests/conftest.py sets it)",
)


class Pools:
    """A pool filled with random K/V, and request rows mapped to scattered slots."""

    def __init__(self, kv_heads, head_dim, lens, seed=0, dtype=torch.float32):
        self.gen = torch.Generator().manual_seed(seed)
        slots = sum(lens) + 8
        self.kv = KVPool(slots, 1, kv_heads, head_dim, dtype)
        self.kv.k[0].copy_(torch.randn(self.kv.k[0].shape, generator=self.gen))
        self.kv.v[0].copy_(torch.randn(self.kv.v[0].shape, generator=self.gen))
        self.table = ReqToTokenPool(len(lens) + 1, max(lens) + 8)
        free = (torch.randperm(slots, generator=self.gen) + 1).tolist()  # slot 0 is padding
        self.rows = []
        for n in lens:
            row = self.table.alloc()
            self.table.write(row, 0, torch.tensor([free.pop() for _ in range(n)]))
            self.rows.append(row)

    def qkv(self, tokens, heads):
        k_heads, d = self.kv.k[0].shape[1:]
        q = torch.randn(tokens, heads, d, generator=self.gen)
        k = torch.randn(tokens, k_heads, d, generator=self.gen)
        v = torch.randn(tokens, k_heads, d, generator=self.gen)
        return q, k, v

    def both(self, fb, q, k, v):
        """(reference output, Triton output) for one forward; both write the same K/V first."""
        outs = []
        for backend in (TorchReferenceBackend(self.kv, self.table), TritonBackend(self.kv, self.table)):
            backend.init_forward_metadata(fb)
            outs.append(backend.forward(q, k, v, 0, fb, q.shape[-1] ** -0.5))
        return outs


SHAPES = [(4, 4, 16), (8, 2, 24), (6, 1, 64)]  # (heads, kv_heads, head_dim): MHA, GQA 4, MQA with 6


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_extend_over_prefixes_matches_the_reference(heads, kv_heads, head_dim):
    prefixes, news = [0, 5, 290, 33, 1], [7, 1, 40, 33, 300]  # a prefill, a continuation, ragged blocks
    pools = Pools(kv_heads, head_dim, [p + n for p, n in zip(prefixes, news)], seed=heads)
    tokens = [[1] * n for n in news]
    fb = ForwardBatch.extend(pools.table.req_to_token, pools.rows, prefixes, tokens)
    q, k, v = pools.qkv(sum(news), heads)
    want, got = pools.both(fb, q, k, v)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_decode_with_split_k_matches_the_reference(heads, kv_heads, head_dim):
    committed = [0, 1, 31, 32, 255, 256, 333, 700]
    pools = Pools(kv_heads, head_dim, [n + 1 for n in committed], seed=head_dim)
    idx = torch.tensor(pools.rows)
    fb = ForwardBatch.decode(pools.table.req_to_token, idx, committed, torch.zeros(len(committed)), None, pools.rows)
    q, k, v = pools.qkv(len(committed), heads)
    want, got = pools.both(fb, q, k, v)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_decode_splits_grow_with_the_longest_sequence():
    assert [decode_splits(n) for n in (1, 256, 257, 700, 1024, 5000, 10**6)] == [1, 1, 2, 4, 4, 16, 16]


def test_tree_verify_masks_match_the_reference():
    """EAGLE tree verify: each node sees the prefix, its ancestors and itself (and nothing else)."""
    parents = [-1, 0, 0, 1, 1, 2, 3]  # a 7-node tree
    n = len(parents)
    tree = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        tree[i, i] = True
        while p >= 0:
            tree[i, p], p = True, parents[p]
    depth = tree.sum(1) - 1
    prefixes = [0, 9, 120]
    pools = Pools(2, 16, [p + n for p in prefixes], seed=7)
    idx = torch.tensor(pools.rows)
    masks = torch.stack([tree, tree, tree.tril()])  # the last: a chain-shaped mask, not the tree's
    fb = ForwardBatch.tree(
        pools.table.req_to_token,
        idx,
        pools.rows,
        prefixes,
        torch.zeros(3 * n),
        depth.expand(3, -1),
        list(range(n)),
        masks,
    )
    q, k, v = pools.qkv(3 * n, 4)
    want, got = pools.both(fb, q, k, v)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_the_backend_refuses_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pools = Pools(1, 16, [4])
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        TritonBackend(pools.kv, pools.table)


@pytest.mark.parametrize("variant", ["qwen3", "llama"])
def test_model_logits_through_triton_match_the_reference_backend(checkpoint, variant):
    """A whole model: ragged chunked prefill over a cached prefix, then decode steps."""
    path = checkpoint(variant)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 2, 37, 130)]
    ref, out = _model_logits(path, "torch", prompts), _model_logits(path, "triton", prompts)
    for step, (a, b) in enumerate(zip(out, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, step=step: f"forward {step}: {m}")


@pytest.mark.parametrize("algorithm,topk", [(None, 1), ("EAGLE", 1), ("EAGLE3", 2)])
def test_serving_through_triton_matches_hf_greedy(checkpoint, heads, algorithm, topk):
    """The decode scheduler (overlap on) with both runners on Triton: plain, EAGLE chain, EAGLE3 tree,
    every fixed-shape forward through the static buffers a CUDA graph replays (metadata from device
    tensors only: what capture needs)."""
    path = checkpoint("llama")
    spec = None
    if algorithm:
        steps, tokens = (3, 4) if topk == 1 else (2, 4)
        spec = SpecArgs(algorithm, heads(path, algorithm), steps, topk, tokens)
    pair = Pair(path, spec=spec, attention_backend="triton", static_decode_buffers=True)
    out = _run(pair, PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    for i, p in enumerate(PROMPTS):
        assert out[str(i)] == hf_greedy(path, p, 8), f"prompt {i}"
    runner = pair.worker.runner
    static = [runner.decode_graphs] if spec is None else [runner.verify_graphs, runner.draft.extend_graphs]
    assert all(sum(g.runs.values()) > 0 for g in static)
    pair.close()
