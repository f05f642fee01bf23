"""Two builds of the pair against each other on a noisy host: both up at once, runs alternated.

    python -m bench.pair_ab --a ../old-checkout [--b .] [--batch 64] [--rounds 6] [--new-tokens 64]

A and B are two checkouts of this repo (e.g. `git worktree add ../old-checkout <commit>`), or one
checkout twice with different flags (`--a . --b-decode-flags="--enable-torch-compile"`, or for both
services `--a . --b-flags="--disaggregation-transfer-backend shm"`) or environment
(`--b-decode-env="GOMP_SPINCOUNT=10000"`).
Each runs its own prefill and decode services (bench/serving_bench.py: `start_pair`), and the
rounds alternate A, B then B, A, so a drift of the machine (single runs here differ by 10-20%)
hits both alike. Per run: decode tok/s (as serving_bench), the mean wait between a request's
first token (streamed by prefill) and its second (the first decode step after its KV landed), and
the mean inter-token latency after that. Prints each run and the medians.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics

from bench import serving_bench


def run(address: str, prompt: list[int], batch: int, new_tokens: int) -> tuple[float, float, float]:
    """(decode tok/s, mean first-to-second-token gap s, mean later ITL ms) of one batch."""
    submitted, arrivals = serving_bench.pair_arrivals(address, prompt, batch, new_tokens)
    out = serving_bench.summarize(submitted, arrivals)
    gap = statistics.mean(a[1] - a[0] for a in arrivals)
    later = statistics.mean((a[-1] - a[1]) / (len(a) - 2) for a in arrivals)
    return out["tok_s"], gap, 1e3 * later


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="checkout A (the baseline)")
    parser.add_argument("--b", default=".", help="checkout B (default: this one)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--a-decode-flags", default="", help="extra flags of A's decode service")
    parser.add_argument("--b-decode-flags", default="", help="extra flags of B's decode service")
    parser.add_argument("--a-flags", default="", help="extra flags of both of A's services")
    parser.add_argument("--b-flags", default="", help="extra flags of both of B's services")
    parser.add_argument("--a-decode-env", default="", help="extra environment of A's decode service: NAME=VALUE ...")
    parser.add_argument("--b-decode-env", default="", help="extra environment of B's decode service: NAME=VALUE ...")
    args = parser.parse_args(argv)
    if args.new_tokens < 3:
        parser.error("--new-tokens must be at least 3 (a gap and a later ITL)")
    path, prompt = serving_bench.chat_prompt(None)
    tokens = args.batch * (len(prompt) + args.new_tokens) + 64
    pairs, results = [], {"A": [], "B": []}
    try:
        for tree, flags, both, env in (
            (args.a, args.a_decode_flags, args.a_flags, args.a_decode_env),
            (args.b, args.b_decode_flags, args.b_flags, args.b_decode_env),
        ):
            both = tuple(shlex.split(both))
            env = dict(item.split("=", 1) for item in shlex.split(env))
            pairs.append(
                serving_bench.start_pair(
                    path,
                    args.threads,
                    args.batch,
                    tokens,
                    decode_flags=both + tuple(shlex.split(flags)),
                    prefill_flags=both,
                    tree=os.path.abspath(tree),
                    decode_env=env,
                )
            )
        for address, _ in pairs:
            serving_bench.bench_pair(address, prompt, args.batch, 4)  # warm-up
        for r in range(args.rounds):
            for name in "AB" if r % 2 == 0 else "BA":
                tok_s, gap, later = run(pairs["AB".index(name)][0], prompt, args.batch, args.new_tokens)
                results[name].append((tok_s, gap, later))
                print(f"round {r} {name}: {tok_s:.1f} tok/s, gap {gap:.3f} s, later ITL {later:.1f} ms", flush=True)
    finally:
        from common.tools.procs import stop

        for _, procs in pairs:
            for p in procs:
                stop(p)
    for name, rows in results.items():
        tok_s, gap, later = (statistics.median(c) for c in zip(*rows))
        tree, flags = (
            (args.a, f"{args.a_flags} {args.a_decode_flags} {args.a_decode_env}")
            if name == "A"
            else (args.b, f"{args.b_flags} {args.b_decode_flags} {args.b_decode_env}")
        )
        print(f"{name} ({tree} {flags.strip()}): median {tok_s:.1f} tok/s, gap {gap:.3f} s, later ITL {later:.1f} ms")


if __name__ == "__main__":
    main()
