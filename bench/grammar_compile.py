"""Grammar compile time and compiled bytes per constraint on a model's vocabulary (SmolLM2-135M's 49k
by default), and whether common/engine/grammar_limits.py lets each through: what the bounds catch,
and what only the compile deadline and the bound on compiles at once (grammar.py) can.

    python -m bench.grammar_compile [--model-path DIR] [--skip-over-seconds 30]

Each constraint is compiled once, with xgrammar's cache off, limits or not (a refused one is timed
too, to show what it would have cost); one whose compile passes --skip-over-seconds is not waited for
beyond that (the row says so).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

from common.engine import grammar_limits
from common.engine.grammar import tokenizer_info
from common.engine.grammar_worker import compile_with
from common.host import describe


def nested(depth: int) -> str:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return json.dumps(schema)


CASES = [
    ("json_schema", nested(7), "schema nested 7 deep"),
    ("json_schema", nested(15), "schema nested 15 deep"),
    ("json_schema", nested(40), "schema nested 40 deep"),
    ("json_schema", json.dumps({"type": "string", "maxLength": 64}), "string, maxLength 64"),
    ("json_schema", json.dumps({"type": "string", "maxLength": 1000}), "string, maxLength 1000"),
    ("regex", "[a-z]{1,1000}", "[a-z]{1,1000}"),
    ("regex", ".{0,256}", ".{0,256}"),
    ("regex", "(.{1,30}x){30}", "nested counts, product 900"),
    ("regex", "((.{1,10}y){10}z){10}", "nested counts, product 1000"),
]


def timed(compiler, field: str, text: str, limit_s: float) -> tuple[float | None, int]:
    """(seconds, compiled bytes), or (None, 0) past limit_s (the compile goes on in a daemon thread:
    this tool times compiles in its own process, outside the services' worker pool)."""
    out: dict = {}

    def run():
        start = time.perf_counter()
        out["grammar"] = compile_with(compiler, field, text, True)
        out["s"] = time.perf_counter() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    if "s" not in out:
        return None, 0
    return out["s"], int(out["grammar"].memory_size_bytes)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=os.path.expanduser("~/.cache/disagg-serve/SmolLM2-135M-Instruct"))
    p.add_argument("--skip-over-seconds", type=float, default=30.0)
    args = p.parse_args(argv)
    with open(os.path.join(args.model_path, "config.json")) as f:
        cfg = json.load(f)
    eos = cfg.get("eos_token_id", 2)
    import xgrammar as xgr

    info = tokenizer_info(args.model_path, cfg["vocab_size"], eos if isinstance(eos, list) else [eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # in this process: timed alone
    print(f"# {describe()}, vocabulary {cfg['vocab_size']}")
    print("| constraint | limits | compile s | compiled MB |\n| --- | --- | --- | --- |")
    for field, text, name in CASES:
        try:
            grammar_limits.check(field, text)
            verdict = "pass"
        except grammar_limits.LimitError as e:
            verdict = f"refused ({e})"
        seconds, size = timed(compiler, field, text, args.skip_over_seconds)
        shown = f"> {args.skip_over_seconds:g}" if seconds is None else f"{seconds:.2f}"
        print(f"| {name} | {verdict} | {shown} | {size / 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
