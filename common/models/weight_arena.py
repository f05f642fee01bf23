"""CPU linear weights in one arena backed by 2 MiB pages, so a decode step streams them at the
host's full memory bandwidth.

A batch-1 CPU decode step is the weights read once. Measured on a 2-core AMD EPYC (AVX2,
2026-11-26), a streaming read over SmolLM2-135M's 121 linear weights as torch allocated them (each
its own allocation, 4 KiB pages: transparent huge pages are `madvise` on most distributions, and
torch asks for none) ran at 0.89x the bandwidth of one read over one large buffer; the same weights
copied into one arena whose pages were advised huge ran at 0.99x. Fewer page walks (one TLB entry
per 2 MiB instead of per 4 KiB) and no page-boundary gaps between allocations.

1. `hugepage_empty(numel)`: an fp32 tensor 2 MiB-aligned, `madvise(MADV_HUGEPAGE)` on its range
   before any page is touched (so the first write faults in huge pages); where THP is off or this
   is not Linux, a plain aligned tensor (nothing lost but the pages' size), and one log line says so.
2. `place(weights, *roots)`: copies each LinearWeight's plain weight into the arena (in the given
   order: the model's), points the LinearWeight at its view (`relocate`), and every parameter of
   `roots` that shared the old storage (a tied embedding) at the same view, so nothing is held twice;
   the old tensors are freed when the last reference goes. Weights that are one tensor are placed once.
3. `gather(owners, attr)`: the same for tensors of any dtype that the fused ops packed from the weights
   (the int8 quads of w8a8, the bf16 pairs, the panels): each owner's `attr` moved into one arena. The
   packing ops allocate their outputs as torch does, on 4 KiB pages: measured on a 2-core AMD EPYC
   (Zen 4, 2026-11-28), w8a8's int8 matmul at one row streamed 30 gate_up-shaped weights at 24.0 GB/s
   from those, 27.0 GB/s from an arena.
`bench.floor` reads its bandwidth buffer from `hugepage_empty` too: the floor it reports is the
host's best, not one that 4 KiB pages lower.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

log = logging.getLogger(__name__)
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux


def _advise_huge(address: int, length: int) -> bool:
    if not sys.platform.startswith("linux") or length <= 0:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0


def hugepage_empty(numel: int) -> torch.Tensor:
    """An uninitialized fp32 tensor of `numel` elements, 2 MiB-aligned, its pages advised huge."""
    slack = HUGE_PAGE // 4
    raw = torch.empty(numel + slack, dtype=torch.float32)  # this large: freshly mapped, untouched pages
    start = raw.data_ptr()
    aligned = -(-start // HUGE_PAGE) * HUGE_PAGE
    offset = (aligned - start) // 4
    end = start + raw.numel() * 4
    if not _advise_huge(aligned, (end - aligned) // HUGE_PAGE * HUGE_PAGE) and not _refusal_logged:
        _log_refusal()
    return raw[offset : offset + numel]


_refusal_logged = False


def _log_refusal() -> None:
    """Once per process: the host keeps 4 KiB pages (a batch-1 CPU step then reads its weights slower)."""
    global _refusal_logged
    _refusal_logged = True
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "not available"
    log.info("weight arena: 2 MiB pages refused (errno %d; transparent huge pages: %s); 4 KiB pages, slower "
             "weight reads", ctypes.get_errno(), thp)  # fmt: skip


def place(weights: list, *roots: torch.nn.Module) -> int:
    """Move `weights` (LinearWeights, CPU fp32) into one arena; returns its bytes. Each old tensor is
    let go as soon as its copy is made (the arena's pages fault in as they are written), so the
    peak is about the weights once plus the largest of them."""
    groups: dict[int, list] = {}  # an old tensor's address -> the LinearWeights that serve from it
    for w in weights:
        groups.setdefault(w.weight.data_ptr(), []).append(w)
    shared: dict[int, list[torch.nn.Parameter]] = {}  # parameters on the same memory (a tied embedding)
    for root in roots:
        for p in root.parameters() if isinstance(root, torch.nn.Module) else ():
            if p.data_ptr() in groups:
                shared.setdefault(p.data_ptr(), []).append(p)
    total = sum(ws[0].weight.numel() for ws in groups.values())
    if total == 0:
        return 0
    arena = hugepage_empty(total)
    log.info("CPU linear weights: %.0f MB in one arena of 2 MiB pages", total * 4 / 1e6)
    offset = 0
    for ptr, ws in groups.items():
        old = ws[0].weight
        view = arena[offset : offset + old.numel()].view(old.shape).copy_(old)
        offset += old.numel()
        for w in ws:
            w.relocate(view)
        for p in shared.get(ptr, ()):
            if p.shape == view.shape and p.dtype == view.dtype:
                p.data = view
        del old
    return total * 4


def gather(owners: list, attr: str) -> int:
    """Move each owner's tensor `attr` (CPU, contiguous, any dtype; owners whose `attr` is None are
    skipped) into one arena, in order, each 64-byte aligned; the owner then holds a view, and its old
    tensor is freed once copied if nothing else holds it. Returns the arena's bytes."""
    held = [o for o in owners if getattr(o, attr) is not None]
    sizes = [-(-getattr(o, attr).numel() * getattr(o, attr).element_size() // 64) * 64 for o in held]
    total = sum(sizes)
    if total == 0:
        return 0
    arena = hugepage_empty(total // 4).view(torch.uint8)
    offset = 0
    for owner, size in zip(held, sizes):
        old = getattr(owner, attr)
        nbytes = old.numel() * old.element_size()
        view = arena[offset : offset + nbytes].view(old.dtype).view(old.shape).copy_(old)
        setattr(owner, attr, view)
        offset += size
        del old
    return total
