"""EAGLE vs plain decode on a real model, in one run: decode tokens/s at batch 1 and 16, accept length.

    python -m bench.spec_bench --head DIR [--algorithm EAGLE] [--batch-sizes 1,16] [--num-steps 3] [--topk 4
        --num-draft-tokens 8] [--token-map FILE] [--prompts held-out|chat] [--num-prompts 16]
        [--new-tokens 64] [--repeats 3] [--model-path DIR] [--threads 2] [--temperature T]

Our decode scheduler with in-process prefill (bench.serving_bench.bench_inprocess), greedy (or
seeded sampling at --temperature, speculative sampling with EAGLE).
Prompts: `held-out` (default) are the fitting tool's held-out instructions (bench.fit_eagle
evaluates on the same ones: generated, never trained on), answered until EOS or --new-tokens;
`chat` is the serving bench's one chat prompt for every request, EOS ignored (past its answer the
model rambles and a head fitted on answers drafts poorly). At batch B the prompts run B at a time;
decode tok/s = all decoded tokens / all decode time (first to last token of each request, summed
over rounds, per concurrent batch). Plain and EAGLE runs produce the same tokens when greedy.
Each configuration runs --repeats times, interleaved; the best run is reported. Mean accept length
= committed tokens per verify step = 1 + accepted drafts / steps.
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.serving_bench import bench_inprocess, chat_prompt
from common.engine.draft_runner import SpecArgs


def held_out_prompts(model_path: str, n: int, seed: int = 0) -> list[list[int]]:
    from bench.fit_eagle import HELD_OUT_SEED
    from common.tools import eagle_data
    from common.tools.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)
    return [eagle_data.chat_ids(tok, t) for t in eagle_data.instructions(n, seed + HELD_OUT_SEED, evaluation=True)]


def run(
    path: str,
    prompts: list[list[int]],
    batch: int,
    new_tokens: int,
    spec: SpecArgs,
    temperature: float,
    ignore_eos: bool,
    runner_kw: dict | None = None,
) -> tuple[float, float]:
    """(decode tok/s, mean accept length) over every prompt, `batch` at a time, on runners loaded once."""
    from common.engine.model_runner import ModelRunner, RunnerArgs

    size = dict(
        max_running_requests=batch,
        spec=spec,
        max_total_tokens=batch * (max(map(len, prompts)) + new_tokens + spec.extra_slots) + 64,
        **(runner_kw or {}),
    )
    decode = ModelRunner(RunnerArgs(path, **size))
    decode.warmup()  # CUDA graphs are captured here, not inside the timed decode
    runners = decode, ModelRunner(RunnerArgs(path, **{**size, "cuda_graph": False}))
    tokens = seconds = accepted = proposed = 0
    for i in range(0, len(prompts), batch):
        stats: list = []
        r = bench_inprocess(
            path,
            prompts[i : i + batch],
            batch,
            new_tokens,
            spec=spec,
            stats=stats,
            temperature=temperature,
            runners=runners,
            ignore_eos=ignore_eos,
        )
        tokens, seconds = tokens + r["decode_tokens"], seconds + r["decode_s"] / batch
        accepted, proposed = accepted + stats[0], proposed + stats[1]
    length = 1 + accepted / (proposed / spec.num_steps) if proposed else 1.0
    return tokens / seconds, length


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", required=True, help="draft head folder (python -m bench.fit_eagle)")
    p.add_argument("--algorithm", default="EAGLE", choices=["EAGLE", "EAGLE3"])
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--topk", type=int, default=1, help="--speculative-eagle-topk (> 1: tree drafting)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="tree nodes verified (default num_steps + 1)")
    p.add_argument("--token-map", default=None, help="--speculative-token-map (hot token ids to draft from)")
    p.add_argument("--prompts", default="held-out", choices=["held-out", "chat"])
    p.add_argument("--num-prompts", type=int, default=16, help="held-out prompts (run batch-size at a time)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model-path", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: speculative sampling (seeded)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="batched", help="batched | torch | triton")
    p.add_argument("--cuda-graph", action="store_true", help="decode, draft and verify replay CUDA graphs (triton)")
    args = p.parse_args(argv)
    runner_kw = dict(
        device=args.device, dtype=args.dtype, attention_backend=args.attention_backend, cuda_graph=args.cuda_graph
    )
    torch.set_num_threads(args.threads)
    args.model_path, chat = chat_prompt(args.model_path)
    spec = SpecArgs(
        args.algorithm,
        args.head,
        args.num_steps,
        args.topk,
        args.num_draft_tokens or args.num_steps + 1,
        args.token_map,
    )
    held_out = args.prompts == "held-out"
    prompts = held_out_prompts(args.model_path, args.num_prompts) if held_out else [chat]
    print(
        f"# {os.path.basename(args.model_path)}, head {args.head}, {args.algorithm} num_steps {args.num_steps}, "
        f"topk {spec.eagle_topk}, draft tokens {spec.num_draft_tokens}, token map {args.token_map}, "
        f"temperature {args.temperature}, prompts {args.prompts} ({len(prompts)}), up to {args.new_tokens} new "
        f"tokens{'' if held_out else ' (EOS ignored)'}, {args.threads} threads, {args.device} {args.dtype}, "
        f"attention {args.attention_backend}, CUDA graphs {'on' if args.cuda_graph else 'off'}",
        flush=True,
    )
    print("| B | plain tok/s | EAGLE tok/s | speed-up | mean accept length |\n| --- | --- | --- | --- | --- |")
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        batch_prompts = prompts if held_out else prompts * b
        best, length = {"plain": 0.0, "spec": 0.0}, 0.0
        for _ in range(args.repeats):
            best["plain"] = max(
                best["plain"],
                run(
                    args.model_path,
                    batch_prompts,
                    b,
                    args.new_tokens,
                    SpecArgs(),
                    args.temperature,
                    not held_out,
                    runner_kw,
                )[0],
            )
            rate, length = run(
                args.model_path, batch_prompts, b, args.new_tokens, spec, args.temperature, not held_out, runner_kw
            )
            best["spec"] = max(best["spec"], rate)
        ratio = best["spec"] / best["plain"]
        print(f"| {b} | {best['plain']:.1f} | {best['spec']:.1f} | {ratio:.2f}x | {length:.2f} |", flush=True)


if __name__ == "__main__":
    main()
