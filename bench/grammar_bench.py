"""Decode ms per step with every request constrained by a JSON schema vs none, at one batch size
(issue 43's bound: batch 16, every request constrained, at most 15% more per step than
unconstrained), on SmolLM2-135M-Instruct (49k vocabulary) or a given checkpoint, in process (the
decode scheduler with overlap, prefill in-process and untimed). The arms alternate; each is timed
from the first decode step until idle, divided by the decode steps it ran. The schema never ends
within --steps tokens (an array of at least 64 strings), so every request runs all its steps and
the batch stays full; a request that ends early is reported.

    python -m bench.grammar_bench [--batch 16] [--steps 48] [--repeats 3] [--model-path DIR]
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import torch

from bench.batch_pair import args_and_runners
from common.engine.sampling import SamplingParams
from common.host import describe
from decode_service.scheduler import DecodeScheduler
from decode_service.worker import DecodeWorker

SCHEMA = {  # no end within the bench's steps: at least 64 strings of at least 2 characters
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string", "minLength": 2}, "minItems": 64}},
    "required": ["notes"],
}


def measure(prefill, decode, batch: int, params: SamplingParams, prompt_len: int = 16) -> tuple[float, int]:
    """(ms per decode step, requests that ended before max_new_tokens) of `batch` requests."""
    pending, counts, early = [], {}, []

    def on_output(out):
        counts[out.rid] = counts.get(out.rid, 0) + len(out.new_token_ids)
        if out.finish is not None and counts[out.rid] < params.max_new_tokens:
            early.append(out.rid)

    worker = DecodeWorker(decode)
    sched = DecodeScheduler(worker, pending.append, overlap=True)
    for i in range(batch):
        prompt = [(7 * i + j) % 300 + 5 for j in range(prompt_len)]
        sched.submit(str(i), prompt, params, on_output=on_output)
    sched.step()  # admission
    for h in prefill.prefill(pending):
        sched.inbox.deliver_handoff(h)
    sched.step()  # prebuilt batch + first decode launch
    start, first = time.perf_counter(), sched.step_count
    while not sched.idle:
        sched.step()
    elapsed = time.perf_counter() - start
    steps = sched.step_count - first
    assert (worker.grammar is not None) == (params.constraint is not None), "the arm did not run as labelled"
    sched.stop()
    if worker.grammar is not None:
        worker.grammar.close()
    return 1e3 * elapsed / max(steps, 1), len(early)


def main() -> None:
    args, prefill, decode = args_and_runners(__doc__)
    arms = {
        "none": SamplingParams(max_new_tokens=args.steps, ignore_eos=True),
        "json_schema": SamplingParams(max_new_tokens=args.steps, ignore_eos=True, json_schema=json.dumps(SCHEMA)),
    }
    for params in arms.values():  # warm-up (and the schema's compile)
        measure(prefill, decode, args.batch, dataclasses.replace(params, max_new_tokens=4))
    per_step = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, params in arms.items():
            ms, early = measure(prefill, decode, args.batch, params)
            per_step[name].append(ms)
            if early:
                print(f"warning: {name}: {early} requests ended before {args.steps} tokens")
    print(f"host: {describe()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    base = statistics.median(per_step["none"])
    for name, r in per_step.items():
        med = statistics.median(r)
        runs = ", ".join(f"{x:.1f}" for x in r)
        print(f"batch {args.batch}, {name:12s}: {med:7.2f} ms/step (runs {runs}) {med / base:.3f}x")


if __name__ == "__main__":
    main()
