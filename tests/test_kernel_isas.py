"""The fused CPU kernels built for the lesser ISAs this host can run, as hosts with less would build them.

`-march=native` (common/models/cpu_fused.py) compiles one of several forms of every kernel: AVX-512,
AVX-512 with BF16's `vdpbf16ps` (the bf16 matmul) and VNNI's `vpdpbusd` (the int8 matmul), AVX2 + FMA,
or one lane. CI lands on hosts of every shape, and each tests only its own form; here each lesser form
this host can run (one lane, AVX2, and on an AVX-512 host AVX-512 without BF16 and VNNI) is built into a
folder of its own, in a subprocess (a library registers its ops once per process), and checked: the
bf16 matmul gives the same bits as its float32 definition (per k pair the odd product, then the even
one, added in k order); the int8 matmul the same bits as this host's native build (its integer sums are
exact, its float steps fused multiply-adds in block order on every form) and the float64 product of the
quantized input; and the gemv and panel GEMM on fp32 / bf16 / int8 weights equal the float64 product.
~20-45 s a build on 2 cores: a drill.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _host_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())


def lesser_isas() -> list[str]:
    """The -march values below this host's own that it can run."""
    flags = _host_flags()
    isas = ["x86-64"]
    if {"avx2", "fma"} <= flags:
        isas.append("haswell")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        isas.append("skylake-avx512")
    return isas


# (rows, n, k, x's block, the weights' block)
INT8_CASES = (
    (1, 300, 64, 16, 32),
    (1, 100, 576, 16, 32),  # a partial last panel beside a whole one (one row: two streams)
    (2, 70, 96, 32, 32),
    (7, 33, 64, 16, 64),
    (64, 96, 576, 16, 32),
    (100, 40, 32, 32, 32),
)


def int8_inputs(rows: int, n: int, k: int, w_block: int):
    """The int8 matmul's inputs of one case, the same in every process: (x, int8 w, its scale per row and block,
    bias, residual)."""
    import torch

    from common.models import low_precision

    gen = torch.Generator().manual_seed(rows * 100_000 + n * 1000 + k)
    q, scale = low_precision.quantize_blocks(torch.randn(n, k, generator=gen), w_block)
    x, b, r = (torch.randn(*shape, generator=gen) for shape in ((rows, k), (n,), (rows, n)))
    return x, q, scale, b, r


def int8_outputs(ops) -> list:
    """gemm_int8 on INT8_CASES with `ops`."""
    outs = []
    for rows, n, k, block, w_block in INT8_CASES:
        x, q, scale, b, r = int8_inputs(rows, n, k, w_block)
        outs.append(ops.gemm_int8(x, ops.pack_int8_quads(q), ops.pack_int8_scales(scale), n, block, b, r))
    return outs


def check_bf16_kv_attention(ops, march: str) -> None:
    """decode_attention over bf16 caches gives the bits it gives over float32 caches holding the same values, for
    a decode (each bf16 row widened as it is read) and an extend (each request's rows widened once first). The
    new tokens' K and V are bf16 values and the rotary the identity, so both caches receive the same values."""
    import torch

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d, n = 9, 3, 64, 300
    caches = [torch.randn(n + 1, kv_heads, d, generator=gen).to(torch.bfloat16) for _ in range(2)]
    rows = torch.stack([torch.randperm(n, generator=gen)[:200] + 1 for _ in range(2)])
    cases = {  # (tokens' lengths, their requests): a decode of two requests; an extend of 3 + 2 new tokens
        "decode": (torch.tensor([200, 37]), None),
        "extend": (torch.tensor([198, 199, 200, 36, 37]), torch.tensor([0, 0, 0, 1, 1])),
    }
    for name, (seq, requests) in cases.items():
        t = len(seq)
        qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(torch.bfloat16).float()
        cos, sin = torch.ones(t, d), torch.zeros(t, d)
        owner = torch.arange(t) if requests is None else requests
        out_loc = rows[owner, seq - 1].contiguous()
        outs, written = [], []
        for dtype in (torch.bfloat16, torch.float32):
            k, v = (c.to(dtype) for c in caches)
            args = (k, v, out_loc, rows if requests is not None else rows[:t], seq, heads, kv_heads, 0.125, requests)
            outs.append(ops.decode_attention(qkv, cos, sin, None, None, 1e-6, *args))
            written.append((k.float(), v.float()))
        assert torch.equal(outs[0], outs[1]), (march, "bf16 KV attention", name)
        assert all(torch.equal(a, b) for a, b in zip(*written)), (march, "bf16 KV write", name)


def check_decode_attention(ops, march: str) -> None:
    """decode_attention against softmax(q K^T scale) V in float64, at lengths whose parts end in a block of
    fewer slots than the build's lanes (the scores' padded last block) and at one slot; query heads per kv head
    in the scores' fours (twos on AVX2) and a remainder, head sizes the build's vectors divide and not, and a
    part longer than the rows the op reads ahead (kTouchBytes)."""
    import torch

    gen = torch.Generator().manual_seed(4)
    for heads, kv_heads, d, lengths in (
        (9, 3, 64, [200, 37, 5, 1]),
        (10, 2, 40, [37, 5]),
        (6, 3, 24, [37, 1]),
        (8, 8, 64, [3000]),
    ):
        seq, n = torch.tensor(lengths), max(lengths) + 100
        t = len(seq)
        k, v = (torch.randn(n + 1, kv_heads, d, generator=gen) for _ in range(2))
        rows = torch.stack([torch.randperm(n, generator=gen)[: max(lengths)] + 1 for _ in range(t)])
        qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen)
        out_loc = rows[torch.arange(t), seq - 1].contiguous()
        args = (k, v, out_loc, rows, seq, heads, kv_heads, 0.125, None)
        got = ops.decode_attention(qkv, torch.ones(t, d), torch.zeros(t, d), None, None, 1e-6, *args)
        for b in range(t):  # the op wrote the token's own K and V (identity rotary) before reading them
            keys, values = (c[rows[b, : seq[b]]].double().repeat_interleave(heads // kv_heads, 1) for c in (k, v))
            q = qkv[b, : heads * d].double().view(heads, d)
            probs = torch.softmax(torch.einsum("hd,shd->hs", q, keys) * 0.125, dim=-1)
            want = torch.einsum("hs,shd->hd", probs, values).flatten()
            msg = f"{march} attention {heads}/{kv_heads} heads of {d}, {seq[b]} slots"
            torch.testing.assert_close(got[b].double(), want, rtol=1e-5, atol=1e-5, msg=msg)


def check_decode_logits(ops, march: str) -> None:
    """decode_logits' one-region head at one and two rows: each thread's best of its share of the logits (the
    scan this build compiled), the threads' bests combined: torch.argmax of its logits, ties across shares. By
    the greedy head's candidates (set_greedy) the same tokens, from the bf16 head's logits or, where the bound
    settles nothing, the float32 head's."""
    import torch

    from tests.test_cpu_fused_layer import _head, _stack

    gen = torch.Generator().manual_seed(1)
    entries = _stack(ops, "fp32", gen)[0]
    (w, _), norm = _head(ops, "fp32", gen, 1000)
    low = w.to(torch.bfloat16)  # the greedy head's candidates (cpu_candidates.cpp): settled, and not (err huge)
    err, size = float((w.double() - low.double()).norm(dim=1).max()), float(low.double().norm(dim=1).max())
    helds = [ops.decode_weights(entries) for _ in range(3)]
    for i, held in enumerate(helds):
        held.set_head(norm, w, None, 1000)
        assert i == 0 or held.set_greedy(low, 8, err if i == 1 else 1e6, size)
    for rows in (1, 2):
        caches = [torch.randn(8, 2, 16, generator=gen) for _ in range(6)]
        slots = torch.arange(1, 1 + 3 * rows).view(rows, 3)
        x, cos, sin = (torch.randn(rows, n, generator=gen) for n in (64, 16, 16))
        args = (1e-6, cos, sin, slots[:, -1].contiguous(), slots, torch.full((rows,), 3), 4, 2, 0.25, 32, True)
        (_, logits, tokens), (_, approx, settled), (_, whole, unsettled) = (
            ops.decode_logits(x, held, caches[:3], caches[3:], *args) for held in helds
        )
        assert torch.equal(tokens, logits.argmax(dim=-1)) and (tokens < 500).all(), (march, "decode_logits", rows)
        assert torch.equal(settled, tokens) and not torch.equal(approx, logits), (march, "candidates", rows)
        assert torch.equal(unsettled, tokens) and torch.equal(whole, logits), (march, "candidates' fallback", rows)


def check(march: str, folder: str) -> None:
    """Build the kernels with -march=`march` into `folder`, load them, and check them (raises if wrong);
    the int8 matmul's outputs are left in folder/int8.pt for the caller to compare with its own build's."""
    import torch
    from torch.utils import cpp_extension

    from common.models import cpu_fused, low_precision

    flags = [f"-march={march}" if f == "-march=native" else f for f in cpu_fused.CFLAGS]
    cpp_extension.load(cpu_fused.NAME, cpu_fused.SOURCES, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                       build_directory=folder, is_python_module=False)  # fmt: skip
    ops = cpu_fused.FusedOps()
    torch.manual_seed(0)
    for rows, n, k in (
        (1, 40, 18),
        (1, 300, 64),
        (2, 300, 64),
        (5, 33, 2),
        (13, 100, 64),
        (64, 96, 576),
        (100, 70, 30),
    ):
        w = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
        x, b, r = torch.randn(rows, k), torch.randn(n), torch.randn(rows, n)
        got = ops.gemm_bf16(x, ops.pack_bf16_pairs(w), n, b, r)
        xr, wf, acc = x.to(torch.bfloat16).float(), w.float(), torch.zeros(rows, n)
        for i in range(k // 2):
            acc = acc + xr[:, 2 * i + 1 : 2 * i + 2] * wf[:, 2 * i + 1]
            acc = acc + xr[:, 2 * i : 2 * i + 1] * wf[:, 2 * i]
        assert torch.equal(got, acc + b + r), (march, "gemm_bf16", rows, n, k)
        q, scale = low_precision.quantize_rows(w.float())
        cases = {
            "fp32": (w.float(), None, w.double()),
            "bf16": (w, None, w.double()),
            "int8": (q, scale, q.double() * scale.double()[:, None]),
        }
        for name, (weight, s, exact) in cases.items():
            ref = r.double() + x.double() @ exact.T + b.double()
            panels = ops.gemm_panels(x, ops.pack_panels(weight), n, b, r, s)
            torch.testing.assert_close(panels.double(), ref, rtol=1e-5, atol=1e-4, msg=f"{march} panels {name}")
            if rows <= 64:
                gemv = ops.gemv(x, weight, b, r) if s is None else ops.gemv_w8(x, weight, s, b, r)
                torch.testing.assert_close(gemv.double(), ref, rtol=1e-5, atol=1e-4, msg=f"{march} gemv {name}")
    check_bf16_kv_attention(ops, march)
    for rows, n in ((1, 49152), (3, 40), (2, 7)):  # argmax_rows: torch.argmax's index, ties and NaNs included
        x = torch.randn(rows, n)
        x[:, n // 3] = x[:, -1] = 9.0
        nans = x.clone()
        nans[:, n // 2] = nans[:, -2] = float("nan")
        for case in (x, nans, torch.full((rows, n), float("-inf"))):
            assert torch.equal(ops.argmax_rows(case), torch.argmax(case, dim=-1)), (march, "argmax_rows", rows, n)
    check_decode_attention(ops, march)
    check_decode_logits(ops, march)
    from tests.test_cpu_fused_layer import check_step_bits

    torch.set_num_threads(2)  # the one-region step above two rows: the team's inputs, the int8 matmul's tiles
    for fmt, rows in (("w8a8", 7), ("w8", 7), ("panels", 13)):  # 13: the panel GEMM's row groups split (6 or 12 rows)
        check_step_bits(ops, fmt, rows, torch.bfloat16)
    outs = int8_outputs(ops)
    for (rows, n, k, block, w_block), got in zip(INT8_CASES, outs):
        x, q, scale, b, r = int8_inputs(rows, n, k, w_block)
        xq = low_precision.quantized_input(x, block).double()
        ref = r.double() + xq @ low_precision.dequantize(q, scale).double().T + b.double()
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4, msg=f"{march} gemm_int8 {rows}x{k}")
    torch.save(outs, os.path.join(folder, "int8.pt"))


@pytest.mark.parametrize("march", ["x86-64", "haswell", "skylake-avx512"])
def test_the_kernels_built_for_a_lesser_isa_compute_what_the_native_build_does(march, tmp_path, ops):
    if platform.machine() != "x86_64":
        pytest.skip("the kernels' SIMD forms are x86's")
    if march not in lesser_isas():
        pytest.skip(f"this host cannot run -march={march} code")
    code = f"from tests.test_kernel_isas import check; check({march!r}, {str(tmp_path)!r}); print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-4000:]
    import torch

    theirs = torch.load(tmp_path / "int8.pt")
    for case, mine, other in zip(INT8_CASES, int8_outputs(ops), theirs):
        assert torch.equal(mine, other), (march, "gemm_int8 differs from the native build", case)
