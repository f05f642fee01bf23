"""Decode speed on a real model, in one run: HF generate vs our decode scheduler vs the gRPC pair.

    python -m bench.serving_bench [--batch-sizes 1,16,64] [--new-tokens 64] [--model-path DIR] [--threads 2]

Model: SmolLM2-135M-Instruct (converted once by common.tools.smollm2) unless --model-path, fp32 on
CPU, one chat prompt (the same ids for every request, so HF needs no padding), greedy, EOS ignored.
For each batch size B:
1. HF `generate` on a [B, L] batch: TTFT = the time of generate(max_new_tokens=1); decode tok/s =
   B * (N - 1) / (time(N) - time(1)); ITL = that decode time / (N - 1).
2. ours in-process: DecodeScheduler + the prefill worker on a thread (InProcessPrefill), B requests
   submitted at once; token arrival times come from the output callback.
3. the pair over gRPC: `python -m prefill_service` and `python -m decode_service` as subprocesses on
   loopback, B concurrent streaming Generate calls from this process.
For 2 and 3: TTFT = first token - submit; decode tok/s = the sum over requests of
(tokens - 1) / (last token - first token); ITL p50/p99 over every gap between a request's tokens.
Output tok/s (SGLang bench_serving's output_throughput) = every output token / (last token of the
batch - submit), TTFT included (HF: B * N / time(N)): the pair streams each first token from the
prefill service before the KV lands on decode, which lengthens its first gap and so lowers decode
tok/s while it shortens TTFT; output tok/s counts both.
Each measurement runs --repeats times, the three interleaved; the table reports each one's best run
(the machine is noisy: single runs of the same thing differ by 10-20% here). Prints a markdown
table and the ratios (pair / HF, pair / in-process).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time

import torch

from common.forward import intra_op

PROMPT = "What is the capital of France? Answer in one sentence, then explain why it became the capital."


def chat_prompt(model_path: str | None) -> tuple[str, list[int]]:
    """(the model folder, default SmolLM2-135M-Instruct; PROMPT as chat-formatted ids)."""
    from common.tools.tokenizer import load_tokenizer

    if model_path is None:
        from common.tools.smollm2 import ensure_smollm2

        model_path = ensure_smollm2()
    tok = load_tokenizer(model_path)
    return model_path, list(
        tok.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarize(submitted: list[float], arrivals: list[list[float]]) -> dict:
    """Per-request token arrival times -> TTFT (ms), decode tok/s, output tok/s, ITL p50/p99 (ms)."""
    ttft = [a[0] - s for s, a in zip(submitted, arrivals)]
    decoding = [a for a in arrivals if len(a) > 1 and a[-1] > a[0]]
    rate = sum((len(a) - 1) / (a[-1] - a[0]) for a in decoding)
    gaps = [y - x for a in arrivals for x, y in zip(a, a[1:])]
    return dict(
        ttft_ms=1e3 * statistics.median(ttft),
        tok_s=rate,
        out_tok_s=sum(map(len, arrivals)) / (max(a[-1] for a in arrivals if a) - min(submitted)),
        itl_p50_ms=1e3 * _pct(gaps, 0.5),
        itl_p99_ms=1e3 * _pct(gaps, 0.99),
        decode_tokens=sum(len(a) - 1 for a in decoding),
        decode_s=sum(a[-1] - a[0] for a in decoding),
    )


def bench_hf(path: str, prompt: list[int], batch: int, new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt] * batch)

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
        return time.perf_counter() - start

    run(2)  # warm-up
    t1, tn = run(1), run(new_tokens)
    decode = tn - t1
    itl = decode / (new_tokens - 1)
    return dict(
        ttft_ms=1e3 * t1,
        tok_s=batch * (new_tokens - 1) / decode,
        out_tok_s=batch * new_tokens / tn,
        itl_p50_ms=1e3 * itl,
        itl_p99_ms=1e3 * itl,
    )


def bench_inprocess(
    path: str,
    prompt: list,
    batch: int,
    new_tokens: int,
    spec=None,
    stats: list | None = None,
    temperature: float = 0.0,
    device: str = "cpu",
    dtype: str = "auto",
    overlap: bool = True,
    runners: tuple | None = None,
    ignore_eos: bool = True,
    greedy_head: str = "auto",
) -> dict:
    """Our decode scheduler + in-process prefill; with `spec` (SpecArgs) EAGLE is on, and `stats`
    receives (drafts accepted, drafts proposed). temperature > 0 samples (request i seeded with i).
    `prompt` is one prompt's ids, or a list of prompts (request i gets prompt[i % len]).
    `runners` (decode, prefill ModelRunners, sized for `batch`) are reused instead of loaded."""
    from bench import offline
    from common.engine.draft_runner import SpecArgs
    from common.engine.model_runner import ModelRunner, RunnerArgs
    from common.engine.sampling import SamplingParams

    spec = spec or SpecArgs()
    prompts = prompt if isinstance(prompt[0], list) else [prompt]
    longest = max(map(len, prompts))
    args = dict(
        max_running_requests=batch,
        max_total_tokens=batch * (longest + new_tokens + spec.extra_slots) + 64,
        spec=spec,
        device=device,
        dtype=dtype,
        greedy_head=greedy_head,
    )
    runners = runners or (ModelRunner(RunnerArgs(path, **args)), ModelRunner(RunnerArgs(path, **args)))
    arrivals: list[list[float]] = [[] for _ in range(batch)]
    params = [
        SamplingParams(max_new_tokens=new_tokens, ignore_eos=ignore_eos, temperature=temperature, seed=i)
        for i in range(batch)
    ]
    start = time.perf_counter()
    _, spec_stats = offline.generate(
        *runners,
        [prompts[i % len(prompts)] for i in range(batch)],
        params,
        on_tokens=lambda i, ids: arrivals[i].extend([time.perf_counter()] * len(ids)),
        overlap=overlap,
        chunk_size=8192,
    )
    if stats is not None:
        stats[:] = spec_stats
    return summarize([start] * batch, arrivals)


def _log(prefix: str | None, name: str):
    """Where a started service writes its log: a new file `<prefix><name>.log`, or nowhere."""
    return subprocess.DEVNULL if prefix is None else open(f"{prefix}{name}.log", "w")  # noqa: SIM115 (the child's)


def start_pair(
    path: str,
    threads: int,
    max_batch: int,
    tokens: int,
    decode_flags: tuple = (),
    prefill_flags: tuple = (),
    replicas: int = 1,
    tree: str | None = None,
    decode_env: dict | None = None,
    env: dict | None = None,
    log_to: str | None = None,
) -> tuple[str, list[subprocess.Popen]]:
    """`replicas` prefill services and a decode service in front of them, as subprocesses on
    loopback; (the decode address, the processes: decode first). `tree`: run the services of that
    checkout of this repo (another commit) instead of this one; `decode_env`: more environment for the
    decode service (e.g. GOMP_SPINCOUNT); `env`: for every service; `log_to`: a path prefix for the
    services' logs (`<prefix>decode.log`, `<prefix>prefill<i>.log`; else they are dropped)."""
    from common.tools.procs import free_port, wait_serving

    ports, dp = [free_port() for _ in range(replicas)], free_port()
    common = [
        "--model-path",
        path,
        "--torch-threads",
        str(threads),
        "--max-running-requests",
        str(max_batch),
        "--max-total-tokens",
        str(tokens),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})} | ({"PYTHONPATH": tree} if tree else {})
    prefills = [
        subprocess.Popen(
            [sys.executable, "-m", "prefill_service", *common, "--port", str(pp), *prefill_flags],
            env=env,
            cwd=tree,
            stderr=_log(log_to, f"prefill{i}"),
        )
        for i, pp in enumerate(ports)
    ]
    decode = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "decode_service",
            *common,
            "--port",
            str(dp),
            "--prefill-addr",
            ",".join(f"127.0.0.1:{pp}" for pp in ports),
            *decode_flags,
        ],
        env=env | (decode_env or {}),
        cwd=tree,
        stderr=_log(log_to, "decode"),
    )
    for pp, proc in zip(ports, prefills):
        wait_serving(f"127.0.0.1:{pp}", proc)
    wait_serving(f"127.0.0.1:{dp}", decode, timeout=600.0)  # --enable-torch-compile: minutes of compiling
    return f"127.0.0.1:{dp}", [decode, *prefills]


def bench_pair(address: str, prompt: list[int], batch: int, new_tokens: int) -> dict:
    return summarize(*pair_arrivals(address, prompt, batch, new_tokens))


def pair_arrivals(
    address: str, prompt: list[int], batch: int, new_tokens: int
) -> tuple[list[float], list[list[float]]]:
    """B concurrent streaming Generate calls: (submit time of each, arrival time of each of its tokens).
    The calls are coroutines of one grpc.aio event loop: on a 2-core host shared with both services,
    B client threads (one per call) took ~7% of a core away from the forward at B=64."""
    import asyncio

    import grpc
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    submitted, arrivals = [0.0] * batch, [[] for _ in range(batch)]

    async def client(stub, i: int) -> None:
        req = pb.GenerateRequest(
            request_id=f"b{i}",
            tokenized=pb.TokenizedInput(input_ids=prompt),
            stream=True,
            sampling_params=pb.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True),
        )
        submitted[i] = time.perf_counter()
        async for msg in stub.Generate(req, timeout=600):
            if msg.HasField("chunk"):
                arrivals[i].extend([time.perf_counter()] * len(msg.chunk.token_ids))

    async def run() -> list:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.SglangSchedulerStub(channel)
            await channel.channel_ready()
            return await asyncio.gather(*(client(stub, i) for i in range(batch)), return_exceptions=True)

    errors = [e for e in asyncio.run(run()) if e is not None]
    if errors or any(len(a) != new_tokens for a in arrivals):
        raise RuntimeError(f"pair run failed: {errors[:1]} / token counts {[len(a) for a in arrivals][:8]}")
    return submitted, arrivals


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct (converted once)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for HF, in-process and each service")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the best is reported")
    parser.add_argument("--linear-layout", default="auto", help="the services' --linear-layout (pair only)")
    parser.add_argument("--greedy-head", default="auto", help="--greedy-head of the services and in-process runners")
    parser.add_argument("--prefill-threads", type=int, default=None, help="the prefill service's (default --threads)")
    parser.add_argument(
        "--torch-compile-max-bs",
        type=int,
        default=0,
        help="the pair's decode service with --enable-torch-compile up to this batch (0 = off; in-process stays eager)",
    )
    parser.add_argument("--skip", default="", help="comma list of hf,inprocess,pair to leave out")
    parser.add_argument(
        "--transfer-backend", default="grpc", choices=["grpc", "mooncake", "shm"], help="the pair's KV data plane"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.model_path, prompt = chat_prompt(args.model_path)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    print(
        f"# {os.path.basename(args.model_path)}, prompt {len(prompt)} tokens, {args.new_tokens} new tokens, "
        f"{args.threads} torch threads, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"pair KV over {args.transfer_backend}"
        + (f", pair decode torch.compile up to B={args.torch_compile_max_bs}" if args.torch_compile_max_bs else ""),
        flush=True,
    )
    rows = {}
    address, procs = (None, [])
    if "pair" not in skip:
        transfer = ("--disaggregation-transfer-backend", args.transfer_backend, "--linear-layout", args.linear_layout)
        transfer += ("--greedy-head", args.greedy_head)
        transfer += ("--disaggregation-network-private",) if args.transfer_backend == "mooncake" else ()  # loopback
        compile_flags = ()
        if args.torch_compile_max_bs:
            compile_flags = ("--enable-torch-compile", "--torch-compile-max-bs", str(args.torch_compile_max_bs))
        address, procs = start_pair(
            args.model_path,
            args.threads,
            max(batches),
            max(batches) * (len(prompt) + args.new_tokens) + 64,
            decode_flags=transfer + compile_flags,
            prefill_flags=transfer + (("--torch-threads", str(args.prefill_threads)) if args.prefill_threads else ()),
        )
    inprocess = functools.partial(bench_inprocess, args.model_path, greedy_head=args.greedy_head)
    try:
        for b in batches:
            if "pair" not in skip:
                bench_pair(address, prompt, b, 4)  # warm-up at this batch size
            for _ in range(args.repeats):  # the three interleaved, so drifts of the machine hit all alike
                hf = functools.partial(bench_hf, args.model_path, prompt, b, args.new_tokens)
                for name, fn in (
                    ("hf", functools.partial(intra_op.on_own_thread, hf)),  # no OpenMP pool left on main
                    ("inprocess", functools.partial(inprocess, prompt=prompt, batch=b, new_tokens=args.new_tokens)),
                    ("pair", functools.partial(bench_pair, address, prompt, b, args.new_tokens)),
                ):
                    if name in skip:
                        continue
                    r = fn()
                    print(
                        f"  B={b:>3} {name:>9}: {r['tok_s']:7.1f} tok/s  out {r['out_tok_s']:7.1f} tok/s  "
                        f"ITL p50 {r['itl_p50_ms']:6.1f} ms  "
                        f"p99 {r['itl_p99_ms']:6.1f} ms  TTFT {r['ttft_ms']:7.1f} ms",
                        flush=True,
                    )
                    if r["tok_s"] > rows.get((name, b), {"tok_s": -1})["tok_s"]:
                        rows[name, b] = r  # best of --repeats runs
    finally:
        from common.tools.procs import stop

        for p in procs:
            stop(p)
    print(
        "\n| B | HF tok/s | in-process tok/s | pair tok/s | pair ITL p50 / p99 (ms) | pair TTFT (ms) "
        "| pair / HF | pair / in-process | output tok/s HF / in-process / pair | output pair / HF |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    nan = dict.fromkeys(("tok_s", "out_tok_s", "itl_p50_ms", "itl_p99_ms", "ttft_ms"), float("nan"))
    for b in batches:
        hf, ip, pr = (rows.get((n, b), nan) for n in ("hf", "inprocess", "pair"))
        print(
            f"| {b} | {hf['tok_s']:.1f} | {ip['tok_s']:.1f} | {pr['tok_s']:.1f} | {pr['itl_p50_ms']:.1f} / "
            f"{pr['itl_p99_ms']:.1f} | {pr['ttft_ms']:.0f} | {pr['tok_s'] / hf['tok_s']:.2f}x | "
            f"{pr['tok_s'] / ip['tok_s']:.2f}x | {hf['out_tok_s']:.1f} / {ip['out_tok_s']:.1f} / "
            f"{pr['out_tok_s']:.1f} | {pr['out_tok_s'] / hf['out_tok_s']:.2f}x |"
        )


if __name__ == "__main__":
    main()
