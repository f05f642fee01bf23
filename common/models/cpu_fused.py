"""Fused CPU fp32 ops (common/kernels/: cpu_fused.cpp, cpu_gemv.cpp, cpu_gemm.cpp, cpu_bf16.cpp, cpu_int8.cpp,
cpu_step.cpp, cpu_argmax.cpp, cpu_token_step.cpp, cpu_candidates.cpp, cpu_decode_weights.cpp,
cpu_common.h, cpu_decode_weights.h),
built on first use on this host, or None.

A batch-1 CPU decode step is its weights streamed once; in torch ops it also spent ~8-11 ms in
~2,000 small dispatched ops outside the linears on SmolLM2-135M (BENCHMARKS.md). The extension runs
each RMSNorm and SiLU-and-mul as one op, a decode batch's q/k norm + rotary + KV write + paged
attention as one call per layer, the rowblock layout's GEMV for up to 4 rows (a few sequential
weight streams per thread), and a dense decoder's whole stack for such a step as one call
(`cpu_step.FusedLayers`, with the final norm, the lm_head and the argmax). `attach` wires them in:
RMSNorm, MLP, the linear weights, the decoder's layers, the batched backend; the target's and the EAGLE
head's.

The build runs once per host, torch and source: `torch.utils.cpp_extension.load` with CFLAGS,
cached under ~/.cache/disagg-serve/cpu-fused/<key> (the key hashes the CPU's flags, torch's version,
CFLAGS and the sources, since -march=native code is for this CPU only); the log says
when it compiles (~20 s on a 2-core AMD EPYC) and how long it took. Where the build or the load fails
(no compiler, no ninja, an error), one log line says why and everything runs the torch path as before.
`--disable-cpu-fused` turns it off. A test hands `load` a stand-in `build` to prove the fallback.

Restarts never hang on it, and never load what this code did not build: the build holds an flock on
the folder's `build.lock` (the kernel drops it when its holder dies; another live builder is waited
for at most BUILD_WAIT_S). torch's own lock file (`lock`), which a build killed by SIGTERM leaves and
every later start would wait on forever, found while we hold the flock means an interrupted build:
its outputs are cleared and it builds again, with a log line. The folders are 0700, and the library's
sha256 is recorded after each load under the lock (`<name>.so.sha256`: what torch built, or found up
to date, for these sources): a library that does not match it at the next start, or has none, is
cleared and built again before anything loads it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)
KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
SOURCES = [
    os.path.join(KERNELS, name)
    for name in (
        "cpu_fused.cpp",
        "cpu_gemv.cpp",
        "cpu_gemm.cpp",
        "cpu_bf16.cpp",
        "cpu_int8.cpp",
        "cpu_step.cpp",
        "cpu_argmax.cpp",
        "cpu_token_step.cpp",
        "cpu_candidates.cpp",
        "cpu_decode_weights.cpp",
    )
]
HEADERS = [os.path.join(KERNELS, name) for name in ("cpu_common.h", "cpu_decode_weights.h")]
NAME = "disagg_cpu_fused"
# -fno-trapping-math: float compares and conversions may be if-converted, so loops with a select (the
# SiLU's exp clamps) vectorize; no value changes (no reassociation, no fast-math). The SiLU-and-mul of
# 16 x 1536 took 184 us without it (scalar), 3x torch's.
CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"]  # libgomp: torch's own, already loaded
_lock = threading.Lock()
_loaded: dict[object, FusedOps | None] = {}  # per build callable


def cpu_flags() -> str:
    """The CPU's model and ISA flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("flags", "model name"))][:2]
        return "".join(sorted(lines))
    except OSError:
        return platform.processor() or platform.machine()


def build_key() -> str:
    """The build's name: a hash of this CPU's flags, torch's version, CFLAGS and the sources (what decides the
    code, and so its speed: the host's layout table keys the gemv by it)."""
    source = b""
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            source += f.read()
    key = cpu_flags().encode() + torch.__version__.encode() + " ".join(CFLAGS).encode() + source
    return hashlib.sha256(key).hexdigest()[:16]


def build_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "disagg-serve", "cpu-fused", build_key())


BUILD_LOCK = "build.lock"
BUILD_WAIT_S = 900.0  # another live process's build (~20 s; minutes on a loaded host) before giving up


@contextmanager
def build_lock(folder: str, wait_s: float = BUILD_WAIT_S):
    """An exclusive flock on `folder`/build.lock while building or loading: released by the kernel when
    its holder dies (unlike torch's lock file); TimeoutError after `wait_s` held by another process."""
    import fcntl

    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(os.path.join(folder, BUILD_LOCK), flags, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has held {folder}'s build lock for {wait_s:.0f} s") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # releases the lock


def _library(folder: str) -> str:
    return os.path.join(folder, f"{NAME}.so")


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _clear(folder: str, why: str) -> None:
    """Everything in `folder` but the build lock goes: the next load builds from scratch."""
    log.warning("CPU fused ops: %s: building again in %s", why, folder)
    for name in os.listdir(folder):
        if name == BUILD_LOCK:
            continue
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def _check_folder(folder: str) -> None:
    """Under the build lock, before torch looks at `folder`: an interrupted build, or a library that is not
    the one recorded at build time (or has no record), is cleared."""
    if os.path.exists(os.path.join(folder, "lock")):  # torch's lock file with no live builder: we hold the flock
        _clear(folder, "a build was interrupted (torch's lock file left behind, e.g. by SIGTERM)")
        return
    library, record = _library(folder), _library(folder) + ".sha256"
    if not os.path.exists(library):
        return
    try:
        with open(record) as f:
            recorded = f.read().strip()
    except FileNotFoundError:
        recorded = None
    if recorded != _sha256(library):
        _clear(folder, f"{library} is not the library recorded at build time")


def _record(folder: str) -> None:
    library = _library(folder)
    tmp = f"{library}.sha256.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(_sha256(library))
    os.replace(tmp, f"{library}.sha256")


def build_extension() -> None:
    """Compile (or find compiled) and load the library into torch.ops.disagg_cpu_fused."""
    from torch.utils import cpp_extension

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
    folder = build_dir()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    for path in (os.path.dirname(folder), folder):  # only this user may plant or replace a library here
        if os.stat(path).st_uid == os.getuid():
            os.chmod(path, 0o700)
    with build_lock(folder):
        _check_folder(folder)
        fresh = not os.path.exists(_library(folder))
        if fresh:
            log.info(
                "CPU fused ops: compiling %s for this host into %s (once per host and torch; ~20 s)", KERNELS, folder
            )
        start = time.perf_counter()
        cpp_extension.load(
            NAME,
            SOURCES,
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=folder,
            is_python_module=False,
            verbose=False,
        )
        _record(folder)  # what torch built or found for these sources (ninja rebuilds on a changed build file)
        if fresh:
            log.info("CPU fused ops: built in %.1f s", time.perf_counter() - start)


class FusedOps:
    """The loaded ops (torch.ops.disagg_cpu_fused), called by the modules `attach` marks."""

    def __init__(self):
        ops = getattr(torch.ops, NAME)
        self.rms_norm, self.silu_and_mul, self.decode_attention = ops.rms_norm, ops.silu_and_mul, ops.decode_attention
        self.gemv, self.decode_layers, self.stream_sum = ops.gemv, ops.decode_layers, ops.stream_sum
        self.decode_logits = ops.decode_logits  # decode_layers, then the final norm and the lm_head (and argmax)
        self.greedy_step = ops.greedy_step  # decode_logits' greedy step on the decode service's token buffer
        self.gemv_w8 = ops.gemv_w8  # weight-only int8 linears (common/models/low_precision.py; gemv takes bf16)
        self.pack_panels, self.gemm_panels = ops.pack_panels, ops.gemm_panels  # the `panels` layout: many rows
        self.pack_bf16_pairs, self.gemm_bf16 = ops.pack_bf16_pairs, ops.gemm_bf16  # the bf16-matmul layout
        self.pack_int8_quads, self.gemm_int8 = ops.pack_int8_quads, ops.gemm_int8  # the w8a8 layout
        self.pack_int8_scales = ops.pack_int8_scales  # and its scales
        self.decode_weights = getattr(torch.classes, NAME).DecodeWeights  # decode_layers' weights, held once
        self.row_streams = ops.row_streams  # the streams per thread of one row's gemv (pick_row_streams)
        self.int8_streams = ops.int8_streams  # and of the int8 matmul's (pick_int8_streams)
        self.argmax_rows = ops.argmax_rows  # torch.argmax(x, dim=-1) of float32 rows (`argmax`)

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether rms_norm / silu_and_mul take x: fp32, contiguous."""
        return x.dtype == torch.float32 and x.is_contiguous()


ROW_STREAMS = (1, 2, 4)
INT8_STREAMS = (1, 2)


def _fastest(set_streams: Callable[[int], int], choices: tuple[int, ...], time_pass: Callable[[int], float],
             rounds: int, what: str) -> int:  # fmt: skip
    """Set the count among `choices` whose best pass (time_pass(streams): seconds) is fastest over `rounds`
    interleaved rounds, log it, and return it."""
    best = {}
    with torch.inference_mode():
        for r in range(rounds):
            for streams in choices[:: 1 if r % 2 else -1]:
                best[streams] = min(best.get(streams, float("inf")), time_pass(streams))
    chosen = min(best, key=best.get)
    set_streams(chosen)
    log.info("%s at one row: %d stream(s) per thread (ms per pass of the linears: %s)", what, chosen,
             ", ".join(f"{s}: {1e3 * best[s]:.2f}" for s in choices))  # fmt: skip
    return chosen


def _one_row_pass(set_streams: Callable[[int], int], weights: list, run: Callable) -> Callable[[int], float]:
    """time_pass for _fastest: every weight's run(x, w) at one row, in model order, from memory."""
    xs = {w.in_features: torch.randn(1, w.in_features) for w in weights}

    def time_pass(streams: int) -> float:
        set_streams(streams)
        start = time.perf_counter()
        for w in weights:
            run(xs[w.in_features], w)
        return time.perf_counter() - start

    return time_pass


def pick_row_streams(ops: FusedOps, weights: list, rounds: int = 3, time_pass: Callable | None = None) -> int:
    """Set the gemv's streams per thread at one row (a batch-1 decode step's linears) to the fastest of
    ROW_STREAMS on this host, and return it. Hosts differ: on a 2-core AMD Zen 4 with the weights on
    2 MiB pages one stream was ~10% faster than four, on the AVX2 host of the gemv's comment four beat
    one. `time_pass(streams)`: seconds of one pass (default: every weight's fp32 gemv at one row, in
    model order, from memory); the best of `rounds` interleaved rounds decides. Each row's dot product
    does not depend on the streams, so neither do the results. Run on the computing thread's count. Decode's
    warm-up times the streams again as whole steps (fused_plan.py): op by op they came within 4% where the
    steps differed by 10%."""
    if time_pass is None:
        time_pass = _one_row_pass(ops.row_streams, weights, lambda x, w: ops.gemv(x, w.weight, None, None))
    return _fastest(ops.row_streams, ROW_STREAMS, time_pass, rounds, "gemv")


def pick_int8_streams(ops: FusedOps, weights: list, rounds: int = 3, time_pass: Callable | None = None) -> int:
    """The same for w8a8's int8 matmul (INT8_STREAMS: its panels side by side at one row, cpu_int8.cpp):
    `weights` quantized and packed (low_precision.quantize); the default pass is each one's matmul at one
    row. A column's sums do not depend on the streams, so neither do the results."""
    if time_pass is None:
        time_pass = _one_row_pass(
            ops.int8_streams, weights, lambda x, w: w.gemm(x, w.low_panels, w.out_features, None, None)
        )
    return _fastest(ops.int8_streams, INT8_STREAMS, time_pass, rounds, "int8 matmul")


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of logits rows [R, V]: the same indices (the first of each row's largest, or its
    first NaN), through the fused ops' argmax_rows where this process loaded them and x is theirs to take (CPU
    float32, contiguous, V > 0): torch's took ~21 us per SmolLM2 row on a 2-core AMD Zen 4 (cpu_argmax.cpp)."""
    ops = _loaded.get(build_extension)
    if ops is not None and x.dim() == 2 and x.shape[1] > 0 and x.device.type == "cpu" and FusedOps.takes(x):
        return ops.argmax_rows(x)
    return torch.argmax(x, dim=-1)


def load(build: Callable[[], None] = build_extension) -> FusedOps | None:
    """The fused ops, built and loaded once per process (per `build`), or None after one log line."""
    with _lock:
        if build not in _loaded:
            try:
                build()
                _loaded[build] = FusedOps()
                log.info("CPU fused ops: loaded (norms, SiLU-mul, attention, GEMV; --disable-cpu-fused: off)")
            except Exception as e:  # noqa: BLE001 (any failure: the torch path serves)
                reason = " ".join(str(e).split())  # one line, even for a compiler's output
                reason = reason if len(reason) <= 400 else f"{reason[:200]} ... {reason[-200:]}"
                log.warning("CPU fused ops unavailable (%s: %s); using the torch path", type(e).__name__, reason)
                _loaded[build] = None
        return _loaded[build]


def usable(device: torch.device, dtype: torch.dtype, tp_size: int) -> str | None:
    """Why the fused ops do not apply to this runner (None: they do)."""
    if device.type != "cpu":
        return "not on CPU"
    if dtype != torch.float32:
        return f"dtype {dtype}, not float32"
    if tp_size > 1:
        return "tensor parallelism"
    return None


def attach(model: torch.nn.Module, backend, ops: FusedOps | None) -> int:
    """Give the model's RMSNorms and dense MLPs and the batched backend (whose decode batches then
    run each layer's attention as one call from Attention.forward) the ops, a decoder whose layers are
    all dense FusedLayers (the whole stack's decode step as one call), and its linear weights the gemv
    of their rowblock layout, or with None take them away; returns how many modules (norms, MLPs, the
    stack, the backend) got them."""
    from common.models.cpu_step import FusedLayers, fusable
    from common.models.decoder import RMSNorm, give_fused_ops
    from common.models.packed_linear import DEFAULT_PLAN, linear_weights

    for weight in linear_weights(model):  # the rowblock layout's few-row steps (lm_head too)
        weight.gemv = None if ops is None else ops.gemv
        weight.gemv_w8 = None if ops is None else ops.gemv_w8
        if weight.plan is DEFAULT_PLAN or "panels" in weight.plan:  # not yet tuned, or tuned to use it
            weight.set_panels(ops)
    n, layers = give_fused_ops(model, ops)
    if hasattr(model, "fused_layers"):  # a decoder whose every layer is dense: its decode step as one call
        whole = bool(layers) and all(fusable(layer) for layer in layers)
        if whole:  # decode_layers takes one epsilon and one attention shape for every layer
            a = [layer.self_attn for layer in layers]
            shapes = {(x.num_heads, x.num_kv_heads, x.head_dim, x.scale) for x in a}
            whole = len(shapes) == 1 and len({layer.input_layernorm.eps for layer in layers}) == 1
        head = None
        norm, lm_head = getattr(getattr(model, "model", None), "norm", None), getattr(model, "_lm_head_cpu", None)
        if whole and lm_head is not None and getattr(model, "tp", None) is None and type(norm) is RMSNorm:
            head = (norm, lm_head) if norm.eps == layers[0].input_layernorm.eps else None  # decode_logits: one eps
        model.fused_layers = FusedLayers(layers, ops, head) if whole and ops is not None else None
        n += model.fused_layers is not None
    if hasattr(backend, "fused_pool_args"):  # the batched backend (the triton one takes the CUDA ops)
        backend.fused = ops
        n += 1
    return n if ops is not None else 0
