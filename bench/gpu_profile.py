"""Where a GPU decode step's time goes: its kernels by name, the host's busiest ops, per decode step.

    python -m bench.gpu_profile [--shapes llama-3.1-8b,llama-3.2-1b] [--batch-sizes 1,64]
        [--attention-backend triton] [--cuda-graph] [--out-dir DIR] [--trace-batch 1]

For each shape (a random-weight bf16 checkpoint, as bench.gpu_bench builds it) and batch size, the
decode scheduler with in-process prefill runs twice under torch.profiler, with SHORT and LONG new
tokens (overlap on); every figure is the difference of the two runs over LONG - SHORT, so prefill and
set-up cancel and what is left is per decode step: each kernel's launches and device microseconds,
the device's busy time, the host ops with the most self time (cudaGraphLaunch, copies, syncs), and
the median inter-token gap of the long run. `--trace-batch B` also writes a gzipped chrome trace of
the long run at batch B per shape (open it in Perfetto) into --out-dir.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import shutil
import tempfile
import time

import torch

from bench.gpu_bench import SHAPES, build_checkpoint, load_runners

SHORT, LONG = 8, 40


def profile_run(runners, prompt, batch: int, new_tokens: int, trace: str | None = None):
    """(kernel table {name: [calls, us]}, host table {name: [calls, self us]}, median ITL ms)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.serving_bench import bench_inprocess

    try:  # the scheduler's forward runs on threads of its own: record every thread's ops, and the syncs
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True)
    except TypeError:
        config = None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], experimental_config=config) as prof:
        r = bench_inprocess("", prompt, batch, new_tokens, overlap=True, runners=runners)
    kernels, host = collections.defaultdict(lambda: [0, 0.0]), collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        table = kernels if e.device_type == torch.autograd.DeviceType.CUDA else host
        us = e.time_range.elapsed_us() if table is kernels else e.self_cpu_time_total
        table[e.name][0] += 1
        table[e.name][1] += us
    if trace:
        raw = trace[: -len(".gz")]
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
    return kernels, host, r["itl_p50_ms"]


def per_step(long: dict, short: dict, steps: int) -> dict:
    names = set(long) | set(short)
    out = {n: [(long.get(n, [0, 0])[i] - short.get(n, [0, 0])[i]) / steps for i in (0, 1)] for n in names}
    return {n: v for n, v in out.items() if v[0] > 0.01 or v[1] > 0.5}


def report(shape: str, batch: int, kernels: dict, host: dict, itl: float, top: int) -> dict:
    busy_ms = sum(us for _, us in kernels.values()) / 1e3
    launches = sum(n for n, _ in kernels.values())
    print(
        f"\n## {shape} B={batch}: ITL p50 {itl:.3f} ms, device busy {busy_ms:.3f} ms/step, {launches:.0f} kernels/step"
    )
    print("| kernel | per step | us/step | share |\n| --- | --- | --- | --- |")
    for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {name[:90]} | {n:.1f} | {us:.1f} | {us / max(busy_ms * 1e3, 1e-9):.1%} |")
    print("| host op | per step | self us/step |\n| --- | --- | --- |")
    for name, (n, us) in sorted(host.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {name[:90]} | {n:.1f} | {us:.1f} |")
    return dict(shape=shape, batch=batch, itl_ms=itl, busy_ms=busy_ms, kernels_per_step=launches,
                kernels=kernels, host=host)  # fmt: skip


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="llama-3.1-8b,llama-3.2-1b")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--cuda-graph", action="store_true")
    p.add_argument("--out-dir", default=".")
    p.add_argument("--trace-batch", type=int, default=None)
    p.add_argument("--fused", default="on", help="the fused CUDA ops (bench.gpu_bench --fused): on | cublas | off")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (no kernels to list)")
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    graphs = "on" if args.cuda_graph else "off"
    print(f"# {name}, torch {torch.__version__}, attention {args.attention_backend}, CUDA graphs {graphs}, "
          f"prompt {args.prompt_len}, steps {SHORT}..{LONG}")  # fmt: skip
    rows = []
    batches = [int(b) for b in args.batch_sizes.split(",")]
    for shape in args.shapes.split(","):
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            model = build_checkpoint(shape, args.device, getattr(torch, dtype), folder)
            del model
            vocab = SHAPES[shape]["vocab_size"]
            prompt = [(1000003 * i + 7) % (vocab - 3) + 3 for i in range(args.prompt_len)]
            runners = load_runners(
                folder, max(batches), args.prompt_len + LONG, args.device, dtype, args.attention_backend,
                args.cuda_graph, args.fused,
            )  # fmt: skip
            print(f"# {shape}: built and loaded in {time.perf_counter() - start:.0f} s", flush=True)
            for b in batches:
                profile_run(runners, prompt, b, SHORT)  # warm-up
                short_k, short_h, _ = profile_run(runners, prompt, b, SHORT)
                trace = os.path.join(args.out_dir, f"trace_{shape}_b{b}.json.gz") if b == args.trace_batch else None
                long_k, long_h, itl = profile_run(runners, prompt, b, LONG, trace)
                steps = LONG - SHORT
                rows.append(report(shape, b, per_step(long_k, short_k, steps), per_step(long_h, short_h, steps), itl,
                                   args.top))  # fmt: skip
                print("", flush=True)
            del runners
            if args.device == "cuda":
                torch.cuda.empty_cache()
    with open(os.path.join(args.out_dir, "gpu_profile.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
