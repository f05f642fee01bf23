"""The in-process set-up the batch-16 sampling benches share (bench/logprobs_bench.py,
bench/grammar_bench.py): their flags, and a prefill worker and a decode runner sized for one batch."""

from __future__ import annotations

import argparse

from common.engine.model_runner import ModelRunner, RunnerArgs
from prefill_service.worker import PrefillWorker


def args_and_runners(description: str | None = None):
    """(args, PrefillWorker, decode ModelRunner) from --batch, --steps, --repeats, --model-path
    (SmolLM2-135M, converted once, when not given)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-path", default=None)
    args = ap.parse_args()
    if args.model_path is None:
        from common.tools.smollm2 import ensure_smollm2

        args.model_path = ensure_smollm2()
    sizes = dict(max_running_requests=args.batch, max_total_tokens=args.batch * (16 + args.steps + 2))
    prefill = PrefillWorker(ModelRunner(RunnerArgs(args.model_path, **sizes)), chunk_size=4096)
    return args, prefill, ModelRunner(RunnerArgs(args.model_path, **sizes))
