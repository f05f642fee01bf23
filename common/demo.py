"""One-shot generation demo: build (or load) a checkpoint, generate for a chat prompt, print it.

    python -m common.demo [--model-path DIR] [--prompt TEXT] [--max-new-tokens N]

Without --model-path it builds a tiny random-weight Llama checkpoint in a temporary folder, so its
answer is gibberish by design: the point is the whole path (tokenizer, chat template, chunked
prefill, paged KV, decode, detokenize) running end to end on CPU.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description="one-shot generation on CPU")
    parser.add_argument("--model-path", default=None, help="Hugging Face checkpoint folder (default: build a tiny one)")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    from common.colocated import ColocatedEngine
    from common.model_runner import ModelRunner, RunnerArgs
    from common.sampling import SamplingParams
    from common.tiny_checkpoint import build
    from common.tokenizer import load_tokenizer

    torch.set_num_threads(min(2, torch.get_num_threads()))
    with tempfile.TemporaryDirectory(prefix="tiny-llama-") as tmp:
        path = args.model_path
        if path is None:
            print("[demo] building a tiny random-weight llama checkpoint ...", flush=True)
            path = build(tmp, "llama")
        print(f"[demo] loading {path} on {args.device}", flush=True)
        runner = ModelRunner(RunnerArgs(path, device=args.device, max_total_tokens=4096, max_running_requests=4))
        tokenizer = load_tokenizer(path)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                            add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        start = time.perf_counter()
        [req] = ColocatedEngine(runner).generate([ids], SamplingParams(max_new_tokens=args.max_new_tokens))
        elapsed = time.perf_counter() - start
        text = tokenizer.decode(req.output, skip_special_tokens=True)
        print(f"[demo] prompt: {args.prompt!r} ({len(ids)} tokens)")
        print(f"[demo] answer: {text!r}")
        print(f"[demo] {len(req.output)} tokens ({req.finish_reason}) in {elapsed:.2f}s; ids={req.output}")
        runner.kv_allocator.check_integrity()
        return text


if __name__ == "__main__":
    main()
