"""The ways into the pair, measured as a user would drive them: decode's gRPC front door, decode's own
OpenAI HTTP API, and smg in front of either (its gRPC and its HTTP worker modes), each with
`bench.load_gen` at the given concurrencies (random prompts, fixed output lengths, greedy).

    python -m bench.api_paths [--model-path DIR | --tiny] [--concurrency 1,16] [--num-prompts 32]

One pair for every path (SmolLM2-135M-Instruct by default), so the paths share the model, the pools and
the host; each path's first run warms it. Prints one row per (path, concurrency): output tok/s, median
TTFT and ITL.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile

from bench import load_gen
from common.tools.demo import model_folder, start_pair
from common.tools.procs import free_port, stop, wait_serving
from common.tools.smg import smg_in_front_of


def _run(backend: list[str], tokenizer: str, n: int, concurrency: int, args, out: str, seed: int) -> dict:
    """One load_gen run; `seed` picks its prompts, new for every run (prefill's prefix cache must not
    hold a prompt an earlier path sent)."""
    return load_gen.fixed_run(backend, tokenizer, n, concurrency, args.input_len, args.output_len, seed, out)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.api_paths", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=50)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--paths", default="grpc,http,smg-grpc,smg-http")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="api-paths-") as tmp:
        path = model_folder(args.model_path, args.tiny, tmp)
        http = free_port()
        prefill, decode, prefill_port, decode_port = start_pair(path, [], ["--openai-port", str(http)])
        try:
            for port, proc in ((prefill_port, prefill), (decode_port, decode)):
                wait_serving(f"127.0.0.1:{port}", proc)
            seed = 0
            workers = {"grpc": None, "http": None, "smg-grpc": f"127.0.0.1:{decode_port}",
                       "smg-http": f"http://127.0.0.1:{http}"}  # fmt: skip
            for which in args.paths.split(","):
                gateway = workers[which]
                with (
                    smg_in_front_of(gateway, os.path.join(tmp, f"{which}.log"))
                    if gateway
                    else (contextlib.nullcontext(None)) as base
                ):
                    if which == "grpc":
                        backend = ["--backend", "grpc", "--addr", f"127.0.0.1:{decode_port}"]
                    else:
                        backend = ["--backend", "openai", "--base-url", base or f"http://127.0.0.1:{http}"]
                    seed += 1
                    _run(backend, path, 4, 4, args, os.path.join(tmp, "warm.json"), seed)  # warm the path
                    for c in [int(x) for x in args.concurrency.split(",")]:
                        seed += 1
                        r = _run(backend, path, max(args.num_prompts, c), c, args, os.path.join(tmp, "r.json"), seed)
                        rows.append(dict(path=which, concurrency=c, tok_s=r["output_throughput"],
                                         ttft_ms=r["median_ttft_ms"], itl_ms=r["median_itl_ms"],
                                         failed=r.get("failed", 0)))  # fmt: skip
                        print(f"[api_paths] {rows[-1]}", flush=True)
        finally:
            stop(decode), stop(prefill)
    columns = [("path", "path", ""), ("concurrency", "concurrency", ""), ("output tok/s", "tok_s", ".1f")]
    columns += [("median TTFT ms", "ttft_ms", ".0f"), ("median ITL ms", "itl_ms", ".1f"), ("failed", "failed", "")]
    load_gen.print_rows(rows, columns)
    return rows


if __name__ == "__main__":
    main()
