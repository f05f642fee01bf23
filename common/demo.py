"""One-shot disaggregated generation in one process: prefill engine -> handoff -> decode scheduler.

    python -m common.demo [--model-path DIR] [--prompt TEXT] [--max-new-tokens N] [--disable-overlap-schedule]

Without --model-path it builds a tiny random-weight Llama checkpoint in a temporary folder, so its
answer is gibberish by design: the point is the whole path (tokenizer, chat template, chunked
prefill, KV handoff, prebuilt admission, overlap decode, streaming, detokenize) running on CPU.
The gRPC services replace this in-process wiring.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import torch


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description="one-shot disaggregated generation on CPU")
    parser.add_argument("--model-path", default=None, help="Hugging Face checkpoint folder (default: build a tiny one)")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    args = parser.parse_args(argv)

    from common.model_runner import ModelRunner, RunnerArgs
    from common.sampling import SamplingParams
    from common.tiny_checkpoint import build
    from common.tokenizer import load_tokenizer
    from decode_service.scheduler import DecodeScheduler
    from prefill_service.engine import PrefillEngine
    from prefill_service.inprocess import InProcessPrefill

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="tiny-llama-") as tmp:
        path = args.model_path
        if path is None:
            print("[demo] building a tiny random-weight llama checkpoint ...", flush=True)
            path = build(tmp, "llama")
        print(f"[demo] loading {path} on {args.device} (prefill and decode engines)", flush=True)
        runner_args = RunnerArgs(path, device=args.device, max_total_tokens=4096, max_running_requests=4)
        tokenizer = load_tokenizer(path)
        sched = None
        link = InProcessPrefill(PrefillEngine(ModelRunner(runner_args)),
                                lambda h: sched.deliver_handoff(h), lambda rid, e: sched.fail_handoff(rid, e))
        sched = DecodeScheduler(ModelRunner(runner_args), link, disable_overlap=args.disable_overlap_schedule)
        sched.start()
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                            add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        output, done, finish = [], threading.Event(), []
        first_token_at = []

        def on_output(rid, tokens, reason):
            if tokens and not output:
                first_token_at.append(time.perf_counter())
            output.extend(tokens)
            if reason is not None:
                finish.append(reason)
                done.set()

        print(f"[demo] prompt: {args.prompt!r} ({len(ids)} tokens)", flush=True)
        start = time.perf_counter()
        sched.submit("demo", ids, SamplingParams(max_new_tokens=args.max_new_tokens), on_output)
        if not done.wait(timeout=120):
            raise SystemExit("[demo] no answer within 120 s")
        elapsed = time.perf_counter() - start
        text = tokenizer.decode(output, skip_special_tokens=True)
        print(f"[demo] answer: {text!r}")
        print(f"[demo] {len(output)} tokens ({finish[0]}); first token after {1000 * (first_token_at[0] - start):.1f} ms,"
              f" all in {elapsed:.2f}s; ids={output}")
        time.sleep(0.05)
        sched.check_integrity()
        sched.stop()
        link.close()
        return text


if __name__ == "__main__":
    main()
