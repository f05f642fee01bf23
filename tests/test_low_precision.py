"""Low-precision linears on CPU (`--quantization w8 | bf16 | bf16-matmul | w8a8`, common/models/low_precision.py):
the kernels and every layout of a linear equal the dequantized weight's float32 product (bf16-matmul:
with the input rounded to bf16; w8a8: quantized per block). w8: a served model's greedy tokens agree with
HF's float32 argmax wherever HF's top-2 gap is wide (int8 is not token-exact by design: the policy the
bf16 tests use), and its logits stay close. bf16: widening is exact, so the served model is HF float32
with its linears' weights rounded to bf16, token for token; bf16-matmul: the same with every linear's
input rounded too; w8a8: HF float32 with its weights and every linear's input quantized, token for token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams
from common.forward.forward_batch import ForwardBatch
from common.models import low_precision
from common.models.packed_linear import ROW_BUCKETS, LinearWeight, linear_weights
from tests.decode_harness import Pair
from tests.oracle import hf_model
from tests.test_cpu_fused_layer import _count

GAP = 0.6  # an argmax may differ from HF fp32's only where its top-2 logits are closer than this
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3], list(range(61, 81))]
NEW = 24


def pinned(fmt: str, plan: str) -> tuple[str, ...]:
    """A decode plan of one layout in every decode bucket (low_precision.set_plan): the format's gemv
    (panels past GEMV_ROWS) or its panels."""
    if plan == "gemv":
        return (fmt,) * (len(ROW_BUCKETS) - 1) + (f"{fmt}-panels",)
    return (f"{fmt}-panels",) * len(ROW_BUCKETS)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 18, 64])
@pytest.mark.parametrize("k", [576, 577, 40])
def test_gemv_w8_is_the_dequantized_product(ops, rows, k):
    torch.manual_seed(rows * 1000 + k)
    w = torch.randn(96, k)
    q, scale = low_precision.quantize_rows(w)
    assert q.dtype == torch.int8 and (q.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-6
    x, b, r = torch.randn(rows, k), torch.randn(96), torch.randn(rows, 96)
    ref = r.double() + x.double() @ (q.double() * scale.double()[:, None]).T + b.double()
    torch.testing.assert_close(ops.gemv_w8(x, q, scale, b, r).double(), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops.gemv_w8(x, q, scale, None, None).double(), ref - r - b, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="int8"):
        ops.gemv_w8(x, w, scale, None, None)
    panels = ops.pack_panels(q)  # the w8-panels layout: the panel GEMM on int8 panels, the scale per output
    assert panels.dtype == torch.int8
    torch.testing.assert_close(ops.gemm_panels(x, panels, 96, b, r, scale).double(), ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="a scale"):
        ops.gemm_panels(x, panels, 96, b, r)  # int8 panels without their scale
    with pytest.raises(RuntimeError, match="a scale"):
        ops.gemm_panels(x, ops.pack_panels(w), 96, b, r, scale)  # a scale with float32 panels


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 18, 64])
@pytest.mark.parametrize("k", [576, 577, 40])
def test_gemv_on_bf16_weights_is_the_widened_product(ops, rows, k):
    torch.manual_seed(rows * 1000 + k)
    w = torch.randn(96, k).to(torch.bfloat16)
    x, b, r = torch.randn(rows, k), torch.randn(96), torch.randn(rows, 96)
    ref = r.double() + x.double() @ w.double().T + b.double()
    torch.testing.assert_close(ops.gemv(x, w, b, r).double(), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops.gemv(x, w, None, None).double(), ref - r - b, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.gemv(x, w.to(torch.float16), None, None)
    panels = ops.pack_panels(w)  # the bf16-panels layout
    assert panels.dtype == torch.bfloat16
    torch.testing.assert_close(ops.gemm_panels(x, panels, 96, b, r).double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 12, 13, 64, 100])
@pytest.mark.parametrize("n,k", [(96, 576), (33, 40), (70, 2), (300, 64)])
def test_gemm_bf16_is_the_product_of_the_rounded_input_and_does_not_depend_on_the_batch(ops, rows, n, k):
    """The bf16 matmul (vdpbf16ps where the CPU has it, the weights widened in registers where not) equals
    the float64 product of x rounded to bf16 with the bf16 weight, residual and bias added; far from the
    product of the unrounded x (the rounding is applied); and each row's sums are the same bits alone as
    in the batch (one order of summation over k whatever the tile)."""
    torch.manual_seed(rows * 1000 + k)
    w = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
    x, b, r = torch.randn(rows, k), torch.randn(n), torch.randn(rows, n)
    pairs = ops.pack_bf16_pairs(w)
    assert pairs.dtype == torch.bfloat16 and pairs.shape[1:] == (k // 2, pairs.shape[2], 2)
    got = ops.gemm_bf16(x, pairs, n, b, r)
    rounded = r.double() + x.to(torch.bfloat16).double() @ w.double().T + b.double()
    torch.testing.assert_close(got.double(), rounded, rtol=1e-5, atol=1e-5)
    unrounded = r.double() + x.double() @ w.double().T + b.double()
    assert (got.double() - unrounded).abs().max() > 1e-4 * k**0.5
    torch.testing.assert_close(ops.gemm_bf16(x, pairs, n, None, None).double(), rounded - r - b, rtol=1e-5, atol=1e-5)
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(ops.gemm_bf16(x[i : i + 1], pairs, n, b, r[i : i + 1])[0], got[i])
    with pytest.raises(RuntimeError, match="even K"):
        ops.pack_bf16_pairs(torch.randn(n, k + 1).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.pack_bf16_pairs(w.float())
    with pytest.raises(RuntimeError, match="K = x's"):
        ops.gemm_bf16(torch.randn(rows, k + 2), pairs, n, None, None)


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 13, 64, 100])
@pytest.mark.parametrize(
    "n,k,block,w_block",
    [
        (96, 576, 16, 32),
        (100, 576, 16, 32),  # at one row a partial last panel beside a whole one (two streams)
        (96, 576, 32, 32),
        (33, 64, 16, 64),
        (70, 4, 4, 4),
        (300, 64, 64, 64),
        (40, 96, 32, 96),
    ],
)
def test_gemm_int8_is_the_product_of_the_quantized_input_and_does_not_depend_on_the_batch(
    ops, threads, rows, n, k, block, w_block
):
    """The int8 matmul (w8a8): the float64 product of x quantized per block and the dequantized weight
    (its integer sums exact, the float steps within float32's error); far from the unquantized x's
    product (the quantization is applied); each row's bits alone equal its bits in the batch; a zero
    block of x contributes nothing (its scale 1, not 0 / 0). On two threads: at many rows they quantize x's
    groups side by side into the calling thread's buffer."""
    threads(2)
    torch.manual_seed(rows * 1000 + n + k)
    q, scale = low_precision.quantize_blocks(torch.randn(n, k), w_block)
    x, b, r = torch.randn(rows, k), torch.randn(n), torch.randn(rows, n)
    if k > block:
        x[0, :block] = 0
    quads, scales = ops.pack_int8_quads(q), ops.pack_int8_scales(scale)
    assert quads.dtype == torch.uint8 and tuple(quads.shape[1:]) == (k // 4, quads.shape[2], 4)
    assert scales.dtype == torch.bfloat16 and tuple(scales.shape) == (quads.shape[0], k // w_block, quads.shape[2])
    got = ops.gemm_int8(x, quads, scales, n, block, b, r)
    exact = low_precision.dequantize(q, scale).double()
    want = r.double() + low_precision.quantized_input(x, block).double() @ exact.T + b.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    if k >= 16:
        assert (got.double() - (r.double() + x.double() @ exact.T + b.double())).abs().max() > 1e-3
    torch.testing.assert_close(ops.gemm_int8(x, quads, scales, n, block, None, None).double(), want - r - b,
                               rtol=1e-5, atol=1e-4)  # fmt: skip
    for i in range(rows):
        assert torch.equal(ops.gemm_int8(x[i : i + 1], quads, scales, n, block, b, r[i : i + 1])[0], got[i])
    with pytest.raises(RuntimeError, match="multiple of 4"):
        ops.pack_int8_quads(torch.zeros(n, k + 2, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="int8"):
        ops.pack_int8_quads(q.float())
    with pytest.raises(RuntimeError, match="block"):
        ops.gemm_int8(x, quads, scales, n, 3, b, r)
    if k % (2 * w_block) == 0:
        with pytest.raises(RuntimeError, match="a multiple of the block"):  # x's blocks must not straddle the scales'
            ops.gemm_int8(x, quads, scales, n, 2 * w_block, b, r)
    with pytest.raises(RuntimeError, match="scales"):  # the scales of other blocks, or of other columns
        ops.gemm_int8(
            x, quads, ops.pack_int8_scales(torch.ones(n, k // block + 1, dtype=torch.bfloat16)), n, block, b, r
        )
    with pytest.raises(RuntimeError, match="scales"):
        ops.gemm_int8(x, quads, scales.float(), n, block, b, r)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.pack_int8_scales(scale.float())


@pytest.mark.parametrize("block", [32, 4])
def test_w8a8_weights_have_a_bf16_scale_per_row_and_block(block):
    """quantize_blocks: each block's scale is a bf16 at or just above its absmax / 127 (so the largest weight
    maps to 127 or just under, never clipped), each weight within half its own block's step of the original;
    a block of zeros has scale 1; one large weight coarsens only its own block."""
    torch.manual_seed(block)
    w = torch.randn(40, 128)
    w[3, 0] = 1000.0
    w[7, block : 2 * block] = 0
    q, scale = low_precision.quantize_blocks(w, block)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (40, 128 // block)
    absmax = w.reshape(40, -1, block).abs().amax(-1)
    step = scale.float()
    assert (step[absmax > 0] >= absmax[absmax > 0] / 127).all()
    assert (step[absmax > 0] <= absmax[absmax > 0] / 127 * (1 + 2**-7)).all()  # within one bf16 step
    assert step[7, 1] == 1 and (q[7, block : 2 * block] == 0).all()
    err = (low_precision.dequantize(q, scale) - w).abs()
    assert (err <= step.repeat_interleave(block, dim=1) / 2 + 1e-6).all()
    assert err[3, block:].max() < 0.02 and err[3, :block].max() > 0.5  # the outlier's block only


@pytest.mark.parametrize("fmt", low_precision.FORMATS)
@pytest.mark.parametrize("rows", [1, 9, 64, 65])
def test_a_low_precision_linear_runs_both_paths_as_its_dequantized_weight(ops, fmt, rows):
    """Each layout of the format (w8 / bf16: its gemv, its panels, past GEMV_ROWS the panels;
    bf16-matmul, w8a8: its one) and, without the fused ops, one GEMM on a dequantized copy, is the
    float32 product with the dequantized weight (residual and bias included; bf16-matmul: of x rounded
    to bf16, w8a8: of x quantized); quantize plans the format's layouts per row bucket (w8 / bf16: timed)."""
    torch.manual_seed(rows)
    lw, plain = (LinearWeight(torch.randn(64, 64), torch.randn(64)) for _ in range(2))
    plain.weight.copy_(lw.weight)
    plain.bias.copy_(lw.bias)
    lw.gemv, lw.gemv_w8 = ops.gemv, ops.gemv_w8
    lw.set_panels(ops)  # as the fused ops' attach leaves it: quantize drops the copy
    fp32 = lw.weight.clone()
    scales = {"w8": 64 * 4, "w8a8": 64 * 64 // low_precision.W_BLOCK * 2}.get(fmt, 0)  # per row / per block, bf16
    assert low_precision.quantize([lw], fmt, ops) == 64 * 64 * low_precision.BYTES[fmt] + scales
    assert low_precision.quantize([plain], fmt) == 64 * 64 * low_precision.BYTES[fmt] + scales  # no fused ops
    assert lw.packed is None and lw.panels is None
    mine = low_precision.layouts(fmt)
    assert set(lw.plan) <= set(mine) and lw.plan[-1] == mine[-1]
    assert lw.low.dtype == low_precision.DTYPES[fmt]
    assert lw.low_panels.dtype == (torch.uint8 if fmt == "w8a8" else low_precision.DTYPES[fmt])
    if low_precision.DTYPES[fmt] == torch.bfloat16:  # rounded to nearest: torch's conversion, within half an ulp
        assert torch.equal(low_precision.dequantized(lw), fp32.to(torch.bfloat16).float())
    x, res = torch.randn(rows, 64), torch.randn(rows, 64)
    x_in = {"bf16-matmul": x.to(torch.bfloat16).float(), "w8a8": low_precision.quantized_input(x)}.get(fmt, x)
    want = res + F.linear(x_in, low_precision.dequantized(lw), lw.bias)
    torch.testing.assert_close(lw(x, res), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(plain(x, res), want, rtol=1e-5, atol=1e-4)
    for layout in mine:
        torch.testing.assert_close(lw.run(layout, x, res), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="low-precision plan"):
        low_precision.set_plan([lw], ("panels",) * len(ROW_BUCKETS))
    with pytest.raises(ValueError, match="must be one of"):
        low_precision.quantize([lw], "int4")


def _hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(path)(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("plan", ["gemv", "panels"])
def test_served_w8_tokens_agree_with_hf_where_its_gap_is_wide_and_logits_stay_close(checkpoint, ops, plan):
    """The pair with w8 on both sides (prefill: its measured plan; decode pinned to the int8 gemv or
    the int8 panel GEMM, its steps the whole-stack step) decodes greedily; HF fp32 then reads each
    answer teacher-forced: every token we chose is HF's argmax at that position wherever HF's top-2 gap
    is >= GAP. And one teacher-forced pass of our w8 runner gives logits within a small share of the
    logits' spread of HF's."""
    path = checkpoint("llama")
    pair = Pair(path, quantization="w8", kv_cache_dtype="float32")
    weights = linear_weights(pair.worker.runner.model)
    assert pair.link.worker.runner.linear_table is None  # no fp32 layout table: the format's own plan
    assert all(set(w.plan) <= {"w8", "w8-panels"} for w in weights)
    low_precision.set_plan(weights, pinned("w8", plan))
    counting = _count(pair.worker.runner)  # decode steps of 1-4 rows: the whole stack in one call, int8
    try:
        pair.run(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        assert counting.calls > 0
    finally:
        pair.close()
    checked = 0
    for i, p in enumerate(PROMPTS):
        out = pair.out.tokens[str(i)]
        logits = _hf_logits(path, p + out)[len(p) - 1 : -1]  # the logits each of our tokens was chosen from
        top2 = logits.topk(2, dim=-1).values
        wide = top2[:, 0] - top2[:, 1] >= GAP
        agree = logits.argmax(-1) == torch.tensor(out)
        assert bool(agree[wide].all()), (i, out, logits.argmax(-1).tolist())
        checked += int(wide.sum())
    assert checked >= len(PROMPTS) * NEW // 2  # most positions are wide: the check is not vacuous
    ids = list(range(10, 90))
    runner = ModelRunner(
        RunnerArgs(path, max_total_tokens=128, max_running_requests=1, quantization="w8", kv_cache_dtype="float32")
    )
    row = runner.req_to_token_pool.alloc()
    runner.req_to_token_pool.write(row, 0, runner.kv_allocator.alloc(len(ids)))
    fb = ForwardBatch.extend(runner.req_to_token_pool.req_to_token, [row], [0], [ids], all_logits=True)
    with torch.inference_mode():
        ours = runner.forward(fb)[0].float()
    ref = _hf_logits(path, ids)
    print(f"w8 teacher-forced: max |diff| {(ours - ref).abs().max():.4f}, logits std {ref.std():.3f}, "
          f"wide positions {checked}")  # fmt: skip
    assert (ours - ref).abs().max() < 0.15 * ref.std(), ((ours - ref).abs().max(), ref.std())


def _ties(x: torch.Tensor, block: int = low_precision.X_BLOCK) -> int:
    """How many of x's values quantized_input finds exactly halfway between two int8 steps (x / s = n + 1/2):
    there a last-bit difference in x picks the other step, so an oracle that meets one does not decide the
    token."""
    blocks = x.reshape(*x.shape[:-1], -1, block)
    v = blocks / (blocks.abs().amax(-1, keepdim=True) / 127)
    return int((v - v.floor() == 0.5).sum())


def _untied(hf, generate) -> list[int] | None:
    """The oracle `hf`'s tokens from generate(), or None where its w8a8 input rounding met a tie while making
    them (_ties: a last-bit difference, not the format, decides that input's step; an oracle without
    `ties` meets none)."""
    ties = getattr(hf, "ties", 0)
    tokens = generate()
    return None if getattr(hf, "ties", 0) > ties else tokens


def _hf_rounded(path: str, fmt: str, inputs: bool = True):
    """HF float32 with every linear's weight (the lm_head's too, untied from the embedding, which stays
    float32 as ours does) as `fmt` stores it: rounded to bf16 (bf16, bf16-matmul) or dequantized int8
    (w8a8: a scale per row and block), the model `--quantization bf16` serves; for bf16-matmul and w8a8
    (unless `inputs` is False) every linear's input rounded to bf16 / quantized as well (a forward
    pre-hook): the model those formats serve. w8a8 counts its inputs' rounding ties in `model.ties`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.ties = 0

    def quantized(x):
        model.ties += _ties(x)
        return low_precision.quantized_input(x)

    rounding = {"bf16-matmul": lambda x: x.to(torch.bfloat16).float(), "w8a8": quantized}.get(fmt) if inputs else None
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(low_precision.dequantize(*low_precision.stored(module.weight, fmt)))
                if rounding is not None:
                    module.register_forward_pre_hook(lambda _, args: (rounding(args[0]),))
    return model


@pytest.mark.parametrize(
    "fmt,name,plan",
    [
        ("bf16", "llama", "gemv"),
        ("bf16", "llama", "panels"),
        ("bf16", "qwen2-tied", "gemv"),
        ("bf16", "qwen3", "panels"),
        ("bf16-matmul", "llama", None),
        ("bf16-matmul", "qwen2-tied", None),
        ("bf16-matmul", "qwen3", None),
        ("w8a8", "llama", None),
        ("w8a8", "qwen2-tied", None),
        ("w8a8", "qwen3", None),
    ],
)
def test_served_tokens_equal_hf_fp32_with_the_same_rounding(checkpoint, ops, fmt, name, plan):
    """The pair with the format on both sides decodes greedily, token for token as HF float32 generate
    with the same rounding: bf16 (prefill: its measured plan; decode pinned to the bf16 gemv or the bf16
    panel GEMM, each bf16 weight widened in registers) as HF with its linears' weights rounded;
    bf16-matmul (its one layout: the bf16 matmul) as HF with their inputs rounded too; w8a8 (its one
    layout: the int8 matmul) as HF with its weights (a scale per row and block) and inputs quantized per
    block; a prompt whose oracle meets a rounding tie in some input (_ties) is left out, at most one. Decode
    steps of 1-4 rows run the whole stack in one call. Not vacuous: the oracle's logits differ from HF
    float32's (bf16-matmul, w8a8: from the weights-only model's too)."""
    path = checkpoint(name)
    pair = Pair(path, quantization=fmt, kv_cache_dtype="float32")
    weights = linear_weights(pair.worker.runner.model)
    measured = weights[0].plan  # what quantize planned here: one plan for all, the panels past GEMV_ROWS
    assert all(w.plan == measured for w in weights) and set(measured) <= set(low_precision.layouts(fmt))
    assert measured[-1] == low_precision.layouts(fmt)[-1]
    if plan is not None:
        low_precision.set_plan(weights, pinned(fmt, plan))
    counting = _count(pair.worker.runner)
    stored = low_precision.DTYPES[fmt]
    try:
        pair.run(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        assert all(w.low.dtype == stored for w in weights)
        assert all(w.low_panels.dim() == (4 if fmt in low_precision.MATMULS else 3) for w in weights)
        assert counting.calls > 0
    finally:
        pair.close()
    hf = _hf_rounded(path, fmt)
    rounded_logits, decided = [], 0
    for i, p in enumerate(PROMPTS):
        ours = pair.out.tokens[str(i)]
        with torch.inference_mode():
            want = _untied(hf, lambda p=p: hf.generate(
                torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(p) :].tolist())  # fmt: skip
            rounded_logits.append(hf(torch.tensor([p + ours])).logits[0])
        if want is not None:
            decided += 1
            assert ours == want, (name, i)
    assert decided >= len(PROMPTS) - 1, "the oracle's input rounding met a tie in more than one prompt"
    moved = max((a - _hf_logits(path, p + pair.out.tokens[str(i)])).abs().max() for i, (p, a) in
                enumerate(zip(PROMPTS, rounded_logits)))  # fmt: skip
    assert moved > 1e-4  # the rounded model's logits differ from fp32's: the oracle saw the rounding
    if fmt in low_precision.MATMULS:  # and the quantized inputs move them beyond the weights' alone
        weights_only = _hf_rounded(path, fmt, inputs=False)
        with torch.inference_mode():
            p = PROMPTS[1] + pair.out.tokens["1"]
            assert (weights_only(torch.tensor([p])).logits[0] - rounded_logits[1]).abs().max() > 1e-4


def test_low_precision_is_refused_where_it_does_not_apply(checkpoint):
    path = checkpoint("llama")
    with pytest.raises(ValueError, match="--quantization must be one of"):
        ModelRunner(RunnerArgs(path, max_total_tokens=64, max_running_requests=1, quantization="int4"))
    with pytest.raises(ValueError, match="CPU float32"):
        ModelRunner(RunnerArgs(path, max_total_tokens=64, max_running_requests=1, quantization="w8", dtype="bfloat16"))
    with pytest.raises(ValueError, match="bf16 is for CPU float32"):
        ModelRunner(
            RunnerArgs(path, max_total_tokens=64, max_running_requests=1, quantization="bf16", torch_compile_max_bs=1)
        )
    with pytest.raises(ValueError, match="in-features must be even"):  # its products go by pairs of k
        low_precision.quantize([LinearWeight(torch.randn(8, 5))], "bf16-matmul")
    with pytest.raises(ValueError, match="in-features must be a multiple of 32"):  # its input's blocks
        low_precision.quantize([LinearWeight(torch.randn(8, 48))], "w8a8")
