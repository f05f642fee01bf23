"""The host's batch-1 bandwidth floor, and this project's and HF's decode step as ratios to it.

    python -m bench.floor [--model-path DIR] [--threads 2] [--rounds 5] [--steps 20] [--new-tokens 24]

A decode step at batch 1 reads every weight once, so on CPU it cannot take less than the model's
weight bytes over the memory bandwidth. Each round measures, interleaved (the host is shared):
1. bandwidth: the fastest read of a --buffer-mib fp32 buffer (far beyond the caches; on 2 MiB pages,
   as the model's linear weights are: common/models/weight_arena.py) on --threads threads, picked
   once at the start among `torch.sum` and the fused ops' `stream_sum` with 1, 2 or 4 streams per
   thread (how their gemv reads weights; torch.sum's one stream per thread read ~0.9x of four on a
   2-core AMD EPYC), best of 3 passes: bytes / seconds. The floor = the model's parameter bytes (a tied
   lm_head counted once) / that bandwidth; the table adds the floors of the same weights in bf16 and in
   weight-only int8 (a float32 scale per output row) and in w8a8's int8 (a bf16 scale per row and block
   of 32), the vectors staying fp32.
2. ours: a ModelRunner (`--linear-layout`, default auto: the host's table) decoding one request
   at a 64-token prefix: the median of --steps greedy decode steps as the decode service runs them
   (ModelRunner.greedy_step where the model takes the step in one call, else the forward with greedy=True),
   the runners' forwards interleaved step by step (order rotated), with each runner's median
   per-step ratio to the first (a neighbour's load falls on both of a pair of steps alike);
   and after each step one bandwidth pass (below), whose floor each step is divided by: the
   "paired steps" ratio, which a drift of the host's bandwidth between the two cannot skew;
   `--variants` picks the runners, timed in turn within each round: eager (torch ops only, the fused
   CPU ops off), fused (the fused C++ ops of common/models/cpu_fused.py: norms, SiLU-and-mul, the
   decode attention), compiled (`--enable-torch-compile`: batch 1 compiled at warm-up, kept only where
   warm-up timed it faster: common/models/compiled_layers.py), w8, bf16, bf16-matmul and w8a8 (fused,
   with `--quantization w8 | bf16 | bf16-matmul | w8a8`: int8 or bf16 linears, common/models/low_precision.py; their
   ratios are to the fp32 floor and to their own, the int8 and bf16 floors in the table). `--op-count` first counts each
   runner's dispatched ops per batch-1 decode forward (torch.profiler, deterministic).
3. ours, the linears alone: every linear of the first runner's model once at one row, in model
   order, each in its batch-1 layout (median of --steps passes): the part of a step that streams
   the weights. What a step takes beyond it is per-op work outside the linears (norms, rotary, the
   KV write and gather, attention, activations, and the dispatch of each).
4. HF: transformers `generate` at batch 1, fp32: (time(N) - time(1)) / (N - 1) per token.
Every round prints the host probe's conditions over it (common/host_load.py: other processes'
CPU time, stolen time, load average). The table gives each figure's median and best round and
the ratio to the floor (each round against its own bandwidth), with the CPU (`lscpu` model, ISA).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

import torch

from common import host
from common.forward import intra_op
from common.host_load import HostProbe
from common.models import low_precision
from common.models.packed_linear import linear_weights
from common.models.table_check import time_pass
from common.models.weight_arena import hugepage_empty


def bandwidth_gbs(buffer: torch.Tensor, passes: int = 3, warm: bool = True, read=None) -> float:
    """GB/s of the best of `passes` reads of `buffer` (the calling thread's intra-op count) by `read`
    (default: torch.sum)."""
    read = read or torch.sum
    if warm:
        read(buffer)  # the pages are touched, the pool is up
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        read(buffer)
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / best / 1e9


def fastest_read(buffer: torch.Tensor, threads: int) -> tuple[str, object]:
    """The fastest read of `buffer` here: torch.sum, or (where the fused CPU ops load) their stream_sum
    with 1, 2 or 4 streams per thread, the way their gemv reads weights; (name, read)."""
    from common.models import cpu_fused

    reads = {"torch.sum": torch.sum}
    ops = cpu_fused.load()
    if ops is not None:
        for streams in (1, 2, 4):
            reads[f"stream_sum x{streams}"] = lambda b, s=streams: ops.stream_sum(b, s)
    rates = {
        name: intra_op.on_own_thread(lambda r=r: bandwidth_gbs(buffer, read=r), threads) for name, r in reads.items()
    }
    name = max(rates, key=rates.get)
    print(
        "bandwidth probe, GB/s: "
        + ", ".join(f"{n} {g:.1f}" for n, g in rates.items())
        + f"; the floor reads with {name}"
    )
    return name, reads[name]


def weight_bytes(model: torch.nn.Module, dtype: str = "fp32") -> int:
    """Bytes of the model's weights, each tensor once (a tied lm_head is the embedding): its parameters
    and, for ours, the packed linears' weights (no longer parameters); `dtype`: as stored in fp32, or
    the matrices in bf16, or in int8 with a float32 scale per output row (weight-only int8: `int8`) or a
    bf16 scale per row and block of 32 (w8a8: `int8-blocks`), the vectors (norms, biases) staying fp32."""
    seen: dict[int, int] = {}
    for p in [*model.parameters(), *(w.weight for w in linear_weights(model))]:
        if dtype == "fp32" or p.dim() < 2:
            seen[p.data_ptr()] = p.numel() * 4
        else:
            scales = {"int8": p.shape[0] * 4, "int8-blocks": p.numel() // low_precision.W_BLOCK * 2}.get(dtype, 0)
            seen[p.data_ptr()] = p.numel() * (2 if dtype == "bf16" else 1) + scales
    return sum(seen.values())


def linears_ms(model: torch.nn.Module, passes: int) -> float:
    """Median ms of one row through every linear of `model` in turn, each in its batch-1 layout."""
    weights = linear_weights(model)
    layouts = [w.plan[0] for w in weights]
    xs = {w.in_features: torch.randn(1, w.in_features) for w in weights}
    with torch.inference_mode():
        time_pass(weights, layouts, xs)  # warm
        return 1e3 * statistics.median(time_pass(weights, layouts, xs) for _ in range(passes))


def hf_ms_per_token(model, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt])

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                pad_token_id=0,
            )  # fmt: skip
        return time.perf_counter() - start

    run(2)  # warm-up
    return 1e3 * (run(new_tokens) - run(1)) / (new_tokens - 1)


def interleaved_ms(runners: list, steps: int, floor_pass=None) -> tuple[list[float], list[float], list[float]]:
    """Batch-1 decode forwards of every runner in turn, step by step (the order rotated each step), so
    a neighbour's load falls on all alike: each runner's median ms, the median per-step ratio of each
    later runner to the first, and with `floor_pass` (the floor's seconds, measured by a pass over
    the bandwidth buffer) run after each step, each runner's median per-step ratio to that floor."""
    from bench.linear_layouts import PREFIX
    from common.forward.forward_batch import ForwardBatch

    rows = []
    for runner in runners:
        pool, table = runner.req_to_token_pool, runner.req_to_token_pool.req_to_token
        rows.append(pool.alloc())
        pool.write(rows[-1], 0, runner.kv_allocator.alloc(PREFIX + steps + 3))
        runner.forward(ForwardBatch.extend(table, [rows[-1]], [0], [[5] * PREFIX]))
    times, floors = [[] for _ in runners], []
    buffers = [torch.zeros(runner.req_to_token_pool.size + 1, dtype=torch.int64) for runner in runners]
    for step in range(steps + 2):
        order = [(step + i) % len(runners) for i in range(len(runners))]
        for i in order:
            table, runner = runners[i].req_to_token_pool.req_to_token, runners[i]
            index, lens = torch.tensor([rows[i]]), [PREFIX + step]
            fb, lens_t = ForwardBatch.decode(table, index, lens, torch.tensor([7])), torch.tensor(lens)
            buffers[i][rows[i]] = 7  # the FutureMap's token buffer, as the decode service hands it over
            start = time.perf_counter()
            if runner.greedy_step(buffers[i], index, lens_t, lens) is None:
                runner.forward(fb, greedy=True)
            times[i].append(time.perf_counter() - start)
        floors.append(floor_pass() if floor_pass is not None else float("nan"))
    for runner, row in zip(runners, rows):
        table = runner.req_to_token_pool.req_to_token
        runner.kv_allocator.free(table[row, : PREFIX + steps + 3].to(torch.int64))
        runner.req_to_token_pool.free(row)
    kept = [t[2:] for t in times]  # the first two warm up
    ratios = [statistics.median(a / b for a, b in zip(t, kept[0])) for t in kept[1:]]
    to_floor = [statistics.median(a / f for a, f in zip(t, floors[2:])) for t in kept]
    return [1e3 * statistics.median(t) for t in kept], ratios, to_floor


def op_counts(runner, forwards: int = 5) -> tuple[float, float]:
    """(all dispatched ops, top-level ops) per batch-1 decode forward, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    from bench.linear_layouts import PREFIX
    from common.forward.forward_batch import ForwardBatch

    pool, table = runner.req_to_token_pool, runner.req_to_token_pool.req_to_token
    row = pool.alloc()
    pool.write(row, 0, runner.kv_allocator.alloc(PREFIX + forwards + 1))
    with torch.inference_mode():
        runner.forward(ForwardBatch.extend(table, [row], [0], [[5] * PREFIX]))
        batches = [
            ForwardBatch.decode(table, torch.tensor([row]), [PREFIX + i], torch.tensor([7])) for i in range(forwards)
        ]
        runner.forward(batches[0])  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for fb in batches[1:]:
                runner.forward(fb)
    runner.kv_allocator.free(table[row, : PREFIX + forwards + 1].to(torch.int64))
    pool.free(row)
    events = [e for e in prof.events() if "::" in e.name and not e.name.startswith("<")]
    top = [e for e in events if e.cpu_parent is None or "::" not in e.cpu_parent.name]
    return len(events) / (forwards - 1), len(top) / (forwards - 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--buffer-mib", type=int, default=1024)
    parser.add_argument("--linear-layout", default="auto")
    parser.add_argument("--no-hf", action="store_true", help="skip HF generate")
    parser.add_argument(
        "--variants",
        default="eager,fused",
        help="ours: eager, fused, compiled, w8, bf16, bf16-matmul, w8a8 (comma-separated)",
    )
    parser.add_argument("--op-count", action="store_true", help="print each runner's ops per decode forward")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the layout table and its start-up check
    from transformers import AutoModelForCausalLM

    from common.engine.model_runner import ModelRunner, RunnerArgs
    from common.tools.smollm2 import ensure_smollm2

    path = args.model_path or ensure_smollm2()
    torch.set_num_threads(args.threads)
    runners = {}
    for variant in args.variants.split(","):
        runners[variant] = ModelRunner(
            RunnerArgs(
                path,
                max_running_requests=1,
                max_total_tokens=256,
                linear_layout=args.linear_layout,
                torch_compile_max_bs=1 if variant == "compiled" else 0,
                cpu_fused=variant in ("fused", *low_precision.FORMATS),
                quantization=variant if variant in low_precision.FORMATS else "none",
            )
        )
        if variant in ("fused", *low_precision.FORMATS) and runners[variant].cpu_fused is None:
            print("fused: left out (the fused CPU ops did not load: see the log line above)", flush=True)
            del runners[variant]
            continue
        try:
            runners[variant].warmup()  # the compiled variant compiles (and times) its batch-1 step here
        except RuntimeError as e:  # no C++ compiler for Inductor, say: the other variants still run
            print(f"{variant}: left out ({e})", flush=True)
            del runners[variant]
    if args.op_count:
        for variant, runner in runners.items():
            every, top = op_counts(runner)
            print(f"{variant}: {every:.0f} dispatched ops per batch-1 decode forward ({top:.0f} top-level)", flush=True)
    hf = None if args.no_hf else AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if hf is not None:
        hf.generation_config.eos_token_id = None
    weighed = hf if hf is not None else next(iter(runners.values())).model
    nbytes = weight_bytes(weighed)
    by_dtype = {dtype: weight_bytes(weighed, dtype) for dtype in ("bf16", "int8", "int8-blocks")}
    # random (all-equal pages a host may merge: KSM), on 2 MiB pages as our weights are (weight_arena.py)
    buffer = hugepage_empty(args.buffer_mib * 2**20 // 4).uniform_()
    _, read = fastest_read(buffer, args.threads)
    probe, rows, ratios, paired_rounds = HostProbe(), [], [], []
    print(f"{host.describe()}, {args.threads} threads, weights {nbytes / 1e6:.0f} MB", flush=True)
    for r in range(args.rounds):
        before = probe.sample()
        gbs = intra_op.on_own_thread(lambda: bandwidth_gbs(buffer, read=read), args.threads)
        floor_pass = lambda: nbytes / (bandwidth_gbs(buffer, 1, warm=False, read=read) * 1e9)  # noqa: E731
        timed = intra_op.on_own_thread(
            lambda f=floor_pass: interleaved_ms(list(runners.values()), args.steps, f), args.threads
        )
        ours, step_ratios, paired = timed
        ratios.append(step_ratios)
        paired_rounds.append(paired)
        model = next(iter(runners.values())).model
        ours.append(intra_op.on_own_thread(lambda m=model: linears_ms(m, args.steps), args.threads))
        theirs = float("nan")
        if hf is not None:
            theirs = intra_op.on_own_thread(lambda: hf_ms_per_token(hf, [5] * 64, args.new_tokens), args.threads)
        floor = 1e3 * nbytes / (gbs * 1e9)
        rows.append((gbs, floor, theirs, *ours))
        c = probe.between(before, probe.sample())
        cells = "; ".join(f"{name} {ms:.1f} ms ({ms / floor:.2f}x)" for name, ms in zip([*runners, "linears"], ours))
        print(
            f"round {r}: {gbs:.1f} GB/s, floor {floor:.1f} ms; {cells}; HF {theirs:.1f} ms ({theirs / floor:.2f}x); "
            f"{c.describe()}",
            flush=True,
        )
    cols = list(zip(*rows))
    name = os.path.basename(path.rstrip("/"))
    print(f"\n{host.describe()}, {args.threads} threads, {name} fp32 weights {nbytes / 1e6:.0f} MB, "
          f"{args.rounds} rounds (median / best)\n")  # fmt: skip
    print("| figure | median | best |")
    print("| --- | --- | --- |")
    print(f"| bandwidth, GB/s | {statistics.median(cols[0]):.1f} | {max(cols[0]):.1f} |")
    print(f"| floor, ms per token | {statistics.median(cols[1]):.1f} | {min(cols[1]):.1f} |")
    for dtype, n in by_dtype.items():  # the same bandwidth, the weights as that dtype would store them
        print(f"| floor with {dtype} weights ({n / 1e6:.0f} MB), ms per token | "
              f"{statistics.median(cols[1]) * n / nbytes:.1f} | {min(cols[1]) * n / nbytes:.1f} |")  # fmt: skip
    names = [f"ours ({name})" for name in runners] + ["ours, the linears alone", "HF generate"]
    for name, ms in zip(names, [*cols[3:], cols[2]]):
        ratio = [o / f for f, o in zip(cols[1], ms)]
        print(f"| {name}, ms per token | {statistics.median(ms):.1f} | {min(ms):.1f} |")
        print(f"| {name} / floor | {statistics.median(ratio):.2f}x | {min(ratio):.2f}x |")
    own = {
        "w8": "int8",
        "bf16": "bf16",
        "bf16-matmul": "bf16",
        "w8a8": "int8-blocks",
    }  # a low-precision variant's own floor: its bytes'
    for i, name in enumerate(runners):
        per_round = [r[i] for r in paired_rounds]
        print(f"| ours ({name}) / floor, paired steps | {statistics.median(per_round):.2f}x | {min(per_round):.2f}x |")
        if name in own:
            f = nbytes / by_dtype[own[name]]
            print(f"| ours ({name}) / its own ({own[name]}) floor, paired steps | "
                  f"{f * statistics.median(per_round):.2f}x | {f * min(per_round):.2f}x |")  # fmt: skip
    for i, name in enumerate(list(runners)[1:], 1):
        per_round = [r[i - 1] for r in ratios]
        print(f"| ours ({name}) / ours ({next(iter(runners))}), paired steps | {statistics.median(per_round):.3f}x "
              f"| {min(per_round):.3f}x |")  # fmt: skip
    for name, runner in runners.items():
        compiled = runner.model.compiled_layers
        if compiled is not None:
            print(f"{name}: warm-up (eager ms, compiled ms) {compiled.timings}, compiled buckets {compiled.buckets}")


if __name__ == "__main__":
    main()
