"""The CUDA path checked in one command on a GPU machine: the GPU tests, then the GPU bench, then a summary.

    python -m bench.gpu_check [--out-dir DIR] [gpu_bench flags, e.g. --shapes llama-3.2-1b]

Runs `pytest tests/gpu -m gpu` (every CUDA test; they skip without CUDA), then `bench.gpu_bench`
with the remaining flags, and prints the tests' outcome and the bench table. Exit status 1 if a test
failed, or, on CUDA, if no test passed (all skipped: CUDA not seen). `--device cpu --shapes tiny`
exercises the whole command on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tests_ok(returncode: int, tail: str, on_gpu: bool) -> bool:
    """pytest's outcome: on a GPU at least one test must have passed (all skipped means CUDA was not
    seen, or nothing was collected: not a pass); on CPU every GPU test skips, which is expected."""
    if not on_gpu:
        return returncode in (0, 5)
    passed = re.search(r"(\d+) passed", tail)
    return returncode == 0 and passed is not None and int(passed.group(1)) > 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=".")
    args, bench_flags = p.parse_known_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    print("== GPU tests: pytest tests/gpu -m gpu", flush=True)
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-rA", "-s", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    with open(os.path.join(args.out_dir, "gpu_tests.log"), "w") as f:
        f.write(tests.stdout + tests.stderr)
    tail = (tests.stdout.strip().splitlines() or ["(no output)"])[-1]
    flips = [line for line in tests.stdout.splitlines() if line.startswith("bf16 on")]
    print("\n".join(flips + [tail]), flush=True)
    print("== GPU bench: python -m bench.gpu_bench " + " ".join(bench_flags), flush=True)
    from bench import gpu_bench

    rows = gpu_bench.main(bench_flags + ["--out-json", os.path.join(args.out_dir, "gpu_bench.json")])
    on_gpu = "--device" not in bench_flags or bench_flags[bench_flags.index("--device") + 1] == "cuda"
    summary = {"tests": tail, "tests_ok": tests_ok(tests.returncode, tail, on_gpu), "bf16": flips, "bench": rows}
    with open(os.path.join(args.out_dir, "gpu_check.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(
        f"== summary: tests {'OK' if summary['tests_ok'] else 'FAILED'} ({tail}); {len(rows)} bench rows; "
        f"logs in {args.out_dir}",
        flush=True,
    )
    return 0 if summary["tests_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
