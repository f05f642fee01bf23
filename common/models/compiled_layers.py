"""CompiledLayers: the decoder's layer stack through torch.compile for small decode batches (CPU, opt-in).

At batch 1 a CPU decode step is the weights streamed once (~20 ms for SmolLM2-135M's fp32 linears
on a 2-core Intel Xeon) plus ~7 ms of everything else: ~15 small torch ops per layer (norms, rotary,
the KV write and gather, SDPA, SiLU) and the Python that calls them, a few microseconds each.
torch.compile (Inductor) traces the 30 layers into one graph, fuses the elementwise and reduction
ops into generated C++ kernels and leaves the GEMMs and SDPA as library calls: measured there,
a batch-1 forward went from 27.9 to 25.0 ms in a fast spell of the host and from 35.8 to 27.6 ms
in a slow one (`BENCHMARKS.md`).

The price is start-up: tracing and compiling one graph take 20-90 s on 2 cores, one per row
bucket (Inductor's cache on disk makes a restart on the same host faster). Decode batches of 2 or
more requests that may run compiled always get an attention mask, so a bucket needs one graph,
not one with and one without. So it is opt-in, as in
SGLang (`--enable-torch-compile`, `--torch-compile-max-bs`, default 1 here), and warm-up compiles
every bucket up to the largest batch before the service reports SERVING, then times each against
eager and keeps it only where it is faster (on the Intel host: 26.5 -> 24.1 ms at 1 request,
29.3 -> 27.2 at 2, 38.8 -> 38.7 at 4, which stays eager). Used for decode forwards of at most `max_bs`
requests without captured layers (EAGLE3's features) and not under tensor parallelism; every
other forward runs eagerly. The generated kernels sum in another order than eager torch, so results
equal eager within fp32 rounding (the parity tests run this path against HF).

Inside the compiled graph a linear planned for the oneDNN-packed layout runs as `mkl` instead
(`common/models/packed_linear.py`): Inductor lowers oneDNN's packed linear only for weights it
froze itself.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time

import torch

from common.forward.forward_batch import ForwardBatch, ForwardMode
from common.models.packed_linear import ROW_BUCKETS, bucket_index

log = logging.getLogger(__name__)
_this_thread = threading.local()
COMPILE_TIME = "20-90 s per row bucket on 2 cores"
MAX_BS = 8  # one graph per row bucket (4 up to 8 requests), well inside Dynamo's recompile limit (8)
MIN_GAIN = 0.02  # a bucket stays compiled only if warm-up timed it at least this much faster (noise)
KEEP_SLOWER = False  # tests: keep every compiled bucket, so parity runs through it whatever the timing


def check_usable(device: torch.device, attention_backend: str, tp_size: int, static_buffers: bool) -> None:
    """Refuse, at start-up, the set-ups this path has not been built or tested for."""
    if device.type != "cpu":
        raise ValueError("--enable-torch-compile is for CPU; on CUDA decode steps replay CUDA graphs")
    if attention_backend != "batched":  # the reference backend loops over requests: a graph per batch size
        raise ValueError(f"--enable-torch-compile needs --attention-backend batched, not {attention_backend!r}")
    if tp_size > 1:
        raise ValueError("--enable-torch-compile does not run under tensor parallelism (--tp-size > 1)")
    if static_buffers:
        raise ValueError("--enable-torch-compile does not run through static decode buffers")


class CompiledLayers:
    def __init__(self, run_layers, max_bs: int):
        """`run_layers(x, cos, sin, forward_batch, backend) -> x`: the eager layer stack to compile.
        No bucket runs compiled until `compile_and_time` (warm-up) has compiled and timed it."""
        if not 1 <= max_bs <= MAX_BS:
            raise ValueError(f"--torch-compile-max-bs must be from 1 to {MAX_BS}, got {max_bs}")
        self.max_bs = max_bs
        self.buckets: set[int] = set()  # the row buckets that run compiled
        self.timings: dict[int, tuple[float, float]] = {}  # batch -> (eager ms, compiled ms) at warm-up
        self._fn = torch.compile(run_layers, dynamic=True)

    def used_for(self, forward_batch: ForwardBatch) -> bool:
        b = forward_batch.batch_size
        return forward_batch.mode is ForwardMode.DECODE and b <= self.max_bs and bucket_index(b) in self.buckets

    def __call__(self, x, cos, sin, forward_batch: ForwardBatch, backend) -> torch.Tensor:
        if not getattr(_this_thread, "no_duck_shape", False):
            # Sizes that happen to be equal when a graph is traced (the KV scratch and the slot list at
            # warm-up) would otherwise be assumed equal for good, and a later step would compile again
            # (20-40 s). torch's config overrides are per thread: set on each thread that compiles.
            torch.fx.experimental._config.use_duck_shape = False
            _this_thread.no_duck_shape = True
        return self._fn(x, cos, sin, forward_batch, backend)


def warm_batches(max_bs: int) -> list[int]:
    """Batch sizes whose decode forward warm-up runs so each row bucket is compiled before serving:
    one per bucket of `packed_linear.ROW_BUCKETS` up to `max_bs`, the bucket's largest size."""
    sizes = {min(ROW_BUCKETS[bucket_index(b)], max_bs) for b in range(1, max_bs + 1)}
    return sorted(sizes)


def compile_and_time(compiled: CompiledLayers, compile_one, time_one, rounds: int = 5) -> None:
    """For each warm-up batch size: `compile_one(batch)` (its first compiled calls compile), then
    `time_one(batch)` eagerly and compiled, interleaved `rounds` times; a bucket keeps its compiled
    graph only where the median was at least MIN_GAIN faster (a host where the layouts that compiled
    graphs cannot use win by more than the fusion gains runs that bucket eagerly). Logged."""
    for b in warm_batches(compiled.max_bs):
        start, bucket = time.perf_counter(), bucket_index(b)
        log.info("torch.compile: compiling the decode step for %d request(s) (once per start: %s)", b, COMPILE_TIME)
        compiled.buckets.add(bucket)
        try:
            compile_one(b)
        except Exception as e:  # the service fails to start, saying why
            raise RuntimeError(
                f"--enable-torch-compile: compiling the decode step for {b} request(s) failed "
                f"({type(e).__name__}: {str(e)[:300]}); start without the flag to run eagerly "
                "(on CPU, Inductor needs a C++ compiler, e.g. g++)"
            ) from e
        compile_s, times = time.perf_counter() - start, {True: [], False: []}
        for _ in range(rounds):
            for on in (False, True):
                (compiled.buckets.add if on else compiled.buckets.discard)(bucket)
                t = time.perf_counter()
                time_one(b)
                times[on].append(1e3 * (time.perf_counter() - t))
        eager, fast = statistics.median(times[False]), statistics.median(times[True])
        compiled.timings[b] = (eager, fast)
        if fast > eager * (1 - MIN_GAIN) and not KEEP_SLOWER:
            compiled.buckets.discard(bucket)
        log.info(
            "torch.compile: %d request(s) compiled in %.1f s; a decode forward %.1f ms eager, %.1f ms compiled: %s",
            b,
            compile_s,
            eager,
            fast,
            "compiled" if bucket in compiled.buckets else "eager (not faster here)",
        )
