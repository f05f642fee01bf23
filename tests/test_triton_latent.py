"""MLA's latent decode kernel (common/attention/triton_latent.py, through TritonBackend.latent_attention)
against the torch loop over the latent pool (common/attention/latent.py), on CPU under Triton's
interpreter (set in conftest.py): batch 1 and ragged batches up to 700 keys (split-K), head counts
below and above a block of 16, latent and rope widths that are not powers of two, slots scattered
through the pool; and whole DeepSeek-V3 models served on the triton backend, token-exact with HF."""

import os

import pytest
import torch

from common.attention import triton_latent
from common.attention.latent import latent_attention
from common.attention.triton_backend import TritonBackend
from common.engine.kv_pool import KVPool
from common.engine.req_to_token_pool import ReqToTokenPool
from common.forward.forward_batch import ForwardBatch

pytest.importorskip("triton", reason="the triton package is a dev dependency (.ci/setup installs it)")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU runs need TRITON_INTERPRET=1 before triton loads (tests/conftest.py sets it)",
)


class LatentPools:
    """A latent pool (one head of rank + rope per slot, no V) filled at random, request rows mapped to
    scattered slots."""

    def __init__(self, width, lens, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        slots = sum(lens) + 8
        self.kv = KVPool(slots, 1, 1, width, torch.float32, v_head_dim=0)
        self.kv.k[0].copy_(torch.randn(self.kv.k[0].shape, generator=self.gen))
        self.table = ReqToTokenPool(len(lens) + 1, max(lens) + 8)
        free = (torch.randperm(slots, generator=self.gen) + 1).tolist()  # slot 0 is padding
        self.rows = []
        for n in lens:
            row = self.table.alloc()
            self.table.write(row, 0, torch.tensor([free.pop() for _ in range(n)]))
            self.rows.append(row)

    def decode(self, committed, heads, rank, scale):
        """(torch loop's output, Triton's) for one decode step; both write the same new latents."""
        width = self.kv.k[0].shape[-1]
        fb = ForwardBatch.decode(
            self.table.req_to_token, torch.tensor(self.rows), committed, torch.zeros(len(committed)), None, self.rows
        )
        q = torch.randn(len(committed), heads, width, generator=self.gen)
        latent = torch.randn(len(committed), 1, width, generator=self.gen)
        backend = TritonBackend(self.kv, self.table)
        backend.init_forward_metadata(fb)
        want = latent_attention(backend, q, latent, rank, 0, fb, scale)
        got = backend.latent_attention(q, latent, rank, 0, fb, scale)
        return want, got


SHAPES = [(4, 32, 8), (16, 64, 16), (20, 48, 24)]  # (heads, rank, rope): the tiny model's, a full block, ragged


@pytest.mark.parametrize("heads,rank,rope", SHAPES)
def test_latent_decode_matches_the_torch_loop(heads, rank, rope):
    committed = [0, 1, 31, 32, 255, 300, 700]  # ragged; 700 keys: split-K in 4 parts
    pools = LatentPools(rank + rope, [n + 1 for n in committed], seed=heads)
    want, got = pools.decode(committed, heads, rank, 0.19)
    assert got.shape == (len(committed), heads, rank)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_batch_1_and_the_kernel_called(monkeypatch):
    pools = LatentPools(40, [18], seed=1)
    calls = []
    kernel = triton_latent.latent_decode
    monkeypatch.setattr(triton_latent, "latent_decode", lambda *a: calls.append(1) or kernel(*a))
    want, got = pools.decode([17], 4, 32, 0.3)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert calls == [1]


def test_extend_batches_keep_the_torch_loop(monkeypatch):
    """A prefill (or a verify) under the triton backend: the torch loop, not the decode kernel, and its
    output is causal attention over the cached prefix's latents and this forward's own (an einsum each)."""
    pools = LatentPools(40, [9, 3], seed=2)
    calls = []
    monkeypatch.setattr(triton_latent, "latent_decode", lambda *a: calls.append(1))
    prefixes, lens, rank, scale = [4, 0], [5, 3], 32, 0.3
    fb = ForwardBatch.extend(pools.table.req_to_token, pools.rows, prefixes, [[1] * n for n in lens])
    q, latent = torch.randn(8, 4, 40, generator=pools.gen), torch.randn(8, 1, 40, generator=pools.gen)
    cached = pools.kv.k[0].clone()  # the pool before this forward
    backend = TritonBackend(pools.kv, pools.table)
    backend.init_forward_metadata(fb)
    got = backend.latent_attention(q, latent, rank, 0, fb, scale)
    assert calls == []
    start = 0
    for row, prefix, n in zip(pools.rows, prefixes, lens):
        slots = pools.table.req_to_token[row, : prefix + n].to(torch.int64)
        keys = torch.cat((cached[slots[:prefix], 0], latent[start : start + n, 0]))  # [prefix + n, 40]
        scores = torch.einsum("qhd,kd->hqk", q[start : start + n], keys) * scale
        future = torch.arange(prefix + n)[None, :] > torch.arange(prefix, prefix + n)[:, None]
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        want = torch.einsum("hqk,kr->qhr", probs, keys[:, :rank])
        torch.testing.assert_close(got[start : start + n], want, atol=1e-5, rtol=1e-5)
        assert torch.equal(pools.kv.k[0][slots[prefix:]], latent[start : start + n])  # this forward's, written
        start += n


@pytest.mark.parametrize("variant", ["deepseek-v3", "deepseek-v3-nolora"])
def test_deepseek_through_triton_matches_hf_greedy(checkpoint, variant, monkeypatch):
    """Latent decode steps and the experts' grouped GEMM (common/models/triton_moe.py) both on Triton:
    a chunked prefill, then decode steps, give HF's greedy tokens."""
    from common.engine.colocated import ColocatedLoop
    from common.engine.model_runner import ModelRunner, RunnerArgs
    from common.engine.sampling import SamplingParams
    from common.models import triton_moe
    from tests.oracle import hf_greedy

    calls = {"latent": 0, "experts": 0}
    latent_kernel, experts_kernel = triton_latent.latent_decode, triton_moe.run_experts

    def count(name, fn):
        return lambda *a: calls.__setitem__(name, calls[name] + 1) or fn(*a)

    monkeypatch.setattr(triton_latent, "latent_decode", count("latent", latent_kernel))
    monkeypatch.setattr(triton_moe, "run_experts", count("experts", experts_kernel))
    path = checkpoint(variant)
    runner = ModelRunner(RunnerArgs(path, max_total_tokens=256, max_running_requests=4, attention_backend="triton"))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 11)]
    reqs = ColocatedLoop(runner, chunk_size=8).generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    for prompt, req in zip(prompts, reqs):
        assert req.output == hf_greedy(path, prompt, 4), f"prompt of length {len(prompt)}"
    assert calls["latent"] > 0 and calls["experts"] > 0, calls


def test_the_mtp_draft_chain_through_triton_matches_hf_greedy(checkpoint):
    """DeepSeek's MTP layer as the draft (its MoE and latent attention on Triton too): a chain of
    drafts, verifies and draft extends gives HF's greedy tokens."""
    from common.engine.draft_runner import SpecArgs
    from common.engine.sampling import SamplingParams
    from common.models.moe import SparseMoE
    from tests.decode_harness import Pair
    from tests.oracle import hf_greedy

    path = checkpoint("deepseek-v3-mtp")
    prompts = [[5, 9, 40, 7, 3], [100]]
    pair = Pair(path, spec=SpecArgs("NEXTN", None, 2, 1, 3), attention_backend="triton")
    try:
        draft = [m for m in pair.worker.runner.draft.head.modules() if isinstance(m, SparseMoE)]
        assert draft and all(m.experts_kernel is not None for m in draft)
        for i, p in enumerate(prompts):
            pair.submit(str(i), p, SamplingParams(max_new_tokens=6, ignore_eos=True))
        pair.wait([str(i) for i in range(len(prompts))])
        for i, p in enumerate(prompts):
            assert pair.out.tokens[str(i)] == hf_greedy(path, p, 6), f"prompt {i}"
    finally:
        pair.close()
