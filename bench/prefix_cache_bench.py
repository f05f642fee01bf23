"""The prefill prefix cache on a real model: TTFT of a request that shares a long prefix, and the hit
rate of cache-aware replica choice against least-loaded at two prefill replicas.

    python -m bench.prefix_cache_bench [--model-path DIR] [--system-len 400] [--groups 3] [--threads 1]

Model: SmolLM2-135M-Instruct (converted once) unless --model-path, the services as subprocesses on
loopback (common flags as bench.serving_bench), random token ids for prompts.
1. TTFT: for each of --groups system prompts of --system-len tokens, a cold request (system + a
   16-token question), then a second one (same system, another question); the median TTFT of each,
   with the cache on and with --disable-radix-cache.
2. Routing: two prefill replicas, `bench.load_gen --dataset generated-shared-prefix` (8 groups of 4
   prompts, the same system length, 4 in flight) with --prefill-policy cache_aware and least_loaded:
   the share of prompt tokens served from the cache and the TTFT.
Prints markdown tables with the host's CPU (common/host.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench import load_gen
from bench.serving_bench import start_pair
from common import host
from common.tools.procs import stop


def _ttft(stub, pb, prompt: list[int], rid: str) -> tuple[float, int]:
    req = pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        stream=True,
        sampling_params=pb.SamplingParams(max_new_tokens=2, ignore_eos=True),
    )
    start, first, cached = time.perf_counter(), None, 0
    for r in stub.Generate(req, timeout=600):
        if r.HasField("chunk") and first is None:
            first = time.perf_counter() - start
        elif r.HasField("complete"):
            cached = r.complete.cached_tokens
    return first, cached


def ttft_pairs(path: str, args, cache: bool) -> dict:
    import grpc
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    flags = () if cache else ("--disable-radix-cache",)
    address, procs = start_pair(path, args.threads, 8, 8192, prefill_flags=flags)
    rng = random.Random(0)
    try:
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(address))
        _ttft(stub, pb, [rng.randrange(3, 40000) for _ in range(32)], "warm")
        cold, warm, cached = [], [], []
        for g in range(args.groups):
            system = [rng.randrange(3, 40000) for _ in range(args.system_len)]
            for out, q in ((cold, 0), (warm, 1)):
                t, c = _ttft(stub, pb, system + [rng.randrange(3, 40000) for _ in range(16)], f"g{g}q{q}")
                out.append(t)
            cached.append(c)
        return dict(cold=statistics.median(cold), warm=statistics.median(warm), cached=min(cached))
    finally:
        for p in procs:
            stop(p)


def routing(path: str, args, policy: str) -> dict:
    address, procs = start_pair(path, args.threads, 8, 8192, decode_flags=("--prefill-policy", policy), replicas=2)
    try:
        flags = ["--addr", address, "--dataset", "generated-shared-prefix", "--max-concurrency", "4"]
        flags += ["--gsp-num-groups", "8", "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len"]
        flags += [str(args.system_len), "--gsp-question-len", "32", "--gsp-output-len", "8", "--no-progress"]
        return load_gen.main(flags)
    finally:
        for p in procs:
            stop(p)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--system-len", type=int, default=400)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each service")
    args = p.parse_args(argv)
    from common.tools.smollm2 import ensure_smollm2

    path = args.model_path or ensure_smollm2()
    ttft = {cache: ttft_pairs(path, args, cache) for cache in (True, False)}
    routes = {policy: routing(path, args, policy) for policy in ("cache_aware", "least_loaded")}
    print(f"\n{host.describe()}, {args.threads} torch thread(s) per service, system prompt {args.system_len} tokens\n")
    print("| prefix cache | TTFT first (ms) | TTFT second, same prefix (ms) | ratio | cached tokens |")
    print("| --- | --- | --- | --- | --- |")
    for cache, r in ttft.items():
        print(
            f"| {'on' if cache else 'off'} | {1e3 * r['cold']:.0f} | {1e3 * r['warm']:.0f} | "
            f"{r['warm'] / r['cold']:.2f} | {r['cached']} |"
        )
    print("\n| replica choice (2 replicas) | cached prompt tokens | TTFT median (ms) | TTFT p99 (ms) |")
    print("| --- | --- | --- | --- |")
    for policy, r in routes.items():
        print(f"| {policy} | {r['cached_token_ratio']:.1%} | {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} |")


if __name__ == "__main__":
    main()
