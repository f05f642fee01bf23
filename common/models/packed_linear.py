"""CPU fp32 linear layers: each weight kept in the layouts a host may want, one chosen per row count.

On CPU no single layout of a [out, in] weight is fastest everywhere: which one wins depends on the
rows (a decode step's batch, a verify's tokens, a prefill chunk) and on the host. Measured figures
(SmolLM2-135M's 121 linears): on a 2-core AMD EPYC (AVX2), one row took 25 ms as row blocks, 35
oneDNN-packed, 39 with F.linear; on a 2-core Intel Xeon with AVX-512/AMX the order flipped: 19.5 ms
F.linear, 22.5 oneDNN-packed, 48.9 row blocks. So the choice is measured at start-up
(`common/models/linear_tuning.py`), per weight shape and row bucket, and each weight dispatches on
it. The layouts:
- `mkl`: `F.linear` on the plain weight (MKL's sgemm; what transformers runs);
- `onednn`: oneDNN's blocked format, re-laid once (`BATCH_HINT`); its epilogue adds a residual;
- `rowblock`: `weight.view(parts, out / parts, in)` and one `torch.bmm`, which streams a GEMV's
  weight on all threads (a view of the plain weight: no copy); for up to GEMV_ROWS rows, where the
  fused CPU ops are loaded (common/models/cpu_fused.py), their `gemv` instead: each thread streams its
  own run of weight rows once and adds bias and residual itself (2-row steps 0.70-0.85x of bmm's on
  a 2-core AMD EPYC, 1 row 0.9-1.0x; above 4 rows in register tiles, 8-16 rows 0.5-0.7x of MKL's).
  Rows above 64 (prefill chunks) have a bucket of their own, timed at 256 rows.
- `panels`: the fused CPU ops' GEMM on the weight laid out once in panels of output columns
  (common/kernels/cpu_gemm.cpp): for many rows, where MKL and oneDNN re-lay the weight on every call
  (SmolLM2's linears at 50 rows, each weight from memory: 101-105 GFLOP/s against oneDNN's 56-85 and
  MKL's 44-82 on a 2-core AMD EPYC, AVX2). Without the fused ops it is F.linear.
`pack_linears(model)` swaps every nn.Linear for a `PackedLinear`; `LinearWeight` (also used for
lm_heads) holds the layouts of one weight.
The oneDNN and panel copies are dropped once the plan never uses them.
Results equal F.linear within fp32 rounding (another summation order). Only for CPU: on CUDA,
cuBLAS needs no such step and this module is never used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.models.direct_call import DirectCall

BATCH_HINT = 64  # oneDNN picks its blocking for this many rows; measured fine from 1 to 64
LAYOUTS = ("mkl", "onednn", "rowblock", "panels")
# the low-precision formats' layouts (common/models/low_precision.py): the weight-only formats' gemv, named
# as the format, and their panel GEMM; the matmul formats' one (bf16-matmul, w8a8)
LOW_PRECISION_LAYOUTS = ("w8", "w8-panels", "bf16", "bf16-panels", "bf16-matmul", "w8a8")
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 256)  # rows r use the plan of the first bucket >= r (the last above)
DEFAULT_PLAN = ("rowblock",) + ("onednn",) * (len(ROW_BUCKETS) - 1)  # before tuning: the AMD host's choice
GEMV_ROWS = 64  # the fused gemv serves rowblock up to this many rows (decode batches; prefill chunks: the bmm)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def bucket_index(rows: int) -> int:
    """Index into ROW_BUCKETS of the bucket that serves `rows` (1 -> 0, 3 -> 2, 1000 -> last). Written as
    comparisons so that torch.compile, tracing a symbolic row count, guards on the bucket's range
    instead of specializing on the count (common/models/compiled_layers.py)."""
    i = 0
    while i < len(ROW_BUCKETS) - 1 and rows > ROW_BUCKETS[i]:
        i += 1
    return i


# what the layouts read (a plan, the weight and its copies): any change to one of them on any LinearWeight
# bumps layout_version(), which FusedLayers' per-bucket choice of layouts keys on
_LAYOUT_STATE = frozenset({"plan", "weight", "panels", "low", "low_panels"})
_layout_version = 0


def layout_version() -> int:
    """How many times a LinearWeight's plan or layout copies changed (set-up, tuning, a test pinning a plan)."""
    return _layout_version


class LinearWeight:
    """One [out, in] weight in every layout; call it like F.linear, with an optional residual added
    to the result (`residual + x @ W.T + bias`). `plan[i]` is the layout for ROW_BUCKETS[i]."""

    def __setattr__(self, name: str, value) -> None:
        if name in _LAYOUT_STATE:
            global _layout_version
            _layout_version += 1
        object.__setattr__(self, name, value)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.detach().contiguous()
        self.out_features, self.in_features = self.weight.shape
        self.bias = None if bias is None else bias.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, BATCH_HINT)
        parts = next(p for p in (8, 4, 2, 1) if self.out_features % p == 0)
        self.blocks = self.weight.view(parts, self.out_features // parts, self.in_features)
        self.plan = DEFAULT_PLAN
        self.gemv = None  # the fused CPU ops' gemv (cpu_fused.attach), or None: bmm
        self.gemv_w8 = None  # their int8 gemv, for the w8 layout (common/models/low_precision.py)
        self.panels = self.gemm = None  # the panels layout's copy and GEMM (set_panels), or None: F.linear
        # a low-precision format's weight, the int8 formats' scale, the panels (or bf16 pairs, int8 quads) of
        # the weight, w8a8's scales laid out as its quads and the call (low_precision.py)
        self.low = self.low_scale = self.low_panels = self.low_panel_scales = self.low_run = None

    def relocate(self, weight: torch.Tensor) -> None:
        """Serve from `weight` (the same values elsewhere: common/models/weight_arena.py)."""
        self.weight = weight
        self.blocks = weight.view(self.blocks.shape)

    def set_panels(self, ops) -> None:
        """Lay the weight out for the fused ops' GEMM (`ops`: cpu_fused.FusedOps), or with None drop it."""
        self.gemm = None if ops is None else ops.gemm_panels
        self.panels = None if ops is None else ops.pack_panels(self.weight)

    @property
    def shape_key(self) -> tuple[int, int, bool]:
        """Weights with one key time alike: tuning measures one of them."""
        return self.out_features, self.in_features, self.bias is not None

    def set_plan(self, plan: tuple[str, ...]) -> None:
        if len(plan) != len(ROW_BUCKETS) or not set(plan) <= set(LAYOUTS):
            raise ValueError(f"a plan names one of {LAYOUTS} per row bucket {ROW_BUCKETS}, got {plan}")
        self.plan = tuple(plan)
        if "onednn" not in self.plan:
            self.packed = None  # its memory back: a second copy of the weight
        if "panels" not in self.plan:
            self.panels = None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2:  # the model's packed tokens: no reshapes
            return self.run(self.plan[bucket_index(x.shape[0])], x, residual)
        x2 = x.reshape(-1, x.shape[-1])
        layout = self.plan[bucket_index(x2.shape[0])]
        out = self.run(layout, x2, None if residual is None else residual.reshape(x2.shape[0], -1))
        return out.view(x.shape[:-1] + (self.out_features,))

    def run(self, layout: str, x2: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, out] through one layout (tuning times this)."""
        if layout in LOW_PRECISION_LAYOUTS:
            return self.low_run(self, x2, residual, layout)
        if layout == "onednn" and torch.compiler.is_compiling():
            layout = "mkl"  # Inductor lowers a packed oneDNN linear only for weights it froze (compiled_layers.py)
        if layout == "panels":
            if self.panels is not None and not torch.compiler.is_compiling():
                return self.gemm(x2.contiguous(), self.panels, self.out_features, self.bias, residual)
            layout = "mkl"  # no fused ops (or a graph Inductor traces: the op has no meta kernel)
        if layout == "onednn":
            if residual is None:
                return torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
            # the add fused into the GEMM's epilogue (oneDNN binary post-op): bit-identical, one op fewer
            return torch.ops.mkldnn._linear_pointwise.binary(x2, residual.contiguous(), self.packed, self.bias, "add")
        if layout == "mkl":
            if residual is not None and self.bias is None:  # the add inside the GEMM (beta = 1): one op fewer
                return torch.addmm(residual, x2, self.weight.t())
            out = F.linear(x2, self.weight, self.bias)
        elif self.gemv is not None and x2.shape[0] <= GEMV_ROWS:
            return self.gemv(x2.contiguous(), self.weight, self.bias, residual)
        else:
            rows = x2.shape[0]
            out = torch.bmm(self.blocks, x2.t().unsqueeze(0).expand(self.blocks.shape[0], -1, -1))
            out = out.view(1, -1) if rows == 1 else out.view(-1, rows).t().contiguous()  # [parts, out/parts, rows]
            if self.bias is not None:
                out = out + self.bias
        return out if residual is None else residual + out


class PackedLinear(DirectCall):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = LinearWeight(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight(x)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x) (see `common.models.decoder.linear_add`)."""
        return self.weight(x, residual)


def pack_linears(module: nn.Module) -> nn.Module:
    """Replace every nn.Linear under `module` (in place) by a PackedLinear."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child))
        else:
            pack_linears(child)
    return module


def linear_weights(*roots) -> list[LinearWeight]:
    """Every LinearWeight under the given modules (or LinearWeights themselves), each once."""
    found: dict[int, LinearWeight] = {}
    for root in roots:
        if isinstance(root, LinearWeight):
            found[id(root)] = root
        elif isinstance(root, nn.Module):
            for m in root.modules():
                for value in vars(m).values():
                    if isinstance(value, LinearWeight):
                        found[id(value)] = value
    return list(found.values())
