"""Decode capacity with chat traffic that declares a large max_tokens (issue 55): the full reservation
against KV on demand, at one fixed decode pool.

    python -m bench.capacity_bench [--model-path DIR | --tiny] [--requests 24] [--max-total-tokens 2048]

For each `--decode-kv-reservation` (full, on-demand) and each declared max_new_tokens (96, 1024), the
pair starts as users start it (decode `--max-total-tokens`, `--max-running-requests 32`), then
`--requests` short chat questions are sent at once, greedy, ending at their natural EOS (SmolLM2's
answers take 4-77 tokens). Reported per run: wall time, output tokens/s, median and p90 TTFT, the most
requests decoding at once (GetLoads, polled every 20 ms), and the retractions and re-prefilled tokens
from decode's metrics. A `--max-total-tokens` smaller than the answers need, with a small `--grow`, forces retraction.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
import urllib.request

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.host import describe
from common.tools.client import Client
from common.tools.demo import model_folder, start_pair
from common.tools.procs import free_port, stop, wait_serving

QUESTIONS = [  # SmolLM2 answers each in 4-77 tokens, greedy (none reaches 96)
    "What is the capital of France?", "Name three primary colors.", "What is 12 times 7?", "What is 2 plus 2?",
    "What is the boiling point of water in Celsius?", "Name a large ocean.", "What gas do plants take in?",
    "How many days are in a week?", "Name a color.", "Translate 'hello' into Spanish.", "Say hi.",
    "Name a fruit that is yellow.", "What is the capital of Italy?", "What is the capital of Japan?",
    "What is H2O?", "Who painted the Mona Lisa?", "Name a planet.", "Name a mammal that can fly.",
    "What is the freezing point of water in Fahrenheit?", "What is the capital of Spain?",
    "How many continents are there?", "What is the chemical symbol for gold?", "Name a musical instrument.",
    "What is 10 minus 4?",
]  # fmt: skip


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name)


def run_once(path: str, reservation: str, max_new: int, requests: int, pool: int, grow: int) -> dict:
    metrics_port = free_port()
    flags = ["--max-total-tokens", str(pool), "--max-running-requests", "32", "--decode-kv-reservation", reservation]
    flags += ["--decode-kv-grow-tokens", str(grow)]
    prefill, decode, prefill_port, decode_port = start_pair(path, [], flags + ["--metrics-port", str(metrics_port)])
    try:
        address = f"127.0.0.1:{decode_port}"
        wait_serving(f"127.0.0.1:{prefill_port}", prefill)
        wait_serving(address, decode)
        client = Client(address)
        tok = client.tokenizer
        prompts = []
        for q in (QUESTIONS * (requests // len(QUESTIONS) + 1))[:requests]:
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        client.generate_ids(prompts[0], max_new_tokens=2).__next__()  # warm
        most, done = 0, threading.Event()

        def poll():
            nonlocal most
            while not done.wait(0.02):
                load = client.stub.GetLoads(pb.GetLoadsRequest()).loads[0]
                most = max(most, load.num_running_reqs)

        ttfts, tokens = [], []

        def one(ids):
            c = Client(address)
            start, first, n = time.perf_counter(), None, 0
            for new in c.generate_ids(ids, max_new_tokens=max_new):
                first = first or time.perf_counter() - start
                n += len(new)
            ttfts.append(first)
            tokens.append(n)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        start = time.perf_counter()
        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        done.set()
        poller.join()
        ttfts.sort()
        return {
            "reservation": reservation, "max_new": max_new, "wall_s": wall, "out_tok_s": sum(tokens) / wall,
            "tokens": sum(tokens), "ttft_p50": statistics.median(ttfts), "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
            "most_running": most, "retractions": _metric(metrics_port, "disagg_retractions_total"),
            "reprefilled": _metric(metrics_port, "disagg_reprefilled_tokens_total"),
        }  # fmt: skip
    finally:
        stop(decode)
        stop(prefill)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-total-tokens", type=int, default=2048, dest="pool")
    p.add_argument("--max-new", type=int, nargs="+", default=[96, 1024])
    p.add_argument("--reservations", nargs="+", default=["full", "on-demand"])
    p.add_argument("--grow", type=int, default=32, help="decode's --decode-kv-grow-tokens (small: more retraction)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="capacity-") as tmp:
        path = model_folder(args.model_path, args.tiny, tmp)
        rows = [
            run_once(path, r, m, args.requests, args.pool, args.grow) for r in args.reservations for m in args.max_new
        ]
    print(
        f"# {describe()}, {os.path.basename(path)}, {args.requests} chat requests at once, decode pool {args.pool}, "
        f"grow {args.grow}"
    )
    print("| reservation | max_new_tokens | wall s | out tok/s | tokens | TTFT p50 s | TTFT p90 s | most running "
          "| retractions | re-prefilled tokens |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['reservation']} | {r['max_new']} | {r['wall_s']:.2f} | {r['out_tok_s']:.1f} | {r['tokens']} "
            f"| {r['ttft_p50']:.2f} | {r['ttft_p90']:.2f} | {r['most_running']} | {r['retractions']:.0f} "
            f"| {r['reprefilled']:.0f} |"
        )


if __name__ == "__main__":
    main()
