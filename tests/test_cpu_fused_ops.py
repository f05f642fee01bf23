"""The fused CPU ops (common/kernels/cpu_fused.cpp) against the torch composites they replace, within
fp32 rounding; greedy tokens through them token-exact with HF; a failed build leaves the torch path."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from common.attention.batched import BatchedBackend
from common.engine.colocated import ColocatedLoop
from common.engine.kv_pool import KVPool
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.req_to_token_pool import ReqToTokenPool
from common.engine.sampling import SamplingParams
from common.forward.forward_batch import ForwardBatch
from common.models import cpu_fused
from common.models.decoder import RMSNorm
from common.models.rope import RotaryEmbedding, apply_rotary
from tests.oracle import hf_greedy

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (300, 128), (2, 3, 32)])
def test_rms_norm_matches_torch(ops, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x, w = torch.randn(shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    ref = F.rms_norm(x, w.shape, w, 1e-6)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref, **TOL)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # HF's composite
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), h, **TOL)


@pytest.mark.parametrize("shape", [(1, 3072), (5, 74), (129, 256)])
def test_silu_and_mul_matches_torch(ops, shape):
    gate_up = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up, **TOL)


def test_silu_and_mul_over_the_float_range(ops):
    """The op's own exp (vectorizable) holds ~1 ulp from -120 to 120, where exp saturates."""
    g = torch.linspace(-120, 120, 24001)
    gate_up = torch.cat([g, torch.ones_like(g)]).view(1, -1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(g).view(1, -1), rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("rows,n", [(1, 49152), (2, 49152), (3, 40000), (64, 4099), (5, 17), (1, 1), (4, 33000)])
def test_argmax_rows_is_torch_argmax(ops, rows, n, monkeypatch):
    """The greedy token of logits rows: torch.argmax's index, bit for bit, where each row's largest value is
    held by several columns (the first wins, across lanes and threads' parts), at the ends, at -inf or +inf
    throughout, and where a row has NaNs (the first NaN wins, as in torch); cpu_fused.argmax takes the op for
    CPU float32 rows and leaves others to torch."""
    g = torch.Generator().manual_seed(rows * 7 + n)
    x = torch.randn(rows, n, generator=g)
    cases = [x.clone()]
    tied = x.clone()
    for r in range(rows):  # the largest value at three columns, the last in the other half of the row
        cols = torch.randint(0, n, (3,), generator=g).tolist() + [n - 1 - r % n]
        tied[r, cols] = 9.0
    cases.append(tied)
    ends = x.clone()
    ends[:, -1] = 9.0  # the last column (a tail past the last full vector)
    ends[0, 0] = 9.0  # and the first
    cases.append(ends)
    cases += [torch.full((rows, n), float("-inf")), torch.full((rows, n), float("inf"))]
    nans = tied.clone()
    for r in range(rows):  # a NaN late in the row, another after it; row 0 only a NaN at its last column
        c = n - 1 if r == 0 else min(n - 1, n // 2 + r)
        nans[r, c] = float("nan")
        nans[r, min(n - 1, c + 3)] = float("nan")
    cases.append(nans)
    for case in cases:
        want = torch.argmax(case, dim=-1)
        assert torch.equal(ops.argmax_rows(case), want)
        assert torch.equal(cpu_fused.argmax(case), want)
    with pytest.raises(RuntimeError, match="N > 0"):
        ops.argmax_rows(torch.zeros(rows, 0))
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(x.double())
    calls = []
    monkeypatch.setattr(ops, "argmax_rows", lambda t: calls.append(t) or torch.argmax(t, dim=-1))
    cpu_fused.argmax(x)
    assert len(calls) == 1  # the op, for CPU float32 rows
    assert torch.equal(cpu_fused.argmax(x.double()), torch.argmax(x, dim=-1))  # torch's, for what the op refuses
    strided = torch.stack([x, x], -1)[..., 0]  # x, every other float of a buffer
    assert torch.equal(cpu_fused.argmax(strided), torch.argmax(x, dim=-1))
    assert len(calls) == 1 + strided.is_contiguous()  # a [1, 1] view is contiguous whatever its strides


@pytest.mark.parametrize(
    "rows,n,k,bias,residual",
    [
        (1, 960, 576, False, False),
        (2, 577, 64, True, False),
        (4, 13, 1536, True, True),
        (3, 1024, 100, False, True),
        (1, 33, 7, True, True),
        (2, 40, 136, False, True),
        (1, 5, 16384, True, True),  # two threads with fewer rows each than the gemv's streams
        (2, 3, 16384, False, True),
    ],
)
def test_gemv_matches_the_rowblock_bmm(ops, rows, n, k, bias, residual):
    """The rowblock layout's few-row path: the same as its bmm (and F.linear) within fp32 rounding,
    bias and residual added in the op; above GEMV_ROWS rows the bmm serves."""
    from common.models.packed_linear import GEMV_ROWS, LinearWeight

    g = torch.Generator().manual_seed(rows * n)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    res = torch.randn(rows, n, generator=g) if residual else None
    lw = LinearWeight(w, b)
    plain = lw.run("rowblock", x, res)
    lw.gemv = ops.gemv
    fused = lw.run("rowblock", x, res)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fused, F.linear(x, w, b) + (0 if res is None else res), rtol=1e-5, atol=1e-4)
    calls = []
    lw.gemv = lambda *a: calls.append(a) or ops.gemv(*a)
    lw.run("rowblock", torch.randn(GEMV_ROWS + 1, k, generator=g))
    lw.run("rowblock", x)
    assert len(calls) == 1  # rows above GEMV_ROWS went to the bmm


@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 37, 1000, 300_001])
def test_stream_sum_is_the_sum(ops, n, streams):
    """bench.floor's bandwidth probe reads every element once, whatever the split's remainders."""
    x = torch.rand(n, generator=torch.Generator().manual_seed(n), dtype=torch.float32)
    assert abs(float(ops.stream_sum(x, streams)) - float(x.double().sum())) <= 1e-4 * n


@pytest.mark.parametrize("rows,n,k", [(6, 300, 200), (16, 961, 576), (23, 301, 100), (64, 129, 1536), (9, 1, 13)])
def test_gemv_runs_any_row_count_in_register_tiles(ops, rows, n, k):
    """More rows than one pass holds (tiles of 4 rows by 2 weight rows, then the rows and weight rows left
    over: odd n, k not a multiple of the vector width) and a non-contiguous residual: still
    x @ w.T + bias + residual."""
    g = torch.Generator().manual_seed(rows * n)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    res = torch.randn(n, rows, generator=g).t()
    torch.testing.assert_close(ops.gemv(x, w, b, res), F.linear(x, w, b) + res, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops.gemv(x, w, None, None), F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows,n,k", [(1, 40, 48), (7, 300, 200), (50, 3072, 576), (200, 100, 37), (13, 9, 1536)])
def test_panel_gemm_is_x_at_w_t(ops, rows, n, k):
    """The panel GEMM over full tiles, the rows left over (any count below a tile), the row chunks
    (200 rows: more than one), a last panel of fewer columns than its width, an odd K and a
    non-contiguous residual: x @ w.T + bias + residual; the packed panels are w's values, zero-padded."""
    g = torch.Generator().manual_seed(rows * n + k)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    res = torch.randn(n, rows, generator=g).t()
    panels = ops.pack_panels(w)
    width = panels.shape[2]
    assert panels.shape[:2] == ((n + width - 1) // width, k)
    assert torch.equal(panels.transpose(1, 2).reshape(-1, k)[:n], w)
    assert not panels.transpose(1, 2).reshape(-1, k)[n:].any()
    torch.testing.assert_close(ops.gemm_panels(x, panels, n, b, res), F.linear(x, w, b) + res, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops.gemm_panels(x, panels, n, None, None), F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="N does not match"):
        ops.gemm_panels(x, panels, n + width, None, None)


def _attention_case(lengths, heads, kv_heads, d, seed, new=None, kv_dtype=torch.float32):
    """A batch over scattered KV slots, each request's prefix KV already in the pool (of `kv_dtype`): a decode
    (one new token per request), or an extend of new[b] tokens per request. lengths[b]: the KV length after
    this step."""
    g = torch.Generator().manual_seed(seed)
    num_slots, layers = max(400, sum(lengths) + 8), 2
    pool = KVPool(num_slots, layers, kv_heads, d, kv_dtype)
    pool.k_all.copy_(torch.randn(pool.k_all.shape, generator=g))
    pool.v_all.copy_(torch.randn(pool.v_all.shape, generator=g))
    r2t = ReqToTokenPool(8, max(64, *lengths))
    free = (torch.randperm(num_slots, generator=g) + 1).tolist()  # slot 0 is padding
    rows = []
    for n in lengths:
        rows.append(r2t.alloc())
        r2t.write(rows[-1], 0, torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32))
    if new is None:
        fb = ForwardBatch.decode(r2t.req_to_token, torch.tensor(rows), [n - 1 for n in lengths], torch.zeros(len(rows)))
    else:
        tokens = [list(range(5, 5 + q)) for q in new]
        fb = ForwardBatch.extend(r2t.req_to_token, rows, [n - q for n, q in zip(lengths, new)], tokens)
    qkv = torch.randn(len(lengths) if new is None else sum(new), (heads + 2 * kv_heads) * d, generator=g)
    return pool, r2t, fb, qkv


def _fused_against_the_torch_path(ops, pool, r2t, fb, qkv, heads, kv_heads, d, qk_norm, fused_now: str):
    """The batch's attention through the fused call and through the torch path (Attention.forward's q/k norm
    and rotary, then the backend's write, gather and SDPA): outputs and the written K/V agree. A bf16 pool:
    both paths round the new K and V to it and widen every K and V they read; a rotated K may round the
    other way where the two paths' float32 rotations differ in the last bit, so the torch path is handed
    the fused call's K."""
    layer, t = 1, qkv.shape[0]
    cos, sin = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, d).cos_sin(fb.positions, torch.float32)
    attn = SimpleNamespace(layer=layer, head_dim=d, num_heads=heads, num_kv_heads=kv_heads, scale=d**-0.5)
    if qk_norm:
        attn.q_norm, attn.k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight = torch.nn.Parameter(torch.rand(d) + 0.5, requires_grad=False)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    q, k, v = q.reshape(t, heads, d), k.reshape(t, kv_heads, d), v.reshape(t, kv_heads, d)
    if qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    ref_pool = KVPool(pool.num_slots, 2, kv_heads, d, pool.dtype)
    ref_pool.k_all.copy_(pool.k_all), ref_pool.v_all.copy_(pool.v_all)
    fused = BatchedBackend(pool, r2t)
    fused.fused, fused.query_dtype = ops, torch.float32
    fused.init_forward_metadata(fb)
    assert getattr(fused, fused_now)
    out = fused.fused_decode(qkv, cos, sin, attn, fb)

    k_rot = apply_rotary(k, cos, sin)
    written = pool.k[layer][fb.out_cache_loc]  # the new K, rotated, as the fused call stored it
    if pool.dtype == torch.float32:
        torch.testing.assert_close(written, k_rot, **TOL)
    else:  # rounded to nearest: within one bf16 step of torch's rounding of its own rotation
        torch.testing.assert_close(written.float(), k_rot.to(pool.dtype).float(), rtol=2**-7, atol=0)
        k_rot = written.float()  # then both paths attend over the same keys
    ref = BatchedBackend(ref_pool, r2t)
    ref.query_dtype = torch.float32  # as ModelRunner sets it: the mask in the queries' dtype
    ref.init_forward_metadata(fb)
    assert not ref.fused_decode_now and not ref.fused_extend_now
    expected = ref.forward(apply_rotary(q, cos, sin), k_rot, v, layer, fb, attn.scale)
    torch.testing.assert_close(out, expected.reshape(t, heads * d), **TOL)
    torch.testing.assert_close(pool.k_all, ref_pool.k_all, **TOL)  # the new K and V written alike, nothing else
    torch.testing.assert_close(pool.v_all, ref_pool.v_all, rtol=0, atol=0)
    # a layer of the same step that takes the torch path (e.g. a partial rotary) gets its metadata then
    assert fused._pending is not None
    again = fused.forward(apply_rotary(q, cos, sin), k_rot, v, layer, fb, attn.scale)
    assert fused._pending is None
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


@pytest.mark.parametrize("lengths", [[20], [1], [7, 33, 1, 18], [700, 45]], ids=["b1", "b1-first", "ragged4", "long"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)], ids=["group1", "group3"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32-kv", "bf16-kv"])
def test_decode_attention_matches_the_torch_path(ops, lengths, heads, kv_heads, d, qk_norm, kv_dtype):
    """Each token's slots in parts (one part up to 32 slots, 16 from 481), merged: 45 slots are two parts,
    700 sixteen. K and V in float32 or in bf16 (--kv-cache-dtype)."""
    case = _attention_case(lengths, heads, kv_heads, d, seed=len(lengths) * d + heads, kv_dtype=kv_dtype)
    _fused_against_the_torch_path(ops, *case, heads, kv_heads, d, qk_norm, "fused_decode_now")


@pytest.mark.parametrize(
    "heads,kv_heads,d", [(8, 1, 64), (10, 2, 40), (6, 3, 24), (8, 8, 64)], ids=["group8", "group5-d40", "d24", "rows2k"]
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32-kv", "bf16-kv"])
def test_decode_attention_takes_any_group_and_head_size(ops, heads, kv_heads, d, kv_dtype):
    """The scores take a kv head's query heads four at a time (two on AVX2), the rest after: 8 is two fours, 5 a
    four and a one; a head size the build's vectors do not divide (40, 24 on AVX-512) goes one dot at a time. A
    3,000-slot token's parts of 187 slots are longer than the rows read ahead of the passes (kTouchBytes) where
    a slot holds 2 KB of K and 2 KB of V (8 kv heads of 64)."""
    for lengths in ([7, 33, 1, 18], [3000]):
        case = _attention_case(lengths, heads, kv_heads, d, seed=heads * d + len(lengths), kv_dtype=kv_dtype)
        _fused_against_the_torch_path(ops, *case, heads, kv_heads, d, False, "fused_decode_now")


def test_a_tokens_attention_has_the_same_bits_in_any_batch_and_team(ops, threads):
    """A token's slots are cut into parts by its own length alone: its output is the same bits alone or
    beside other requests, on one thread or three (the merge's order of parts never depends on either)."""
    heads, kv_heads, d = 9, 3, 64
    pool, r2t, fb, qkv = _attention_case([700, 45, 5], heads, kv_heads, d, seed=7)
    cos, sin = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, d).cos_sin(fb.positions, torch.float32)
    attn = SimpleNamespace(layer=1, num_heads=heads, num_kv_heads=kv_heads, scale=d**-0.5)
    alone = ForwardBatch.decode(r2t.req_to_token, fb.req_pool_indices[:1], fb.prefix_lens_cpu[:1], torch.zeros(1))
    outs = []
    for team, batch in ((1, fb), (3, fb), (1, alone), (3, alone)):
        threads(team)
        backend = BatchedBackend(pool, r2t)
        backend.fused = ops
        backend.init_forward_metadata(batch)
        rows = len(batch.seq_lens_cpu)
        outs.append(backend.fused_decode(qkv[:rows], cos[:rows], sin[:rows], attn, batch)[0])
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize(
    "lengths,new",
    [([12], [12]), ([30], [5]), ([9, 40, 3, 17], [9, 2, 3, 11])],
    ids=["prompt", "after-a-prefix", "ragged4"],
)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)], ids=["group1", "group3"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32-kv", "bf16-kv"])
def test_short_extend_attention_matches_the_torch_path(ops, lengths, new, heads, kv_heads, qk_norm, kv_dtype):
    """An extend's new tokens (a prompt, tokens after a cached prefix, a ragged batch of both) through the
    fused call: each token sees its request's slots up to its own (the causal mask), as SDPA with the mask."""
    case = _attention_case(lengths, heads, kv_heads, 64, seed=sum(new) + heads, new=new, kv_dtype=kv_dtype)
    _fused_against_the_torch_path(ops, *case, heads, kv_heads, 64, qk_norm, "fused_extend_now")


def test_long_extends_and_trees_keep_the_torch_attention(ops, checkpoint):
    """Batches of one query per request without a tree, and extends whose requests' new tokens see at
    most `fused_extend_slots` keys each, go through the fused attention; longer extends and trees do not."""
    runner = ModelRunner(RunnerArgs(checkpoint("llama"), max_total_tokens=128, max_running_requests=2))
    backend = runner.backend
    assert runner.cpu_fused is ops and backend.fused is ops
    table, row = runner.req_to_token_pool.req_to_token, runner.req_to_token_pool.alloc()
    runner.req_to_token_pool.write(row, 0, runner.kv_allocator.alloc(8))
    backend.init_forward_metadata(ForwardBatch.extend(table, [row], [0], [[5, 6, 7]]))
    assert backend.fused_extend_now and not backend.fused_decode_now
    assert backend._token_seq.tolist() == [1, 2, 3] and backend._token_req.tolist() == [0, 0, 0]
    backend.fused_extend_slots = 5  # the 3 tokens see 1 + 2 + 3 keys
    backend.init_forward_metadata(ForwardBatch.extend(table, [row], [0], [[5, 6, 7]]))
    assert not backend.fused_extend_now and not backend.fused_decode_now
    other = runner.req_to_token_pool.alloc()  # two requests of 6 keys each: the bound is per request
    runner.req_to_token_pool.write(other, 0, runner.kv_allocator.alloc(8))
    backend.fused_extend_slots = 6
    backend.init_forward_metadata(ForwardBatch.extend(table, [row, other], [0, 0], [[5, 6, 7], [8, 9, 10]]))
    assert backend.fused_extend_now and backend._token_req.tolist() == [0, 0, 0, 1, 1, 1]
    one_node = torch.ones(1, 1, 1, dtype=torch.bool)  # a tree of one node: one query, but a tree mask
    tree = ForwardBatch.tree(
        table, torch.tensor([row]), [row], [3], torch.tensor([9]), torch.zeros(1, 1), [0], one_node
    )
    backend.init_forward_metadata(tree)
    assert not backend.fused_decode_now and not backend.fused_extend_now
    backend.init_forward_metadata(ForwardBatch.decode(table, torch.tensor([row]), [3], torch.tensor([9])))
    assert backend.fused_decode_now and not backend.fused_extend_now


PROMPTS = [[5, 17, 99, 3], [7] * 11, [200, 13]]
NEW = 12


def _greedy(runner) -> list[list[int]]:
    reqs = ColocatedLoop(runner, chunk_size=16).generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    return [r.output for r in reqs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_through_the_fused_ops_matches_hf(ops, checkpoint, arch):
    path = checkpoint(arch)
    runner = ModelRunner(RunnerArgs(path, max_total_tokens=256, max_running_requests=4))
    assert runner.backend.fused is ops and runner.model.model.norm.fused is ops
    assert _greedy(runner) == [hf_greedy(path, p, NEW) for p in PROMPTS]


class BrokenBuild:
    """A stand-in for a build that fails (no compiler, a compile error)."""

    calls = 0

    def __call__(self):
        BrokenBuild.calls += 1
        raise RuntimeError("stand-in: the compiler failed")


def test_a_failed_build_leaves_the_torch_path(checkpoint, caplog):
    path, broken = checkpoint("llama"), BrokenBuild()
    with caplog.at_level(logging.WARNING, logger=cpu_fused.__name__):
        runner = ModelRunner(RunnerArgs(path, max_total_tokens=256, max_running_requests=4), fused_build=broken)
        ModelRunner(RunnerArgs(path, max_total_tokens=256, max_running_requests=4), fused_build=broken)
    lines = [r.getMessage() for r in caplog.records if r.name == cpu_fused.__name__]
    assert lines == ["CPU fused ops unavailable (RuntimeError: stand-in: the compiler failed); using the torch path"]
    assert BrokenBuild.calls == 1  # tried once per process, not once per runner
    assert runner.cpu_fused is None and runner.backend.fused is None and runner.model.model.norm.fused is None
    assert _greedy(runner) == [hf_greedy(path, p, NEW) for p in PROMPTS]


def test_the_flag_turns_it_off(checkpoint):
    runner = ModelRunner(RunnerArgs(checkpoint("llama"), max_total_tokens=64, max_running_requests=1, cpu_fused=False))
    assert runner.cpu_fused is None and runner.backend.fused is None


def test_the_wheel_carries_every_kernel_source():
    """The build reads every file of common/kernels at run time (cpu_fused.SOURCES + HEADERS), so the
    package data must ship them all: a header the globs missed broke the image's build once."""
    import fnmatch
    import os

    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["common"]
    needed = [os.path.relpath(p, os.path.join(root, "common")) for p in cpu_fused.SOURCES + cpu_fused.HEADERS]
    assert sorted(os.listdir(cpu_fused.KERNELS)) == sorted(os.path.basename(p) for p in needed)
    assert all(any(fnmatch.fnmatch(p, g) for g in globs) for p in needed), (needed, globs)


def test_one_rows_gemv_gives_the_same_bits_with_any_stream_count(ops):
    """The streams per thread at one row only change which weight rows are read side by side: each
    row's dot product, so the output's bits, stay (odd and even row counts, with a tail past the streams)."""
    g = torch.Generator().manual_seed(5)
    before = ops.row_streams()
    try:
        for n, k in ((1001, 96), (64, 577), (7, 32)):
            x, w, b = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            outs = []
            for streams in cpu_fused.ROW_STREAMS:
                assert ops.row_streams(streams) == streams
                outs.append(ops.gemv(x, w, b, None))
            assert all(torch.equal(outs[0], o) for o in outs[1:]), (n, k)
            torch.testing.assert_close(outs[0], F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        with pytest.raises(RuntimeError, match="1, 2 or 4"):
            ops.row_streams(3)
    finally:
        ops.row_streams(before)


def test_one_rows_int8_matmul_gives_the_same_bits_with_either_stream_count_and_picks_the_faster(
    ops, checkpoint, caplog
):
    """w8a8's int8 matmul at one row with its panels one at a time or two side by side: the same bits (odd and
    even panel counts, a partial last panel); pick_int8_streams keeps the faster count (timings handed in)
    and a w8a8 runner with the fused ops picks one at start and says which."""
    from common.models import low_precision

    before = ops.int8_streams()
    try:
        for n, k in ((100, 576), (96, 64), (300, 64), (32, 32)):
            q, scale = low_precision.quantize_blocks(torch.randn(n, k))
            quads, scales = ops.pack_int8_quads(q), ops.pack_int8_scales(scale)
            x, b = torch.randn(1, k), torch.randn(n)
            outs = []
            for streams in cpu_fused.INT8_STREAMS:
                assert ops.int8_streams(streams) == streams
                outs.append(ops.gemm_int8(x, quads, scales, n, low_precision.X_BLOCK, b, None))
            assert torch.equal(outs[0], outs[1]), (n, k)
        with pytest.raises(RuntimeError, match="1 or 2"):
            ops.int8_streams(4)
        seconds = {1: [3.0, 1.0, 2.5], 2: [1.5, 2.0, 1.2]}  # 1's best is the best
        calls = {s: iter(t) for s, t in seconds.items()}
        assert cpu_fused.pick_int8_streams(ops, [], time_pass=lambda s: next(calls[s])) == 1
        assert ops.int8_streams() == 1
        with caplog.at_level(logging.INFO, logger=cpu_fused.__name__):
            ModelRunner(
                RunnerArgs(checkpoint("llama"), max_total_tokens=64, max_running_requests=2, quantization="w8a8")
            )
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("int8 matmul at one row")]
        assert len(lines) == 1 and ops.int8_streams() in cpu_fused.INT8_STREAMS
    finally:
        ops.int8_streams(before)


def test_the_fastest_stream_count_is_picked_and_set(ops, checkpoint, caplog):
    """pick_row_streams keeps the count whose best pass is fastest (timings handed in), sets it, and a
    runner with the fused ops picks one at start and says which."""
    before = ops.row_streams()
    try:
        seconds = {1: [3.0, 2.0, 2.5], 2: [1.5, 9.0, 9.0], 4: [1.8, 1.7, 1.6]}  # 2's best is the best
        calls = {s: iter(t) for s, t in seconds.items()}
        assert cpu_fused.pick_row_streams(ops, [], time_pass=lambda s: next(calls[s])) == 2
        assert ops.row_streams() == 2
        with caplog.at_level(logging.INFO, logger=cpu_fused.__name__):
            ModelRunner(RunnerArgs(checkpoint("llama"), max_total_tokens=64, max_running_requests=2))
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gemv at one row")]
        assert len(lines) == 1 and ops.row_streams() in cpu_fused.ROW_STREAMS
    finally:
        ops.row_streams(before)


@pytest.mark.parametrize("quantization", ["none", "w8a8"])
def test_start_up_picks_are_timed_holding_the_host_wide_lock(ops, checkpoint, monkeypatch, quantization):
    """The stream picks (and w8a8's) time while no other service of the host times: each runs under the layout
    table's lock, so a second holder (another service; here a second descriptor) is refused meanwhile."""
    import fcntl
    import os

    from common.models import host_table

    held = []

    def try_lock(*args, **kwargs) -> int:
        fd = os.open(host_table.lock_path(), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)
        return 1

    monkeypatch.setattr(cpu_fused, "pick_row_streams", try_lock)
    monkeypatch.setattr(cpu_fused, "pick_int8_streams", try_lock)
    ModelRunner(RunnerArgs(checkpoint("llama"), max_total_tokens=64, max_running_requests=2, quantization=quantization))
    assert held == [True] * (2 if quantization == "w8a8" else 1)
