"""Multi-turn chat through the pair, decode's prefix cache off vs on (issue 57): what each turn's
handoff moves and its time to first token.

    python -m bench.multiturn_bench [--model-path DIR | --tiny] [--conversations 4] [--turns 6]
        [--message-tokens 300] [--answer-tokens 32] [--transfers grpc,shm]

Each conversation's turn t sends its whole history (every earlier message and answer) plus a new
message of random ids, as a chat client does; the conversations of one turn run at once. For each
transfer backend and cache setting a fresh pair (SmolLM2-135M-Instruct by default) runs every turn;
prints per turn the mean prompt length, the handoff bytes decode received (its
disagg_handoff_bytes_total) and the median TTFT.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from concurrent import futures

from bench.compose_check import scrape
from common.tools.demo import model_folder, start_pair
from common.tools.procs import free_port, stop, wait_serving


def _ask(client, ids: list[int], answer: int) -> tuple[float, list[int]]:
    started, first, out = time.perf_counter(), None, []
    for piece in client.generate_ids(ids, answer, ignore_eos=True):
        first = first or time.perf_counter()
        out += piece
    return first - started, out


def run(path: str, transfer: str, cache: bool, args) -> list[dict]:
    from common.tools.client import Client

    metrics = free_port()
    flags = ["--disaggregation-transfer-backend", transfer, "--max-total-tokens", "32768"]
    decode_flags = ["--metrics-port", str(metrics)] + (["--disaggregation-decode-enable-radix-cache"] if cache else [])
    prefill, decode, prefill_port, decode_port = start_pair(path, flags, decode_flags)
    rows = []
    try:
        for port, proc in ((prefill_port, prefill), (decode_port, decode)):
            wait_serving(f"127.0.0.1:{port}", proc)
        clients = [Client(f"127.0.0.1:{decode_port}") for _ in range(args.conversations)]
        vocab = clients[0].model_info().vocab_size
        rng = random.Random(0)
        history = [[] for _ in range(args.conversations)]
        with futures.ThreadPoolExecutor(args.conversations) as pool:
            for turn in range(args.turns):
                for h in history:
                    h += [rng.randrange(100, vocab - 100) for _ in range(args.message_tokens)]
                before = scrape(metrics, "disagg_handoff_bytes_total")
                done = list(pool.map(lambda c: _ask(clients[c], history[c], args.answer_tokens), range(len(clients))))
                moved = scrape(metrics, "disagg_handoff_bytes_total") - before
                for h, (_, answer) in zip(history, done):
                    h += answer
                rows.append(dict(turn=turn + 1, prompt=statistics.mean(len(h) for h in history) - args.answer_tokens,
                                 mib=moved / 2**20, ttft_ms=1e3 * statistics.median(t for t, _ in done)))  # fmt: skip
                print(f"[multiturn] {transfer} cache={'on' if cache else 'off'} {rows[-1]}", flush=True)
        for c in clients:
            c.close()
    finally:
        stop(decode), stop(prefill)
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.multiturn_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--message-tokens", type=int, default=300)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--transfers", default="grpc,shm")
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="multiturn-") as tmp:
        path = model_folder(args.model_path, args.tiny, tmp)
        for transfer in args.transfers.split(","):
            for cache in (False, True):
                results[(transfer, cache)] = run(path, transfer, cache, args)
    print("| transfer | turn | mean prompt | handoff MiB off / on | median TTFT ms off / on |")
    print("| --- | --- | --- | --- | --- |")
    for transfer in args.transfers.split(","):
        for off, on in zip(results[(transfer, False)], results[(transfer, True)]):
            print(f"| {transfer} | {off['turn']} | {off['prompt']:.0f} | {off['mib']:.1f} / {on['mib']:.1f} | "
                  f"{off['ttft_ms']:.0f} / {on['ttft_ms']:.0f} |")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
