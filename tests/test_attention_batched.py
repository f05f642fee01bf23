"""The batched attention backend equals the per-request reference ("torch") on ragged batches.

Direct backend checks (random q/k/v over a shuffled KV pool, sequence lengths 1..300, GQA and MHA,
extend from empty, extend over a cached prefix, decode of mixed lengths) and one model-level check
(tiny checkpoint, ModelRunner with each backend, chunked prefill then decode, logits compared).
"""

from __future__ import annotations

import pytest
import torch

import common.attention.batched as batched
from common.attention import BACKENDS, BatchedBackend, TorchReferenceBackend
from common.engine.kv_pool import KVPool
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.req_to_token_pool import ReqToTokenPool
from common.forward.forward_batch import ForwardBatch
from common.service_config import ServiceConfig

HEAD_DIM = 16
NUM_SLOTS = 2048
CASES = {  # name -> (prefix_lens, extend_lens); request rows are assigned out of order
    "extend_from_empty": ([0, 0, 0, 0], [1, 17, 300, 64]),
    "extend_over_prefix": ([7, 0, 250, 33, 1], [5, 9, 50, 1, 1]),
    "extend_equal_lens_over_prefix": ([10, 0, 123], [8, 8, 8]),  # the no-scatter path with a prefix
    "decode_mixed_lengths": ([0, 1, 99, 299, 12, 63], [1, 1, 1, 1, 1, 1]),
}


def _backend_outputs(
    backend_cls,
    heads,
    kv_heads,
    prefix_lens,
    extend_lens,
    decode=False,
    dtype=torch.float32,
    after_init=lambda backend: None,
):
    """Same pool contents, rows and q/k/v for every backend class (seeded); returns (out, pool)."""
    g = torch.Generator().manual_seed(0)
    pool = KVPool(NUM_SLOTS, 2, kv_heads, HEAD_DIM, dtype)
    for buf in pool.k + pool.v:
        buf.normal_(generator=g)  # cached prefix KV (and noise everywhere else)
    r2t = ReqToTokenPool(8, 512)
    rows = [7, 2, 5, 1, 8, 3][: len(prefix_lens)]
    slots = torch.randperm(NUM_SLOTS, generator=g) + 1  # scattered slots, never the padding slot 0
    used = 0
    for row, p, n in zip(rows, prefix_lens, extend_lens):
        r2t.write(row, 0, slots[used : used + p + n])
        used += p + n
    if decode:
        batch = ForwardBatch.decode(r2t.req_to_token, torch.tensor(rows), prefix_lens, torch.zeros(len(rows)))
    else:
        batch = ForwardBatch.extend(r2t.req_to_token, rows, prefix_lens, [[0] * n for n in extend_lens])
    tokens = sum(extend_lens)
    backend = backend_cls(pool, r2t)
    backend.init_forward_metadata(batch)
    after_init(backend)
    outs = []
    for layer in range(2):
        q = torch.randn(tokens, heads, HEAD_DIM, generator=g).to(dtype)
        k = torch.randn(tokens, kv_heads, HEAD_DIM, generator=g).to(dtype)
        v = torch.randn(tokens, kv_heads, HEAD_DIM, generator=g).to(dtype)
        outs.append(backend.forward(q, k, v, layer, batch, HEAD_DIM**-0.5))
    return torch.stack(outs), pool


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (9, 3)], ids=["gqa", "mha", "gqa3"])
@pytest.mark.parametrize("case", list(CASES))
def test_backend_matches_reference(case, heads, kv_heads):
    prefix_lens, extend_lens = CASES[case]
    decode = case.startswith("decode")
    ref, ref_pool = _backend_outputs(TorchReferenceBackend, heads, kv_heads, prefix_lens, extend_lens, decode)
    out, pool = _backend_outputs(BatchedBackend, heads, kv_heads, prefix_lens, extend_lens, decode)
    assert out.shape == ref.shape == (2, sum(extend_lens), heads, HEAD_DIM)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(pool.k + pool.v, ref_pool.k + ref_pool.v):  # this forward's k/v were written
        assert torch.equal(a, b)


def test_backend_cuda_paths_match_reference(monkeypatch):
    """The paths CUDA takes (repeat_interleave'd K/V, as on torch < 2.5; no scratch buffer) agree too."""
    monkeypatch.setattr(batched, "_HAS_ENABLE_GQA", False)
    prefix_lens, extend_lens = CASES["extend_over_prefix"]
    ref, _ = _backend_outputs(TorchReferenceBackend, 4, 2, prefix_lens, extend_lens)
    out, _ = _backend_outputs(
        BatchedBackend, 4, 2, prefix_lens, extend_lens, after_init=lambda backend: setattr(backend, "_scratch", None)
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_backend_in_bfloat16_matches_reference():
    """Computed in the model dtype: bf16 in, bf16 out, within bf16 rounding of the fp32-softmax reference."""
    prefix_lens, extend_lens = CASES["extend_over_prefix"]
    ref, _ = _backend_outputs(TorchReferenceBackend, 4, 2, prefix_lens, extend_lens, dtype=torch.bfloat16)
    out, _ = _backend_outputs(BatchedBackend, 4, 2, prefix_lens, extend_lens, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_auto_is_batched_on_cpu_and_triton_on_cuda(monkeypatch, checkpoint):
    import importlib.util

    from common.attention import resolve_backend

    assert BACKENDS["torch"] is TorchReferenceBackend and BACKENDS["batched"] is BatchedBackend
    assert RunnerArgs("m").attention_backend == "auto" and ServiceConfig("m").attention_backend == "auto"
    assert resolve_backend("auto", "cpu") == "batched" and resolve_backend("torch", "cuda") == "torch"
    assert resolve_backend("auto", "cuda") == "triton"  # the pinned dev extras install triton
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no triton: the plain backend
    assert resolve_backend("auto", "cuda") == "batched"
    monkeypatch.undo()
    runner = ModelRunner(RunnerArgs(checkpoint("llama"), max_total_tokens=64))  # the default, resolved at load
    assert runner.attention_backend == "batched" and isinstance(runner.backend, BatchedBackend)


def _model_logits(path: str, backend: str, prompts: list[list[int]], decode_steps: int = 3) -> list[torch.Tensor]:
    """Chunked ragged prefill (from empty, then over the cached prefix), then greedy decode steps."""
    runner = ModelRunner(RunnerArgs(path, max_total_tokens=1024, max_running_requests=8, attention_backend=backend))
    table = runner.req_to_token_pool.req_to_token
    rows = []
    for p in prompts:
        rows.append(runner.req_to_token_pool.alloc())
        runner.req_to_token_pool.write(rows[-1], 0, runner.kv_allocator.alloc(len(p) + decode_steps))
    cut = [min(len(p), max(1, len(p) // 2)) for p in prompts]
    logits = [
        runner.forward(
            ForwardBatch.extend(table, rows, [0] * len(prompts), [p[:c] for p, c in zip(prompts, cut)], all_logits=True)
        )[0]
    ]
    rest = [i for i, (p, c) in enumerate(zip(prompts, cut)) if c < len(p)]
    batch = ForwardBatch.extend(
        table, [rows[i] for i in rest], [cut[i] for i in rest], [prompts[i][cut[i] :] for i in rest], all_logits=True
    )
    logits.append(runner.forward(batch)[0])
    last = {i: logits[0][sum(cut[: i + 1]) - 1] for i in range(len(prompts)) if i not in rest}
    ends = torch.cumsum(torch.tensor([len(prompts[i]) - cut[i] for i in rest]), 0) - 1
    last.update({i: logits[1][int(e)] for i, e in zip(rest, ends)})
    next_ids = torch.stack([last[i].argmax() for i in range(len(prompts))])
    lens = [len(p) for p in prompts]
    for _ in range(decode_steps):
        step = runner.forward(ForwardBatch.decode(table, torch.tensor(rows), lens, next_ids))[0]
        logits.append(step)
        next_ids, lens = step.argmax(-1), [n + 1 for n in lens]
    return logits


@pytest.mark.parametrize("variant", ["qwen3", "llama"])
def test_model_logits_match_reference_backend(checkpoint, variant):
    path = checkpoint(variant)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 2, 37, 300, 64)]
    ref = _model_logits(path, "torch", prompts)
    out = _model_logits(path, "batched", prompts)
    assert [t.shape for t in out] == [t.shape for t in ref]
    for step, (a, b) in enumerate(zip(out, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, step=step: f"forward {step}: {m}")


def test_the_decode_fold_takes_an_sdpa_output_of_any_strides(monkeypatch):
    """CUDA's SDPA kernels may return [B, kv_heads, group, d] transposed in memory; the fold reshapes."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((3, 9, 8), (3, 3, 5, 8), (3, 3, 5, 8)))
    want = batched.fold_group(q, k, v, None, 0.3)
    real = batched.F.scaled_dot_product_attention

    def transposed(*args, **kwargs):  # the same values, laid out [B, group, kv_heads, d] in memory
        return real(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(batched.F, "scaled_dot_product_attention", transposed)
    assert torch.equal(batched.fold_group(q, k, v, None, 0.3), want)
