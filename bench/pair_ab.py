"""Two builds of the pair against each other on a noisy host: both up at once, runs alternated.

    python -m bench.pair_ab --a ../old-checkout [--b .] [--batch 64] [--rounds 6] [--new-tokens 64]

A and B are two checkouts of this repo (e.g. `git worktree add ../old-checkout <commit>`), or one
checkout twice with different flags (`--a . --b-decode-flags="--enable-torch-compile"`, or for both
services `--a . --b-flags="--disaggregation-transfer-backend shm"`) or environment
(`--b-decode-env="GOMP_SPINCOUNT=10000"`).
Each runs its own prefill and decode services (bench/serving_bench.py: `start_pair`), and the
rounds alternate A, B then B, A, so a drift of the machine (single runs here differ by 10-20%)
hits both alike. Both run A's fp32 layout table, where they time one: each side times its own in
a folder of its own (a build's kernels are part of the table's key), then B is restarted on A's
plans where they differ (`--own-tables`: each keeps its own). Two timings of one host differ by its
noise: two builds of one kernel, each on its own table, ran 16 requests at 374.9 against 361.0
tok/s; the same two on A's, 354.3 against 394.9 (2-core AMD Zen 4). Other start-up picks (the gemv's
streams, warm-up's decode plan) are still each side's own: `--logs` keeps the services' logs. Run
an A/A (`--a .`) to see what a start alone moves: two starts of one build at 1 request gave 65.2
against 55.3 tok/s (B faster in 0 of 6 rounds), then 57.6 against 61.9 (3 of 4). `--restarts` starts both
sides afresh before every round, so each round compares two other starts (six starts of one build still
spread over 5% of a batch-1 step after warm-up timed the one-row plan as whole steps).
Per run: decode tok/s (as serving_bench), the mean wait between a request's first token (streamed
by prefill) and its second (the first decode step after its KV landed), and the mean inter-token
latency after that. Prints each run, the medians and in how many rounds B was faster.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import shlex
import statistics
import tempfile

from bench import serving_bench
from common.models.host_table import ENV_DIR as TABLE_DIR
from common.tools.procs import stop


def run(address: str, prompt: list[int], batch: int, new_tokens: int) -> tuple[float, float, float]:
    """(decode tok/s, mean first-to-second-token gap s, mean later ITL ms) of one batch."""
    submitted, arrivals = serving_bench.pair_arrivals(address, prompt, batch, new_tokens)
    out = serving_bench.summarize(submitted, arrivals)
    gap = statistics.mean(a[1] - a[0] for a in arrivals)
    later = statistics.mean((a[-1] - a[1]) / (len(a) - 2) for a in arrivals)
    return out["tok_s"], gap, 1e3 * later


def table_file(folder: str) -> str | None:
    """The layout table a side's services timed into its own table folder; None where they timed none (a
    low-precision or forced layout)."""
    files = glob.glob(os.path.join(folder, "*.json"))
    if len(files) > 1:
        raise RuntimeError(f"expected at most one layout table in {folder}, found {files}")
    return files[0] if files else None


def take_plans(source: str, target: str) -> bool:
    """Write `source`'s timed plans (and their timings, which the start-up check reads) into the table
    `target`, keeping target's key; whether they differed."""
    with open(source) as f:
        a = json.load(f)
    with open(target) as f:
        b = json.load(f)
    fields = ("plans", "ms", "chosen_ms", "greedy_ms")
    if all(a.get(k) == b.get(k) for k in fields):
        return False
    b.update({k: a[k] for k in fields if k in a})
    with open(target, "w") as f:
        json.dump(b, f, indent=1)
    return True


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
    parser.add_argument("--own-tables", action="store_true", help="each side on its own layout table (default: A's)")
    parser.add_argument(
        "--logs", help="a folder for the services' logs (A-0-decode.log, ...: side, start; default: dropped)"
    )
    parser.add_argument(
        "--restarts", action="store_true", help="start both sides afresh before every round (a start's own spread)"
    )
    args = parser.parse_args(argv)
    if args.new_tokens < 3:
        parser.error("--new-tokens must be at least 3 (a gap and a later ITL)")
    path, prompt = serving_bench.chat_prompt(None)
    tokens = args.batch * (len(prompt) + args.new_tokens) + 64
    pairs, results = [], {"A": [], "B": []}
    sides = [
        (args.a, args.a_decode_flags, args.a_flags, args.a_decode_env),
        (args.b, args.b_decode_flags, args.b_flags, args.b_decode_env),
    ]
    folders = [tempfile.TemporaryDirectory(prefix=f"pair-ab-{name}-tables-") for name in "AB"]

    starts = itertools.count()  # each start's number: its logs are named by it (A-0-decode.log, B-1-decode.log, ...)

    def start(i: int) -> tuple:
        n = next(starts)
        tree, flags, both, env = sides[i]
        both = tuple(shlex.split(both))
        env = dict(item.split("=", 1) for item in shlex.split(env))
        return serving_bench.start_pair(
            path,
            args.threads,
            args.batch,
            tokens,
            decode_flags=both + tuple(shlex.split(flags)),
            prefill_flags=both,
            tree=os.path.abspath(tree),
            decode_env=env,
            env={} if args.own_tables else {TABLE_DIR: folders[i].name},
            log_to=None if args.logs is None else os.path.join(args.logs, f"{'AB'[i]}-{n}-"),
        )

    def start_both() -> None:
        for i in range(2):
            pairs.append(start(i))
        tables = [table_file(folder.name) for folder in folders]
        if not args.own_tables and None not in tables and take_plans(*tables):
            print("B timed other layouts than A: B restarted on A's", flush=True)
            for p in pairs.pop()[1]:
                stop(p)
            pairs.append(start(1))
        for address, _ in pairs:
            serving_bench.bench_pair(address, prompt, args.batch, 4)  # warm-up

    def stop_both() -> None:
        while pairs:
            for p in pairs.pop()[1]:
                stop(p)

    try:
        start_both()
        for r in range(args.rounds):
            if r and args.restarts:
                stop_both()
                start_both()
            for name in "AB" if r % 2 == 0 else "BA":
                tok_s, gap, later = run(pairs["AB".index(name)][0], prompt, args.batch, args.new_tokens)
                results[name].append((tok_s, gap, later))
                print(f"round {r} {name}: {tok_s:.1f} tok/s, gap {gap:.3f} s, later ITL {later:.1f} ms", flush=True)
    finally:
        stop_both()
        for folder in folders:
            folder.cleanup()
    for name, rows in results.items():
        tok_s, gap, later = (statistics.median(c) for c in zip(*rows))
        tree, flags = (
            (args.a, f"{args.a_flags} {args.a_decode_flags} {args.a_decode_env}")
            if name == "A"
            else (args.b, f"{args.b_flags} {args.b_decode_flags} {args.b_decode_env}")
        )
        print(f"{name} ({tree} {flags.strip()}): median {tok_s:.1f} tok/s, gap {gap:.3f} s, later ITL {later:.1f} ms")
    wins = sum(b[0] > a[0] for a, b in zip(results["A"], results["B"]))
    print(f"B faster in {wins} of {len(results['B'])} rounds")


if __name__ == "__main__":
    main()
