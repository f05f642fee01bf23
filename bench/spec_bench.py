"""EAGLE vs plain decode on a real model, in one run: decode tokens/s at batch 1 and 16, accept length.

    python -m bench.spec_bench --head DIR [--algorithm EAGLE] [--batch-sizes 1,16] [--num-steps 3] [--topk 4
        --num-draft-tokens 8]
        [--new-tokens 64] [--repeats 3] [--model-path DIR] [--threads 2]

Our decode scheduler with in-process prefill (bench.serving_bench.bench_inprocess), greedy (or
seeded sampling at --temperature, speculative sampling with EAGLE), EOS ignored, the same prompts as bench.serving_bench (the chat prompt) for every request. Each
configuration runs --repeats times, interleaved; the best run is reported. Mean accept length =
committed tokens per verify step = 1 + accepted drafts / steps.
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.serving_bench import bench_inprocess, chat_prompt
from common.engine.draft_runner import SpecArgs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", required=True, help="draft head folder (python -m common.tools.fit_eagle)")
    p.add_argument("--algorithm", default="EAGLE", choices=["EAGLE", "EAGLE3"])
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--topk", type=int, default=1, help="--speculative-eagle-topk (> 1: tree drafting)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="tree nodes verified (default num_steps + 1)")
    p.add_argument("--token-map", default=None, help="--speculative-token-map (hot token ids to draft from)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model-path", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: speculative sampling (seeded)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.model_path, prompt = chat_prompt(args.model_path)
    spec = SpecArgs(args.algorithm, args.head, args.num_steps, args.topk, args.num_draft_tokens or args.num_steps + 1,
                    args.token_map)
    print(f"# {os.path.basename(args.model_path)}, head {args.head}, {args.algorithm} num_steps {args.num_steps}, "
          f"topk {spec.eagle_topk}, draft tokens {spec.num_draft_tokens}, "
          f"token map {args.token_map}, temperature {args.temperature}, "
          f"prompt {len(prompt)} tokens, {args.new_tokens} new tokens, {args.threads} threads", flush=True)
    print("| B | plain tok/s | EAGLE tok/s | speed-up | mean accept length |\n| --- | --- | --- | --- | --- |")
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        best = {"plain": 0.0, "spec": 0.0}
        length = 0.0
        for _ in range(args.repeats):
            best["plain"] = max(best["plain"], bench_inprocess(args.model_path, prompt, b, args.new_tokens,
                                                                   temperature=args.temperature)["tok_s"])
            stats: list = []
            r = bench_inprocess(args.model_path, prompt, b, args.new_tokens, spec=spec, stats=stats,
                                temperature=args.temperature)
            best["spec"] = max(best["spec"], r["tok_s"])
            length = 1 + stats[0] / (stats[1] / args.num_steps) if stats[1] else 1.0
        print(f"| {b} | {best['plain']:.1f} | {best['spec']:.1f} | {best['spec'] / best['plain']:.2f}x | {length:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
