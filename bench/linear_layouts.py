"""The CPU linear layouts on this host: the start-up table, and whole decode forwards per layout.

    python -m bench.linear_layouts [--model-path DIR] [--threads 2] [--batch-sizes 1,4,16] [--steps 20] [--rounds 3]

Model: SmolLM2-135M-Instruct (converted once) unless --model-path, fp32. A runner per layout (`auto`,
then each one forced; auto logs its timing table); in each round every runner gives B requests a
64-token prefix and times `--steps` decode forwards of B rows (median ms per forward: model only,
no scheduler); the table keeps each layout's best round. Prints a markdown table with the host's CPU (common/host.py).

    python -m bench.linear_layouts --busy-start [--batch-sizes 1] [--quiet-wait 180]

Issue 41's scenario instead, in a table folder of its own: a first start times the table while
another process spins on one core; then, once the host probe (common/host_load.py) reads quiet
(waiting up to --quiet-wait s), a second `auto` start (its start-up check, and a re-timing when
the stored table is provisional or the check disagrees) and a clean `retime` start. The three
runners are timed as above; the figure is the quiet start over the clean one at each batch.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from common import host
from common.forward import intra_op
from common.forward.forward_batch import ForwardBatch
from common.models.linear_tuning import CHOICES

PREFIX = 64


def decode_ms(runner, batch: int, steps: int) -> float:
    table = runner.req_to_token_pool.req_to_token
    rows = []
    for _ in range(batch):
        rows.append(runner.req_to_token_pool.alloc())
        runner.req_to_token_pool.write(rows[-1], 0, runner.kv_allocator.alloc(PREFIX + steps + 1))
    runner.forward(ForwardBatch.extend(table, rows, [0] * batch, [[5] * PREFIX] * batch))
    times, ids = [], torch.full((batch,), 7)
    for step in range(steps + 2):
        start = time.perf_counter()
        runner.forward(ForwardBatch.decode(table, torch.tensor(rows), [PREFIX + step] * batch, ids))
        times.append(time.perf_counter() - start)
    for row in rows:
        runner.kv_allocator.free(table[row, : PREFIX + steps + 1].to(torch.int64))
        runner.req_to_token_pool.free(row)
    return 1e3 * statistics.median(times[2:])  # the first two warm up


def wait_quiet(limit_s: float):
    """The first 1-second window the host probe reads as quiet, or the last one after `limit_s`."""
    from common.host_load import HostProbe

    probe, start = HostProbe(), time.monotonic()
    while True:
        c = probe.window(1.0)
        if c.quiet or time.monotonic() - start > limit_s:
            print(f"host {'quiet' if c.quiet else 'STILL BUSY'}: {c.describe()}", flush=True)
            return c


def busy_start_runners(make, quiet_wait: float) -> dict:
    """Runners for issue 41's scenario (see the module's doc), their table in a folder of its own."""
    from common.models import host_table

    os.environ[host_table.ENV_DIR] = tempfile.mkdtemp(prefix="busy-start-tables-")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        print("first start, timed while another process spins on one core:", flush=True)
        runners = {"timed under load": make("auto")}
    finally:
        spinner.kill()
        spinner.wait()
    wait_quiet(quiet_wait)
    print("second start on the quiet host (auto):", flush=True)
    runners["quiet start after"] = make("auto")
    runners["retime (clean)"] = make("retime")
    return runners


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layouts", default=",".join(CHOICES), help="which, in this order")
    parser.add_argument("--busy-start", action="store_true", help="issue 41's scenario (see above)")
    parser.add_argument("--quiet-wait", type=float, default=180.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from common.engine.model_runner import ModelRunner, RunnerArgs
    from common.tools.smollm2 import ensure_smollm2

    path = args.model_path or ensure_smollm2()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]

    def make(layout: str) -> ModelRunner:
        return ModelRunner(
            RunnerArgs(
                path, max_running_requests=max(batches), max_total_tokens=max(batches) * 128, linear_layout=layout
            )
        )

    if args.busy_start:
        runners = busy_start_runners(make, args.quiet_wait)
    else:
        runners = {layout: make(layout) for layout in args.layouts.split(",")}
    results = {layout: [float("inf")] * len(batches) for layout in runners}
    for r in range(args.rounds):  # interleaved: a noisy host drifts between runs
        for layout, runner in runners.items():
            ms = intra_op.on_own_thread(lambda r=runner: [decode_ms(r, b, args.steps) for b in batches])
            results[layout] = [min(a, b) for a, b in zip(results[layout], ms)]
            print(f"round {r} {layout}: " + ", ".join(f"B={b} {t:.1f} ms" for b, t in zip(batches, ms)), flush=True)
    print(f"\n{host.describe()}, {args.threads} threads, ms per decode forward (best of {args.rounds} medians)\n")
    print("| layout | " + " | ".join(f"B={b}" for b in batches) + " |")
    print("| --- |" + " --- |" * len(batches))
    for layout, row in results.items():
        print(f"| {layout} | " + " | ".join(f"{ms:.1f}" for ms in row) + " |")
    if args.busy_start:
        quiet, clean = results["quiet start after"], results["retime (clean)"]
        print("\nquiet start / clean: " + ", ".join(f"B={b} {q / c:.2f}x" for b, q, c in zip(batches, quiet, clean)))
    print(f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
