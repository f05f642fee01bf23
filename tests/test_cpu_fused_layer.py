"""A dense decoder stack's decode step as one fused call (cpu_step.FusedLayers, `decode_layers`, and
`decode_logits` with the final norm, the lm_head and the argmax) against the modules' own path and the ops
called in turn."""

from __future__ import annotations

import pytest
import torch

from common.engine.model_runner import ModelRunner, RunnerArgs
from common.forward.forward_batch import ForwardBatch
from common.models import cpu_fused, cpu_step, low_precision
from common.models.packed_linear import LAYOUTS, ROW_BUCKETS, linear_weights
from tests.oracle import hf_greedy
from tests.test_cpu_fused_ops import NEW, PROMPTS, _greedy


class Counting:
    """The ops with the whole stack's calls counted (calls: decode_layers', decode_logits' and greedy_step's;
    heads: the last two's)."""

    def __init__(self, ops):
        self.ops, self.calls, self.heads = ops, 0, 0

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def greedy_step(self, *args):
        self.calls += 1
        self.heads += 1
        return self.ops.greedy_step(*args)

    def decode_layers(self, *args):
        self.calls += 1
        return self.ops.decode_layers(*args)

    def decode_logits(self, *args):
        self.calls += 1
        self.heads += 1
        return self.ops.decode_logits(*args)


def _count(runner) -> Counting:
    counting = Counting(runner.cpu_fused)
    runner.model.fused_layers.ops = counting
    return counting


def _prefilled(runner, prompts: list[list[int]]) -> list[int]:
    """Each prompt's KV written to a request row with a slot for one more token; the rows."""
    pool, table = runner.req_to_token_pool, runner.req_to_token_pool.req_to_token
    rows = []
    for prompt in prompts:
        rows.append(pool.alloc())
        pool.write(rows[-1], 0, runner.kv_allocator.alloc(len(prompt) + 1))
        with torch.inference_mode():
            runner.model(ForwardBatch.extend(table, [rows[-1]], [0], [prompt]), runner.backend)
    return rows


def _decode_hidden(runner, rows: list[int], prefixes: list[int], token: int) -> torch.Tensor:
    table = runner.req_to_token_pool.req_to_token
    fb = ForwardBatch.decode(table, torch.tensor(rows), prefixes, torch.tensor([token] * len(rows)))
    with torch.inference_mode():
        return runner.model(fb, runner.backend)


@pytest.mark.parametrize(
    "arch,batch,layouts",
    [(arch, batch, "rowblock") for arch in ("llama", "qwen2", "qwen3") for batch in (1, 3, 6)]
    + [(arch, 6, "panels") for arch in ("llama", "qwen3")]
    + [("qwen2", 3, "mixed")],
)
def test_the_fused_layers_compute_what_the_modules_do(ops, checkpoint, arch, batch, layouts):
    """One decode step of `batch` requests (prefixes of different lengths) through `decode_layers`, then
    the same step (same slots: the same K/V written again) through the modules with F.linear: the
    final hidden states agree within fp32 rounding. Its linears as the gemv, as the panel GEMM, or
    mixed (qkv and gate_up as panels, o and down as the gemv)."""
    forced = "panels" if layouts == "panels" else "rowblock"
    runner = ModelRunner(RunnerArgs(checkpoint(arch), max_total_tokens=96, max_running_requests=batch,
                                    linear_layout=forced))  # fmt: skip
    assert isinstance(runner.model.fused_layers, cpu_step.FusedLayers)
    if layouts == "mixed":
        for layer in runner.model.model.layers:
            for lw in (layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight):
                lw.set_panels(ops)
                lw.set_plan(("panels",) * len(ROW_BUCKETS))
    counting = _count(runner)
    prompts = [[5, 17, 99, 3, 8, 1, 42], [7, 7, 2], [300, 12, 6, 9, 1], [4, 5, 6], [8, 9, 10, 11], [250, 2, 7]][:batch]
    rows = _prefilled(runner, prompts)
    prefixes = [len(p) for p in prompts]
    fused = _decode_hidden(runner, rows, prefixes, 11)
    assert counting.calls == 1
    for lw in linear_weights(runner.model):  # the modules with F.linear: no fused op on the reference's path
        lw.set_plan(("mkl",) * len(ROW_BUCKETS))
    plain = _decode_hidden(runner, rows, prefixes, 11)
    assert counting.calls == 1  # the layout is not the gemv's: the modules served
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)


def test_only_all_dense_stacks_fuse(ops, checkpoint):
    """MoE and latent-attention models, and EAGLE heads (no input norm), keep their modules."""
    for name in ("qwen3-moe", "deepseek-v3"):
        runner = ModelRunner(RunnerArgs(checkpoint(name), max_total_tokens=64, max_running_requests=1))
        assert runner.cpu_fused is ops and runner.model.fused_layers is None
    from common.models.decoder import DecoderLayer
    from common.models.eagle import Eagle3Layer

    runner = ModelRunner(RunnerArgs(checkpoint("llama"), max_total_tokens=64, max_running_requests=1))
    layer = runner.model.model.layers[0]
    assert cpu_step.fusable(layer)
    layer.input_layernorm = torch.nn.Identity()  # EAGLE's head layer
    assert not cpu_step.fusable(layer)
    assert issubclass(Eagle3Layer, DecoderLayer)  # a subclass with its own forward: never fused
    eagle3 = Eagle3Layer.__new__(Eagle3Layer)
    torch.nn.Module.__init__(eagle3)
    eagle3.self_attn, eagle3.mlp = layer.self_attn, layer.mlp
    assert not cpu_step.fusable(eagle3)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_through_the_fused_layer_matches_hf(ops, checkpoint, arch):
    path = checkpoint(arch)
    runner = ModelRunner(RunnerArgs(path, max_total_tokens=256, max_running_requests=4, linear_layout="rowblock"))
    counting = _count(runner)
    assert _greedy(runner) == [hf_greedy(path, p, NEW) for p in PROMPTS]
    assert counting.heads > 0  # batches of 1-3 decode rows went through it, the final norm and lm_head too


def test_layers_whose_linears_use_another_layout_keep_the_modules(ops, checkpoint):
    """The fused layer runs its linears as the gemv, so where the host's table picked another layout
    for the batch's rows (here every bucket: mkl) the modules serve, and tokens stay exact."""
    path = checkpoint("llama")
    runner = ModelRunner(RunnerArgs(path, max_total_tokens=256, max_running_requests=4, linear_layout="mkl"))
    counting = _count(runner)
    assert _greedy(runner) == [hf_greedy(path, p, NEW) for p in PROMPTS]
    assert counting.calls == 0


class _CountedGemv:
    """A weight's gemv with its calls counted (what tuning times must be what the forward runs)."""

    def __init__(self, gemv):
        self.gemv, self.calls = gemv, 0

    def __call__(self, *args):
        self.calls += 1
        return self.gemv(*args)


def test_the_table_times_the_path_the_forward_takes_and_keys_it(ops, checkpoint, tmp_path, monkeypatch):
    """With the fused ops attached, tuning's rowblock at up to GEMV_ROWS rows is the fused gemv (the call
    the forward makes there), bmm above; the host table keys which one it timed (and the gemv's build),
    so a table timed without the fused ops is not loaded by a runner that has them, nor the reverse.
    And the forward's whole-stack call serves a batch exactly where the plan says rowblock for every
    linear at its rows."""
    from common.models import host_table, linear_tuning
    from common.models.packed_linear import GEMV_ROWS, bucket_index

    path = checkpoint("llama")
    runner = ModelRunner(RunnerArgs(path, max_total_tokens=256, max_running_requests=4, linear_layout="rowblock"))
    weights = linear_weights(runner.model)
    counted = {id(w): _CountedGemv(w.gemv) for w in weights}
    for w in weights:
        w.gemv = counted[id(w)]
    group = [w for w in weights if w.shape_key == weights[0].shape_key]
    for rows in (1, 2, 4, 8):
        before = sum(c.calls for c in counted.values())
        linear_tuning.measure(group, rows)
        assert (sum(c.calls for c in counted.values()) > before) == (rows <= GEMV_ROWS), rows
    kernel = linear_tuning.rowblock_kernel(weights)
    assert kernel == f"gemv {cpu_fused.build_key()}"
    monkeypatch.setenv(host_table.ENV_DIR, str(tmp_path))
    shapes, plans = [w.shape_key for w in weights], {w.shape_key: w.plan for w in weights}
    ms = {name: [1.0] * len(ROW_BUCKETS) for name in LAYOUTS}
    host_table.write(shapes, 2, plans, ms, [1.0] * len(ROW_BUCKETS), rowblock="bmm")
    assert host_table.read(shapes, 2, kernel) is None and host_table.read(shapes, 2, "bmm") is not None
    for w in weights:
        w.gemv = None
    assert linear_tuning.rowblock_kernel(weights) == "bmm"
    # the forward: decode_layers at a batch's rows iff that bucket is rowblock or panels for every linear
    for w in weights:
        w.gemv = counted[id(w)].gemv
    fused, x = runner.model.fused_layers, torch.zeros(1, runner.config.hidden_size)
    backend = type("Backend", (), {"fused_decode_now": True})()
    cos = torch.zeros(1, fused.head_dim)
    assert fused.serves(x, cos, backend)
    weights[3].set_panels(runner.cpu_fused)
    weights[3].set_plan(("panels",) + weights[3].plan[1:])
    assert fused.serves(x, cos, backend)
    weights[3].panels = None  # the copy its layout reads gone, the plan unchanged: seen too (layout_version)
    assert not fused.serves(x, cos, backend)
    weights[3].set_panels(runner.cpu_fused)
    assert fused.serves(x, cos, backend)
    weights[3].set_plan(("mkl",) + weights[3].plan[1:])
    assert not fused.serves(x, cos, backend) and bucket_index(2) != 0
    assert fused.serves(torch.zeros(2, runner.config.hidden_size), cos, backend)


def test_decode_weights_are_held_once_and_checked(ops):
    """decode_layers takes its weights as one DecodeWeights, built once per mix of layouts: a list that is
    not 16 entries per layer is refused when it is built, and caches that do not match its layers when called."""
    with pytest.raises(RuntimeError, match="16 weights per layer"):
        ops.decode_weights([None] * 15)
    with pytest.raises(RuntimeError, match="16 weights per layer"):
        ops.decode_weights([])
    held = ops.decode_weights([torch.ones(4)] * 32)  # two layers
    x, one = torch.ones(1, 4), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="a K and V cache per layer"):
        ops.decode_layers(
            x, held, [torch.zeros(2, 1, 4)], [torch.zeros(2, 1, 4)], 1e-6, x, x, one, one.view(1, 1), one + 1, 1, 1, 1.0
        )


def _in_format(ops, fmt: str, w: torch.Tensor) -> tuple:
    """A float32 weight [N, K] as `fmt` holds it for the ops: (weight, int8 scale or None)."""
    if fmt in ("w8", "w8a8", "w8-panels"):
        q, scale = (low_precision.quantize_blocks if fmt == "w8a8" else low_precision.quantize_rows)(w)
        if fmt == "w8-panels":
            return ops.pack_panels(q), scale
        return (q, scale) if fmt == "w8" else (ops.pack_int8_quads(q), ops.pack_int8_scales(scale))
    held = {
        "fp32": w,
        "bf16": w.bfloat16(),
        "bf16-matmul": ops.pack_bf16_pairs(w.bfloat16()),
        "panels": ops.pack_panels(w),
        "bf16-panels": ops.pack_panels(w.bfloat16()),
    }
    return held[fmt], None


def _linear(ops, fmt: str, x, w, scale, n: int, bias=None, residual=None):
    """x through a weight `_in_format` made, by the op of its format (w8a8 at low_precision.X_BLOCK)."""
    if fmt == "w8a8":
        return ops.gemm_int8(x, w, scale, n, low_precision.X_BLOCK, bias, residual)
    if fmt == "bf16-matmul":
        return ops.gemm_bf16(x, w, n, bias, residual)
    if fmt in ("panels", "bf16-panels", "w8-panels"):
        return ops.gemm_panels(x, w, n, bias, residual, scale)
    return ops.gemv(x, w, bias, residual) if scale is None else ops.gemv_w8(x, w, scale, bias, residual)


def _stack(ops, fmt: str, gen: torch.Generator, layers=3, hidden=64, heads=4, kv_heads=2, d=16, inter=96):
    """A random stack's DecodeWeights list in one format, and each linear's (weight, scale, outputs) for the
    op-by-op reference: qkv_proj with a bias and q / k norms (Qwen2's and Qwen3's extras) in every layer."""
    shapes = (((heads + 2 * kv_heads) * d, hidden), (hidden, heads * d), (2 * inter, hidden), (hidden, inter))
    entries, linears = [], []
    for _ in range(layers):
        held = []
        for n, k in shapes:
            held.append(_in_format(ops, fmt, torch.randn(n, k, generator=gen) / k**0.5) + (n,))
        norm = lambda n: torch.rand(n, generator=gen) + 0.5  # noqa: E731
        entries += [norm(hidden), norm(hidden), held[0][0], torch.randn(shapes[0][0], generator=gen), norm(d), norm(d)]
        entries += [held[1][0], None, held[2][0], None, held[3][0], None] + [scale for _, scale, _ in held]
        linears.append(held)
    return entries, linears


# rows and threads: a request or two (each thread its own inputs), three, and more rows than one group of the int8
# matmul's tile (six on AVX-512, two on AVX2) split unevenly over the team
ROWS_TEAMS = [(1, 2), (2, 2), (2, 3), (3, 2), (7, 2), (13, 3)]
# each linear layout decode_layers takes: the gemv of each weight format, the int8 and bf16 matmuls, the panel GEMM
FORMATS = ["fp32", "bf16", "w8", "w8a8", "bf16-matmul", "panels", "bf16-panels", "w8-panels"]


def _lengths(rows: int, longest: int) -> torch.Tensor:
    """Each request's KV length, one of them `longest` (its attention far longer than the others')."""
    return torch.tensor([(9, longest, 4, 23, 1, longest // 3)[i % 6] for i in range(rows)])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,team", ROWS_TEAMS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32-kv", "bf16-kv"])
def test_decode_layers_gives_the_bits_of_its_ops_called_in_turn(ops, threads, fmt, rows, team, kv_dtype):
    """decode_layers against its ops called one after another from Python (norms, the linear of each format,
    the attention, SiLU-and-mul): the same bits out and in the caches (float32 or bf16: --kv-cache-dtype). Every
    format runs as one parallel region (the threads' shares and barriers; above two rows the inputs made by the
    team, each thread its rows, the int8 matmul's quantized there and the panel GEMM's packed there in whole
    groups of its tile's rows: 13 rows are two groups on AVX-512), but the bf16 matmul above two rows, op by op."""
    threads(team)
    check_step_bits(ops, fmt, rows, kv_dtype)


def check_step_bits(ops, fmt: str, rows: int, kv_dtype) -> None:
    """The test above on the calling thread's team (also the ISA drill's, for each build)."""
    gen = torch.Generator().manual_seed(rows)
    heads, kv_heads, d, slots_n, block, eps = 4, 2, 16, 300 * rows + 64, low_precision.X_BLOCK, 1e-6
    entries, linears = _stack(ops, fmt, gen)
    held = ops.decode_weights(entries)
    assert held.one_region()
    layers = len(linears)
    caches = [torch.randn(slots_n, kv_heads, d, generator=gen).to(kv_dtype) for _ in range(2 * layers)]
    # at two rows one thread's attention (the long request's) takes far longer than the other's: a missing
    # barrier after it shows as an o_proj that read unwritten rows
    seq_lens = _lengths(rows, 300)
    # each request its own slots, as the pool gives them: a slot one request writes while another reads it is a
    # race the step need not order
    slots = (torch.randperm(slots_n - 1, generator=gen)[: 300 * rows] + 1).view(rows, 300)
    out_loc = slots[torch.arange(rows), seq_lens - 1].contiguous()
    x, cos, sin = (torch.randn(rows, n, generator=gen) for n in (64, d, d))
    k_ref, v_ref = [c.clone() for c in caches[:layers]], [c.clone() for c in caches[layers:]]

    def linear(i, layer, x, residual):
        w, scale, n = linears[layer][i]
        return _linear(ops, fmt, x, w, scale, n, entries[layer * 16 + 3] if i == 0 else None, residual)

    want = x
    for layer in range(layers):
        e = entries[layer * 16 : layer * 16 + 16]
        qkv = linear(0, layer, ops.rms_norm(want, e[0], eps), None)
        attn = ops.decode_attention(
            qkv, cos, sin, e[4], e[5], eps, k_ref[layer], v_ref[layer], out_loc, slots, seq_lens, heads, kv_heads, 0.25
        )
        h = linear(1, layer, attn, want)
        want = linear(3, layer, ops.silu_and_mul(linear(2, layer, ops.rms_norm(h, e[1], eps), None)), h)
    for _ in range(3):  # a race between the threads' shares would show as bits that differ in some run
        k, v = [c.clone() for c in caches[:layers]], [c.clone() for c in caches[layers:]]
        got = ops.decode_layers(x, held, k, v, eps, cos, sin, out_loc, slots, seq_lens, heads, kv_heads, 0.25, block)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(k + v, k_ref + v_ref))


def test_the_one_region_step_refuses_calls_that_do_not_match_its_weights(ops):
    """The one-region step reads raw pointers: a call whose shapes do not match the weights it holds is refused
    before any is read."""
    gen = torch.Generator().manual_seed(0)
    entries = _stack(ops, "w8a8", gen)[0]
    held = ops.decode_weights(entries)
    assert held.one_region()
    # weights whose data does not match (a bias or a scale of the wrong size, int8 without its scale, a
    # non-contiguous norm) are not taken for the one-region step: the ops in turn check them at the call
    for i, wrong in ((3, torch.zeros(7)), (12, torch.zeros(7)), (13, None), (0, torch.ones(128)[::2])):
        assert not ops.decode_weights(entries[:i] + [wrong] + entries[i + 1 :]).one_region()
    # a layer whose MLP is wider than the first's (the step's scratch is sized by the first)
    wide = _stack(ops, "w8a8", gen, inter=128)[0]
    assert not ops.decode_weights(entries[:16] + wide[16:32]).one_region()
    caches = [torch.zeros(40, 2, 16) for _ in range(3)]
    one = torch.ones(1, dtype=torch.int64)
    x, cos = torch.zeros(1, 64), torch.zeros(1, 16)
    args = (1e-6, cos, cos, one, one.view(1, 1), one, 4, 2, 0.25, 32)
    assert ops.decode_layers(x, held, caches, caches, *args).shape == (1, 64)
    with pytest.raises(RuntimeError, match="x \\[R, hidden\\]"):
        ops.decode_layers(torch.zeros(1, 32), held, caches, caches, *args)
    with pytest.raises(RuntimeError, match="qkv_proj's outputs"):
        ops.decode_layers(x, held, caches, caches, *args[:6], 2, 2, 0.25, 32)
    with pytest.raises(RuntimeError, match="block"):
        ops.decode_layers(x, held, caches, caches, *args[:9], 24)
    with pytest.raises(RuntimeError, match="one shape"):
        ops.decode_layers(x, held, caches, caches[:2] + [torch.zeros(39, 2, 16)], *args)
    with pytest.raises(RuntimeError, match="seq_lens out of range"):
        ops.decode_layers(x, held, caches, caches, *args[:5], one + 1, *args[6:])


def _head(ops, fmt: str, gen: torch.Generator, vocab: int, hidden=64):
    """A random lm_head in one format (weight, scale) and its final norm's weight: the rows of its second half
    copy the first half's, so every logit there ties with one in the first half (another thread's share)."""
    w = torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    w[vocab - vocab // 2 :] = w[: vocab // 2]
    return _in_format(ops, fmt, w), torch.rand(hidden, generator=gen) + 0.5


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,team", ROWS_TEAMS)
@pytest.mark.parametrize("vocab", [200, 16])
def test_decode_logits_gives_the_bits_of_decode_layers_then_its_head(ops, threads, fmt, rows, team, vocab):
    """decode_logits against decode_layers, then the final norm, the lm_head in the same format and torch.argmax
    called in turn: the same normed rows, logits, tokens and caches. In the one-region form (every format but the
    panel GEMM, and the bf16 matmul above two rows) each thread finds the best of its share of the logits: the
    ties across shares (the head's halves are equal) must go to the first, and a vocabulary of one panel leaves
    a thread with no share of the lm_head."""
    threads(team)
    gen = torch.Generator().manual_seed(7 * rows + vocab)
    heads, kv_heads, d, slots_n, block, eps = 4, 2, 16, 40 * rows + 8, low_precision.X_BLOCK, 1e-6
    entries, _ = _stack(ops, fmt, gen)
    (w, scale), norm = _head(ops, fmt, gen, vocab)
    held = ops.decode_weights(entries)
    with pytest.raises(RuntimeError, match="no head"):
        ops.decode_logits(torch.zeros(rows, 64), held, [], [], eps, *[torch.zeros(1)] * 5, 4, 2, 0.25, block, True)
    held.set_head(norm, w, scale, vocab)
    caches = [torch.randn(slots_n, kv_heads, d, generator=gen) for _ in range(6)]
    seq_lens = _lengths(rows, 40)
    slots = (torch.randperm(slots_n - 1, generator=gen)[: 40 * rows] + 1).view(rows, 40)  # each request its own
    out_loc = slots[torch.arange(rows), seq_lens - 1].contiguous()
    x, cos, sin = (torch.randn(rows, n, generator=gen) for n in (64, d, d))
    args = (eps, cos, sin, out_loc, slots, seq_lens, heads, kv_heads, 0.25, block)
    k_ref, v_ref = [c.clone() for c in caches[:3]], [c.clone() for c in caches[3:]]
    want_normed = ops.rms_norm(ops.decode_layers(x, held, k_ref, v_ref, *args), norm, eps)
    want_logits = _linear(ops, fmt, want_normed, w, scale, vocab)
    want_tokens = want_logits.argmax(dim=-1)
    if vocab > 16:
        assert (want_tokens < vocab // 2).all()  # the first of each tie
    for greedy in (True, False, True):  # a race between the threads' shares would show in some run
        k, v = [c.clone() for c in caches[:3]], [c.clone() for c in caches[3:]]
        normed, logits, tokens = ops.decode_logits(x, held, k, v, *args, greedy)
        assert torch.equal(normed, want_normed), (normed - want_normed).abs().max(dim=1)
        assert torch.equal(logits, want_logits)
        assert torch.equal(tokens, want_tokens) if greedy else tokens.numel() == 0
        assert all(torch.equal(a, b) for a, b in zip(k + v, k_ref + v_ref))


@pytest.mark.parametrize("team", [2, 3])
def test_decode_logits_argmax_takes_the_first_nan_of_any_threads_share(ops, threads, team):
    """torch.argmax's rule for NaN logits (the first NaN wins) across the threads' shares of the lm_head."""
    threads(team)
    gen = torch.Generator().manual_seed(team)
    entries, _ = _stack(ops, "fp32", gen)
    (w, _), norm = _head(ops, "fp32", gen, 200)
    held = ops.decode_weights(entries)
    caches = [torch.randn(16, 2, 16, generator=gen) for _ in range(6)]
    one = torch.ones(1, dtype=torch.int64)
    x, cos, sin = (torch.randn(1, n, generator=gen) for n in (64, 16, 16))
    args = (1e-6, cos, sin, one, one.view(1, 1), one, 4, 2, 0.25, 32, True)
    for nan_rows, want in (([190], 190), ([150, 190], 150), ([3, 190], 3)):
        head = w.clone()
        head[nan_rows] = float("nan")
        held.set_head(norm, head, None, 200)
        tokens = ops.decode_logits(x, held, [c.clone() for c in caches[:3]], [c.clone() for c in caches[3:]], *args)[2]
        assert tokens.tolist() == [want]
    with pytest.raises(RuntimeError, match="norm weight"):
        held.set_head(torch.ones(32), w, None, 200)


@pytest.mark.parametrize("quantization", ["none", "w8a8"])
def test_a_decode_steps_head_runs_in_the_layers_call_with_the_same_tokens_and_logits(ops, checkpoint, quantization):
    """A runner's decode step takes the final norm, the lm_head and the argmax in the layers' call
    (FusedLayers.logits): the greedy tokens and the logits are those of the step without it (the hidden through
    the final norm and the lm_head's own call), and its normed hidden is returned as the step's hidden."""
    path = checkpoint("llama")
    runner = ModelRunner(
        RunnerArgs(
            path, max_total_tokens=64, max_running_requests=2, linear_layout="rowblock", quantization=quantization
        )
    )
    counting = _count(runner)
    pool, table = runner.req_to_token_pool, runner.req_to_token_pool.req_to_token
    rows = [pool.alloc(), pool.alloc()]
    for row, prompt in zip(rows, ([5, 17, 99, 3], [7, 7, 2])):
        pool.write(row, 0, runner.kv_allocator.alloc(len(prompt) + 1))
        runner.forward(ForwardBatch.extend(table, [row], [0], [prompt]))
    fb = lambda: ForwardBatch.decode(table, torch.tensor(rows), [4, 3], torch.tensor([11, 12]))  # noqa: E731
    tokens, hidden = runner.forward(fb(), greedy=True)
    logits, _ = runner.forward(fb(), greedy=False)
    assert counting.heads == 2
    runner.model.fused_layers.lm_head = None  # the same step, its head after the layers' call
    runner.model.fused_layers._version = -1
    with torch.inference_mode():
        want_hidden = runner.model(fb(), runner.backend)
        want_logits = runner.model.compute_logits(want_hidden)
    assert counting.heads == 2
    assert torch.equal(hidden, want_hidden) and torch.equal(logits, want_logits)
    assert torch.equal(tokens, want_logits.argmax(dim=-1))


def test_where_the_greedy_head_serves_a_greedy_step_it_runs_in_the_call_or_after_it(ops, checkpoint):
    """fp32 with --greedy-head on, on a host with bf16 GEMMs: at one row (the one-region step) the call finds a
    greedy batch's tokens by the head's candidates (decode_logits); at three (the call takes candidates at up to
    two rows) the layers' call stops before the lm_head (decode_layers) and the head's bf16 pass finds them after
    it. A step that needs logits takes them in the call (decode_logits). Either way the tokens are the logits'
    argmax."""
    from common.models import greedy_head

    runner = ModelRunner(
        RunnerArgs(checkpoint("llama"), max_total_tokens=64, max_running_requests=3, linear_layout="rowblock",
                   greedy_head="on")
    )  # fmt: skip
    counting = _count(runner)
    table = runner.req_to_token_pool.req_to_token
    rows = _prefilled(runner, [[5, 17, 99, 3]] * 3)
    serves = runner.model.greedy_head is not None
    assert serves == greedy_head.available()
    for batch, in_call in ((1, True), (3, False)):
        index, pending = torch.tensor(rows[:batch]), torch.tensor([11] * batch)
        calls, heads = counting.calls, counting.heads
        tokens, _ = runner.forward(ForwardBatch.decode(table, index, [4] * batch, pending), greedy=True)
        logits, _ = runner.forward(ForwardBatch.decode(table, index, [4] * batch, pending), greedy=False)
        assert torch.equal(tokens, logits.argmax(dim=-1))
        assert counting.calls - calls == 2
        assert counting.heads - heads == (1 if serves and not in_call else 2)
