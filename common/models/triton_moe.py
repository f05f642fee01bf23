"""The routed experts as a Triton grouped GEMM: `run_experts` of common/models/moe.py without a host sync.

Chosen with the attention backend: a model whose runner runs `--attention-backend triton` (the CUDA
default; on CPU only under Triton's interpreter, for tests) routes every `SparseMoE` through
`run_experts` here (`use_triton_experts`, called by the ModelRunner); every other backend keeps the
torch loop, which reads each expert's row count on the host (one sync per MoE layer).

The same sum, all on the device:
1. the (token, choice) pairs sorted by expert (a stable argsort); under expert parallelism a pair
   routed to another rank's expert gets the sentinel id E (this rank's expert count) and sorts last;
2. each expert's first sorted row by searchsorted (`offsets` [E + 1]; offsets[E]: the pairs kept);
3. a tile schedule (`tile_schedule`): tiles of BLOCK_M sorted rows, each inside one expert's rows
   (a tile never crosses an expert's boundary), numbered expert by expert. The tile count depends on
   the routing, so the grid is sized by a static bound, ceil(P / BLOCK_M) + min(E, P) - 1 for P
   pairs, and tiles past the real ones find an empty row range and return at once: the launch
   shape depends on the batch's shape alone, which is what a CUDA graph replays;
4. `_gate_up_kernel`: per (tile, block of intermediate columns) the tile's token rows gathered from
   x in place, times the expert's gate and up rows, fp32 accumulators, SiLU(gate) * up stored at the
   sorted rows ([P, I], the model's dtype);
5. `_down_kernel`: per (tile, block of hidden columns) those rows times the expert's down weight,
   scaled by each pair's routing weight and stored at the pair's own row ([P, H] fp32, zeros for
   pairs left out); the k choices of each token are summed in fp32 and cast back.
fp32 inputs multiply exactly (`ieee`), as the attention kernels do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from common.attention.triton_kernels import _dot, _launches

MIN_DOT = 16  # tl.dot wants every side >= 16
MAX_BLOCK = 64


def _block(n: int) -> int:
    return max(MIN_DOT, min(MAX_BLOCK, triton.next_power_of_2(n)))


def block_m(pairs: int, experts: int) -> int:
    """Rows per tile, from the shapes alone: about the mean rows per expert, 16 to 64."""
    return _block(-(-pairs // experts))


def max_tiles(pairs: int, experts: int, block: int) -> int:
    """The most tiles `pairs` rows over `experts` experts can need: each expert with rows wastes less
    than one tile, and at most min(E, P) experts have rows."""
    return max(1, -(-pairs // block) + min(experts, pairs) - 1)


def tile_schedule(sorted_ids: torch.Tensor, experts: int, block: int) -> tuple[torch.Tensor, ...]:
    """sorted_ids [P] (expert ids ascending, E for pairs left out) -> per tile of the static bound:
    (expert [n] int32, first row [n] int32, end of the expert's rows [n] int32; end 0 past the last
    real tile), computed on the device."""
    device = sorted_ids.device
    bounds = torch.arange(experts + 1, device=device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)  # [E + 1]: expert e's rows [offsets[e], offsets[e + 1])
    tiles = (offsets[1:] - offsets[:-1] + block - 1) // block
    ends = torch.cumsum(tiles, 0)  # expert e's tiles: [ends[e] - tiles[e], ends[e])
    t = torch.arange(max_tiles(sorted_ids.numel(), experts, block), device=device, dtype=ends.dtype)
    owner = torch.searchsorted(ends, t, right=True)  # E past the last real tile
    real = owner < experts
    e = owner.clamp(max=experts - 1)
    first = offsets[e] + (t - (ends[e] - tiles[e])) * block
    end = torch.where(real, offsets[e + 1], 0)
    return e.to(torch.int32), torch.where(real, first, 0).to(torch.int32), end.to(torch.int32)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, act_ptr, pair_of_row, tile_expert, tile_first, tile_end, hidden, inter, stride_xt,
    stride_we, stride_wn, stride_wk, stride_at, TOP_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tile, nb = tl.program_id(0), tl.program_id(1)
    first = tl.load(tile_first + tile)
    end = tl.load(tile_end + tile)
    if first < end:
        e = tl.load(tile_expert + tile).to(tl.int64)
        offs_m = first + tl.arange(0, BLOCK_M)
        m_ok = offs_m < end
        tokens = (tl.load(pair_of_row + offs_m, mask=m_ok, other=0) // TOP_K).to(tl.int64)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < inter
        w = w_ptr + e * stride_we
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < hidden
            a = tl.load(
                x_ptr + tokens[:, None] * stride_xt + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
            w_mask = k_ok[:, None] & n_ok[None, :]
            w_gate = tl.load(w + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
            w_up = tl.load(
                w + (offs_n + inter)[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0
            )
            gate += _dot(a, w_gate, IEEE)
            up += _dot(a, w_up, IEEE)
        act = gate * tl.sigmoid(gate) * up
        out = act_ptr + offs_m[:, None].to(tl.int64) * stride_at + offs_n[None, :]
        tl.store(out, act.to(act_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, out_ptr, route_w, pair_of_row, tile_expert, tile_first, tile_end, hidden, inter, stride_at,
    stride_we, stride_wn, stride_wk, stride_ot, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    tile, nb = tl.program_id(0), tl.program_id(1)
    first = tl.load(tile_first + tile)
    end = tl.load(tile_end + tile)
    if first < end:
        e = tl.load(tile_expert + tile).to(tl.int64)
        offs_m = first + tl.arange(0, BLOCK_M)
        m_ok = offs_m < end
        rows = offs_m.to(tl.int64)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        w = w_ptr + e * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < inter
            a = tl.load(
                act_ptr + rows[:, None] * stride_at + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
            b = tl.load(
                w + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                mask=k_ok[:, None] & n_ok[None, :],
                other=0.0,
            )
            acc += _dot(a, b, IEEE)
        pairs = tl.load(pair_of_row + offs_m, mask=m_ok, other=0).to(tl.int64)
        acc = acc * tl.load(route_w + pairs, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + pairs[:, None] * stride_ot + offs_n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def run_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    first_expert: int | None = None,
) -> torch.Tensor:
    """common/models/moe.py's `run_experts` (same arguments, same sum) as two grouped GEMM launches,
    with no host sync: x [T, H], ids / weights [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H]."""
    t, k = ids.shape
    local, inter2, hidden = gate_up.shape
    inter = inter2 // 2
    pairs = t * k
    if pairs == 0:
        return torch.zeros_like(x)
    flat = ids.reshape(-1)
    if first_expert is not None:  # pairs routed to other ranks' experts: the sentinel E, sorted last
        flat = flat - first_expert
        flat = torch.where((flat >= 0) & (flat < local), flat, local)
    order = torch.argsort(flat, stable=True)  # the pair of each sorted row
    bm = block_m(pairs, local)
    tile_e, tile_first, tile_end = tile_schedule(flat.index_select(0, order).contiguous(), local, bm)
    x = x.contiguous()
    route = weights.reshape(-1).contiguous()
    act = x.new_empty(pairs, inter)
    out = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
    tiles = tile_e.numel()
    ieee = x.dtype == torch.float32
    bn1, bk1 = _block(inter), _block(hidden)
    bn2, bk2 = _block(hidden), _block(inter)
    with _launches:
        _gate_up_kernel[(tiles, triton.cdiv(inter, bn1))](
            x, gate_up, act, order, tile_e, tile_first, tile_end, hidden, inter, x.stride(0), gate_up.stride(0),
            gate_up.stride(1), gate_up.stride(2), act.stride(0), TOP_K=k, IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn1,
            BLOCK_K=bk1,
        )  # fmt: skip
        _down_kernel[(tiles, triton.cdiv(hidden, bn2))](
            act, down, out, route, order, tile_e, tile_first, tile_end, hidden, inter, act.stride(0),
            down.stride(0), down.stride(1), down.stride(2), out.stride(0), IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn2,
            BLOCK_K=bk2,
        )  # fmt: skip
    return out.view(t, k, hidden).sum(dim=1).to(x.dtype)


def use_triton_experts(*modules: nn.Module) -> int:
    """Route every SparseMoE inside `modules` through `run_experts` here; returns how many."""
    from common.models.moe import SparseMoE

    moes = [m for root in modules for m in root.modules() if isinstance(m, SparseMoE)]
    for moe in moes:
        moe.experts_kernel = run_experts
    return len(moes)
