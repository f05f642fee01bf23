"""Decode tokens/s with and without output logprobs (top-5) at one batch size (issue 42's bound:
batch 16 with top-5 logprobs within 10% of none), on SmolLM2-135M-Instruct (49k vocabulary) or a
given checkpoint; the two arms alternate, each timed from the first decode step until idle.

    python -m bench.logprobs_bench [--batch 16] [--steps 48] [--repeats 3] [--model-path DIR]
"""

from __future__ import annotations

import statistics
import time

from bench.batch_pair import args_and_runners
from common.engine.sampling import SamplingParams
from decode_service.scheduler import DecodeScheduler
from decode_service.worker import DecodeWorker


def measure(prefill, decode, batch: int, steps: int, params: SamplingParams, prompt_len: int = 16) -> float:
    """Decode tokens/s of `batch` requests of `steps` tokens each (prefill and handoff untimed)."""
    pending, seen = [], []
    sched = DecodeScheduler(DecodeWorker(decode), pending.append, overlap=True)
    for i in range(batch):
        prompt = [(7 * i + j) % 300 + 5 for j in range(prompt_len)]
        sched.submit(str(i), prompt, params, on_output=lambda out: seen.append(len(out.new_token_ids)))
    sched.step()  # admission
    for h in prefill.prefill(pending):
        sched.inbox.deliver_handoff(h)
    sched.step()  # prebuilt batch + first decode launch
    start, done = time.perf_counter(), sum(seen)
    while not sched.idle:
        sched.step()
    elapsed = time.perf_counter() - start
    sched.stop()
    return (sum(seen) - done) / elapsed


def main() -> None:
    args, prefill, decode = args_and_runners(__doc__)
    arms = {
        "none": SamplingParams(max_new_tokens=args.steps, ignore_eos=True),
        "top-5 logprobs": SamplingParams(
            max_new_tokens=args.steps, ignore_eos=True, return_logprob=True, top_logprobs_num=5
        ),
    }
    rates = {name: [] for name in arms}
    measure(prefill, decode, args.batch, 4, arms["none"])  # warm-up
    for _ in range(args.repeats):
        for name, params in arms.items():
            rates[name].append(measure(prefill, decode, args.batch, args.steps, params))
    base = statistics.median(rates["none"])
    for name, r in rates.items():
        med = statistics.median(r)
        runs = ", ".join(f"{x:.0f}" for x in r)
        print(f"batch {args.batch}, {name:15s}: {med:8.1f} tok/s (runs {runs}) {med / base:.3f}x")


if __name__ == "__main__":
    main()
