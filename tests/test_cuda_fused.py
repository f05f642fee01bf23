"""The fused CUDA ops (common/models/cuda_fused.py) on CPU under Triton's interpreter, fp32: each
kernel against the torch ops it replaces, and whole models through FusedStack and the triton
backend's fused rotary + KV write against the same models without them. (The interpreter rounds bf16
by truncation, so bf16 is checked on a GPU: tests/gpu/test_cuda_fused_gpu.py.)"""

import pytest
import torch
from torch.nn import functional as F

from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams
from common.forward.forward_batch import ForwardBatch
from common.models.decoder import Attention, RMSNorm
from common.models.packed_linear import PackedLinear
from common.models.rope import RotaryEmbedding, apply_rotary
from tests.decode_harness import Pair
from tests.oracle import hf_greedy

pytest.importorskip("triton", reason="the triton package is a dev dependency (.ci/setup installs it)")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="CPU runs need TRITON_INTERPRET=1 before triton loads (tests/conftest.py sets it)",
)
cuda_fused = pytest.importorskip("common.models.cuda_fused")
cuda_gemv = pytest.importorskip("common.models.cuda_gemv")


def _close(a, b):
    torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("width", [64, 300])
def test_norms_and_silu_match_the_torch_ops(width):
    g = torch.Generator().manual_seed(width)
    x, r = torch.randn(7, width, generator=g), torch.randn(7, width, generator=g) * 3
    norm = RMSNorm(width, 1e-5)
    norm.weight.data = torch.randn(width, generator=g)
    ops = cuda_fused.FusedOps()
    _close(ops.rms_norm(x, norm.weight, norm.eps), norm(x))
    normed, total = ops.add_rms_norm(x, r, norm.weight, norm.eps)
    assert torch.equal(total, r + x)
    _close(normed, norm(r + x))
    view = torch.randn(7, width + 5, generator=g)[:, :width]  # rows with a stride of their own
    _close(ops.rms_norm(view, norm.weight, norm.eps), norm(view.contiguous()))
    gate_up = torch.randn(7, 2 * width, generator=g)
    _close(ops.silu_and_mul(gate_up), F.silu(gate_up[:, :width]) * gate_up[:, width:])
    assert ops.rms_norm(x[:0], norm.weight, norm.eps).shape == (0, width)


class _Attn:  # what rotary_kv reads of an Attention module
    def __init__(self, heads, kv_heads, d, qk_norm, g):
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, d
        if qk_norm:
            self.q_norm, self.k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
            self.q_norm.weight.data, self.k_norm.weight.data = torch.randn(d, generator=g), torch.randn(d, generator=g)


@pytest.mark.parametrize("heads,kv_heads,d,qk_norm", [(4, 2, 16, False), (6, 1, 24, True), (3, 3, 8, False)])
def test_rotary_kv_matches_rotary_and_the_pool_write(heads, kv_heads, d, qk_norm):
    """q and k rotated (after the per-head norms), k and v at the tokens' slots, every other slot kept."""
    g = torch.Generator().manual_seed(d)
    t, slots = 5, 12
    attn = _Attn(heads, kv_heads, d, qk_norm, g)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, d).cos_sin(
        torch.tensor([0, 3, 9, 17, 200]), torch.float32
    )
    k_buf, v_buf = torch.randn(slots, kv_heads, d, generator=g), torch.randn(slots, kv_heads, d, generator=g)
    want_k, want_v = k_buf.clone(), v_buf.clone()
    loc = torch.tensor([4, 1, 9, 2, 11])
    q_ref = qkv[:, : heads * d].view(t, heads, d)
    k_ref = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
    if qk_norm:
        q_ref, k_ref = attn.q_norm(q_ref), attn.k_norm(k_ref)
    want_k[loc] = apply_rotary(k_ref, cos, sin)
    want_v[loc] = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    q = cuda_fused.FusedOps.rotary_kv(qkv, cos, sin, attn, k_buf, v_buf, loc)
    _close(q, apply_rotary(q_ref, cos, sin))
    _close(k_buf, want_k)
    assert torch.equal(v_buf, want_v)


def _logits(runner, prompts, steps=3):
    """A ragged extend over all prompts, then greedy decode steps: every forward's logits."""
    table = runner.req_to_token_pool.req_to_token
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    for row, p in zip(rows, prompts):
        runner.req_to_token_pool.write(row, 0, runner.kv_allocator.alloc(len(p) + steps))
    out = [runner.forward(ForwardBatch.extend(table, rows, [0] * len(prompts), prompts))[0]]
    ids, lens = out[0].argmax(-1), [len(p) for p in prompts]
    for _ in range(steps):
        out.append(runner.forward(ForwardBatch.decode(table, torch.tensor(rows), lens, ids))[0])
        ids, lens = out[-1].argmax(-1), [n + 1 for n in lens]
    return out


def _unpack(module: torch.nn.Module) -> None:
    """Each PackedLinear under `module` back to an nn.Linear of the same weight and bias."""
    for name, child in module.named_children():
        if isinstance(child, PackedLinear):
            w = child.weight
            linear = torch.nn.Linear(w.in_features, w.out_features, bias=w.bias is not None)
            linear.weight.data, linear.bias = w.weight, None if w.bias is None else torch.nn.Parameter(w.bias)
            setattr(module, name, linear)
        else:
            _unpack(child)


@pytest.mark.parametrize("variant", ["llama", "qwen3-moe", "deepseek-v3"])
def test_a_model_through_the_fused_ops_matches_it_without_them(checkpoint, variant, monkeypatch):
    """Every layer through FusedStack (residual adds in the norms; MoE and latent-attention layers too),
    rotary + KV write as one kernel where the attention is grouped-query, the linears of the decode
    steps through the GEMV."""
    path = checkpoint(variant)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 9, 30)]
    args = dict(max_total_tokens=256, max_running_requests=4, attention_backend="triton")
    plain, fused = ModelRunner(RunnerArgs(path, **args)), ModelRunner(RunnerArgs(path, **args))
    ops = cuda_fused.FusedOps()
    assert cuda_fused.attach(fused.model, fused.backend, ops) > 0
    assert isinstance(fused.model.fused_layers, cuda_fused.FusedStack)
    _unpack(fused.model.model)  # CPU fp32 runners pack their linears; a CUDA runner's are nn.Linear
    assert cuda_gemv.wrap(fused.model.model) > 0  # every linear of up to 16 rows through the GEMV
    cuda_gemv.tune(fused.model, timer=lambda fn, choice, rows: 0.0 if choice == "gemv16" else 1.0)
    calls, stacked, gemvs = [], [], []
    kernel = cuda_gemv.gemv
    monkeypatch.setattr(cuda_gemv, "gemv", lambda *a: gemvs.append(1) or kernel(*a))
    rotary, norm = ops.rotary_kv, ops.add_rms_norm
    ops.rotary_kv = lambda *a: calls.append(1) or rotary(*a)
    ops.add_rms_norm = lambda *a: stacked.append(1) or norm(*a)
    for step, (a, b) in enumerate(zip(_logits(fused, prompts), _logits(plain, prompts))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, step=step: f"forward {step}: {m}")
    grouped = any(isinstance(layer.self_attn, Attention) for layer in fused.model.model.layers)
    assert bool(calls) == grouped and gemvs
    layers = len(fused.model.model.layers)
    assert len(stacked) == 4 * (2 * layers - 1)  # two adds + norms per layer, but the last one's, per forward


def test_attach_leaves_tensor_parallel_and_other_layers_to_their_own_forward(checkpoint):
    runner = ModelRunner(RunnerArgs(checkpoint("llama"), max_total_tokens=64, max_running_requests=1))
    layer = runner.model.model.layers[0]
    assert cuda_fused.stackable(layer)
    layer.self_attn.tp = object()
    assert not cuda_fused.stackable(layer)
    assert cuda_fused.usable(torch.device("cpu"), torch.float32, 1) == "not on CUDA"
    assert runner.cuda_fused is None  # CPU: never attached by the runner


@pytest.mark.parametrize("variant", ["qwen3-moe", "deepseek-v3"])
def test_moe_and_mla_decode_through_static_buffers_match_hf_greedy(checkpoint, variant):
    """What a replayed CUDA graph runs for MoE and latent-attention models (the padded static buffers,
    triton backend), on CPU: HF's greedy tokens; MLA's verify and draft extends stay eager."""
    path = checkpoint(variant)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 40)), [3]]  # 3 requests: a bucket of 4 with one padding row
    pair = Pair(path, attention_backend="triton", static_decode_buffers=True)
    for i, p in enumerate(prompts):
        pair.submit(str(i), p, SamplingParams(max_new_tokens=6, ignore_eos=True))
    pair.wait([str(i) for i in range(len(prompts))])
    runner = pair.worker.runner
    try:
        for i, p in enumerate(prompts):
            assert pair.out.tokens[str(i)] == hf_greedy(path, p, 6), f"prompt {i}"
        assert sum(runner.decode_graphs.runs.values()) > 0
    finally:
        pair.close()
