"""Fused CUDA ops in Triton: a decode step's small work as a few kernels per layer, or None.

On an H100 a Llama-3.1-8B decode step at batch 1 spent ~1.6 of its ~7.2 ms of kernel time in ~1,000
small kernels beside the linears (BENCHMARKS.md): each RMSNorm was eight (cast, square, mean, add,
rsqrt, multiply, cast, weight), rotary four, the KV write two, every residual add and SiLU-and-mul
one or two. Here each of these is one kernel:
- `rms_norm`, and `add_rms_norm` (the residual add folded into the next norm: the sum is written
  once and normed in the same pass);
- `silu_and_mul` over the gate/up GEMM's output;
- `rotary_kv`: q and k rotated (after Qwen3's per-head q/k norm, where the layer has one), k and v
  written into the KV pool at the batch's slots, q returned; the triton backend's `fused_decode`
  then runs attention on it.
`FusedStack` runs a decoder's layers so (DecoderLM.fused_layers): per layer one norm, the q/k/v
GEMM, `rotary_kv`, attention, o_proj, an add + norm, gate/up, SiLU-mul, down, and the add into the
next layer's norm.

Rounding follows the torch ops they replace: bf16 / fp16 results are rounded where torch rounds
(the norm's normalized value before the weight, each rotary product before the sum, SiLU before
the multiply), all arithmetic in fp32; only reduction order and exp differ. The kernels compile with
`enable_fp_fusion=False`: with it on (Triton's default) LLVM narrowed rotary's rounded products to
bf16 multiplies and fused them with the add into one FMA, one rounding where torch has three (1 in
5 values of q off by an ulp on an H100). The kernels read
device tensors only (no host sync) and have fixed shapes per batch, so CUDA graphs capture them.
On CPU they run under Triton's interpreter, which is how the tests check them without a GPU;
`attach` wires them in on CUDA only (`--disable-cuda-fused`: off).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, n, eps,
    ADD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row: with ADD, s = x + residual (rounded to the dtype, stored at sum_ptr), else s = x;
    out = w * (s * rsqrt(mean(s^2) + eps)), the normalized value rounded before the weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(x.dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, inter, BLOCK: tl.constexpr):
    """out = silu(gate) * up over one row's block of columns; gate | up halves of gate_up."""
    row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * u.to(tl.float32)).to(g.dtype), mask=mask)


@triton.jit
def _head_norm(x, w, eps, D: tl.constexpr):
    """x [H, BLOCK_D] (zeros past D): per head x * rsqrt(mean(x^2) + eps), rounded, times w, rounded."""
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)
    return ((xf * rstd[:, None]).to(x.dtype).to(tl.float32) * w).to(x.dtype)


@triton.jit
def _rotary_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, loc_ptr, qn_ptr, kn_ptr, eps,
    stride_qkv, stride_cos, stride_q, stride_kt, stride_vt,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One token, BLOCK_H of its HEADS + 2 * KV_HEADS heads (q, then k, then v, as qkv_proj lays them
    out): q and k heads (normed first with QK_NORM) rotated by the half-split convention with the
    signed sin of RotaryEmbedding.cos_sin, q stored at q_ptr, k and v at the token's KV slot."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    half = D // 2
    partner = tl.where(d < half, d + half, d - half)
    live = (h < HEADS + 2 * KV_HEADS) & (d < D)
    row = qkv_ptr + t * stride_qkv + h * D
    x = tl.load(row + d, mask=live, other=0.0)
    xp = tl.load(row + partner, mask=live, other=0.0)
    is_q, is_v = h < HEADS, h >= HEADS + KV_HEADS
    if QK_NORM:
        wq = tl.load(qn_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        wk = tl.load(kn_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        wqp = tl.load(qn_ptr + partner, mask=d < D, other=0.0).to(tl.float32)
        wkp = tl.load(kn_ptr + partner, mask=d < D, other=0.0).to(tl.float32)
        normed = _head_norm(x, tl.where(is_q, wq, wk), eps, D)
        # the partner's value under the same head's norm: the head's rstd, the partner's weight
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)
        partner_normed = (xp.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32) * tl.where(is_q, wqp, wkp)
        xp = tl.where(is_v, xp, partner_normed.to(x.dtype))
        x = tl.where(is_v, x, normed)
    c = tl.load(cos_ptr + t * stride_cos + d, mask=d < D, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_cos + d, mask=d < D, other=0.0).to(tl.float32)
    a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    b = (xp.to(tl.float32) * s).to(x.dtype).to(tl.float32)
    rotated = (a + b).to(x.dtype)
    tl.store(q_ptr + t * stride_q + h * D + d, rotated.to(q_ptr.dtype.element_ty), mask=live & is_q)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    is_k = (h >= HEADS) & (h < HEADS + KV_HEADS)
    tl.store(k_ptr + slot * stride_kt + (h - HEADS) * D + d, rotated.to(k_ptr.dtype.element_ty), mask=live & is_k)
    tl.store(v_ptr + slot * stride_vt + (h - HEADS - KV_HEADS) * D + d, x.to(v_ptr.dtype.element_ty),
             mask=live & is_v)  # fmt: skip


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class FusedOps:
    """The kernels, called by the modules `attach` marks (the same names as the CPU ops where the
    job is the same: `rms_norm`, `silu_and_mul`)."""

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        return x.dtype in DTYPES and x.dim() == 2 and x.stride(-1) == 1

    @staticmethod
    def _norm(x, residual, weight, eps):
        x = _rows(x)
        n = x.shape[-1]
        out = torch.empty_like(x)
        total = torch.empty_like(x) if residual is not None else out
        res = _rows(residual) if residual is not None else x
        if x.shape[0]:
            _rms_norm_kernel[(x.shape[0],)](
                x, res, weight, out, total, x.stride(0), res.stride(0), out.stride(0), total.stride(0), n, eps,
                ADD=residual is not None, BLOCK=triton.next_power_of_2(n), enable_fp_fusion=False,
            )  # fmt: skip
        return out, total

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(x, None, weight, eps)[0]

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x): the residual stream's add and the next norm in one pass."""
        return self._norm(x, residual, weight, eps)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = _rows(gate_up)
        t, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(t, inter)
        block = min(1024, triton.next_power_of_2(inter))
        if t:
            _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                            BLOCK=block, enable_fp_fusion=False)  # fmt: skip
        return out

    @staticmethod
    def rotary_kv(qkv, cos, sin, attn, k_buf, v_buf, loc) -> torch.Tensor:
        """q/k/v of `qkv` [T, (H + 2 KV) * D]: k rotated and v stored at KV slots `loc` of k_buf / v_buf
        ([slots, KV, D]); returns q rotated [T, H, D] in the pool's dtype. `attn` gives the head counts and
        Qwen3's q/k norms; cos / sin from RotaryEmbedding.cos_sin ([T, 1, D], sin signed)."""
        qkv = _rows(qkv)
        t, heads, kv_heads, d = qkv.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
        q = torch.empty(t, heads, d, dtype=k_buf.dtype, device=qkv.device)
        cos, sin = cos.reshape(t, d), sin.reshape(t, d)
        norm = hasattr(attn, "q_norm")
        qn, kn = (attn.q_norm.weight, attn.k_norm.weight) if norm else (qkv, qkv)
        eps = attn.q_norm.eps if norm else 0.0
        block_h = min(16, triton.next_power_of_2(heads + 2 * kv_heads))
        if t:
            _rotary_kv_kernel[(t, triton.cdiv(heads + 2 * kv_heads, block_h))](
                qkv, cos, sin, q, k_buf, v_buf, loc, qn, kn, eps, qkv.stride(0), cos.stride(0), q.stride(0),
                k_buf.stride(0), v_buf.stride(0), HEADS=heads, KV_HEADS=kv_heads, D=d, QK_NORM=norm,
                BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d), enable_fp_fusion=False,
            )  # fmt: skip
        return q


class FusedStack:
    """A decoder's layers with each residual add folded into the next RMSNorm (DecoderLM.fused_layers
    on CUDA): the same sums and norms as DecoderLayer.forward, two kernels fewer per layer. Returns
    the last layer's output (the final norm stays the model's)."""

    def __init__(self, layers: list[torch.nn.Module], ops: FusedOps):
        self.layers, self.ops = layers, ops

    def serves(self, x: torch.Tensor, cos: torch.Tensor, backend) -> bool:
        return self.ops.takes(x) and x.shape[0] > 0  # attach gives it CUDA models only (tests: CPU, interpreted)

    def __call__(self, x, cos, sin, forward_batch, backend) -> torch.Tensor:
        ops, layers = self.ops, self.layers
        first = layers[0].input_layernorm
        residual, h = x, ops.rms_norm(x, first.weight, first.eps)
        for i, layer in enumerate(layers):
            out = layer.self_attn(h, cos, sin, forward_batch, backend)
            post = layer.post_attention_layernorm
            h, residual = ops.add_rms_norm(out, residual, post.weight, post.eps)
            out = layer.mlp(h)
            if i + 1 < len(layers):
                norm = layers[i + 1].input_layernorm
                h, residual = ops.add_rms_norm(out, residual, norm.weight, norm.eps)
        return residual + out


def stackable(layer: torch.nn.Module) -> bool:
    """A plain DecoderLayer with both RMSNorms and no tensor parallelism (its attention and MLP, dense
    or not, are called as they are)."""
    from common.models.decoder import DecoderLayer, RMSNorm

    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if type(layer) is not DecoderLayer or not all(type(n) is RMSNorm for n in norms):
        return False
    return getattr(layer.self_attn, "tp", None) is None and getattr(layer.mlp, "tp", None) is None


def usable(device: torch.device, dtype: torch.dtype, tp_size: int) -> str | None:
    """Why the fused ops do not apply to this runner (None: they do)."""
    if device.type != "cuda":
        return "not on CUDA"
    if dtype not in DTYPES:
        return f"dtype {dtype}"
    if tp_size > 1:
        return "tensor parallelism"
    return None


def attach(model: torch.nn.Module, backend, ops: FusedOps | None) -> int:
    """Give the model's RMSNorms and dense MLPs the ops, the triton backend (whose forwards then run
    rotary + KV write as one kernel from Attention.forward) and, where every layer is stackable, the
    decoder its FusedStack; with None take them away. Returns how many modules got them."""
    from common.models.decoder import give_fused_ops

    n, layers = give_fused_ops(model, ops)
    if hasattr(model, "fused_layers"):
        whole = bool(layers) and all(stackable(layer) for layer in layers)
        model.fused_layers = FusedStack(layers, ops) if whole and ops is not None else None
        n += model.fused_layers is not None
    if hasattr(backend, "cuda_fused"):
        backend.cuda_fused = ops
        n += 1
    return n if ops is not None else 0
