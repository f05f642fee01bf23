"""Decode steps/s with the overlap scheduler on vs off, on a tiny model (CPU by default).

    python -m bench.overlap_bench [--batch-sizes 1,8,32] [--steps 64] [--device cpu] [--model-path DIR]

All requests are prefilled and handed over first; the timed part is the decode loop alone
(steps launched / wall time from the first decode step until the scheduler is idle).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams
from common.tools.tiny_checkpoint import build
from decode_service.scheduler import DecodeScheduler
from decode_service.worker import DecodeWorker
from prefill_service.worker import PrefillWorker


def measure(path: str, device: str, batch: int, steps: int, overlap: bool, prompt_len: int = 16) -> float:
    args = dict(device=device, max_running_requests=batch, max_total_tokens=batch * (prompt_len + steps + 1))
    prefill = PrefillWorker(ModelRunner(RunnerArgs(path, **args)), chunk_size=4096)
    pending = []
    sched = DecodeScheduler(DecodeWorker(ModelRunner(RunnerArgs(path, **args))), pending.append, overlap=overlap)
    params = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        sched.submit(str(i), [(7 * i + j) % 300 + 5 for j in range(prompt_len)], params)
    sched.step()  # admission
    for h in prefill.prefill(pending):
        sched.inbox.deliver_handoff(h)
    sched.step()  # prebuilt batch + first decode launch
    first = sched.step_count
    start = time.perf_counter()
    while not sched.idle:
        sched.step()
    sched.worker.synchronize()
    elapsed = time.perf_counter() - start
    sched.check_integrity()
    sched.stop()
    return (sched.step_count - first) / elapsed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path or build(tmp, "llama")
        measure(path, args.device, 1, 8, True)  # warm-up
        print("| batch | overlap off (steps/s) | overlap on (steps/s) | speed-up |")
        print("| --- | --- | --- | --- |")
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            off = max(measure(path, args.device, batch, args.steps, False) for _ in range(args.repeats))
            on = max(measure(path, args.device, batch, args.steps, True) for _ in range(args.repeats))
            print(f"| {batch} | {off:.1f} | {on:.1f} | {on / off:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
