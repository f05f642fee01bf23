"""Load generator in the style of SGLang's bench_serving, against our gRPC front door or an OpenAI endpoint.

    python -m bench.load_gen --backend grpc --addr 127.0.0.1:30000 --num-prompts 200 --request-rate 4
    python -m bench.load_gen --backend openai --base-url http://127.0.0.1:8000 --tokenizer DIR \
        --max-concurrency 16 --dataset file --dataset-path prompts.jsonl --output-json report.json

Prompts: `--dataset random` draws input lengths uniformly in [ratio * L, L] (`--random-input-len L`,
`--random-range-ratio`) and output lengths the same way from `--random-output-len`, with random
token ids (decoded to text for the OpenAI backend, which needs `--tokenizer`); `--dataset file` reads
JSONL lines `{"prompt": "...", "output_len": N}` (output_len optional) or plain text lines;
`--dataset generated-shared-prefix` (as SGLang's) makes `--gsp-num-groups` random system prompts of
`--gsp-system-prompt-len` tokens, each with `--gsp-prompts-per-group` random questions. Requests
ignore EOS, so each asks for exactly its output length. Arrivals: a Poisson process at
`--request-rate` per second (inf = all at once), optionally capped at `--max-concurrency` in flight.
The report (text, and JSON with --output-json, in SGLang bench_serving's flat keys: `mean_ttft_ms`,
`p99_itl_ms`, `output_throughput`, ...): successes and failures, duration, request and token
throughput, TTFT / ITL / TPOT / end-to-end latency (mean, median, std, p90/95/99, ms), the share of prompt tokens
the server served from its prefix cache (gRPC backend: each Complete's cached_tokens), and the speculative accept
length when the server drafts (gRPC backend: from each Complete's spec counts).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
import urllib.request
from concurrent import futures
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Job:
    prompt_ids: list[int] | None
    prompt_text: str | None
    output_len: int


@dataclass
class Outcome:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    spec_accepted: int = 0
    spec_drafted: int = 0
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache (as it reports them)


# ---- prompts ---------------------------------------------------------------------------------------
def random_jobs(n: int, input_len: int, output_len: int, ratio: float, vocab: list[int], tokenizer, seed: int):
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        ids = [rng.choice(vocab) for _ in range(rng.randint(max(1, int(input_len * ratio)), input_len))]
        out = rng.randint(max(1, int(output_len * ratio)), output_len)
        jobs.append(Job(ids, tokenizer.decode(ids) if tokenizer is not None else None, out))
    return jobs


def shared_prefix_jobs(
    groups: int, per_group: int, system_len: int, question_len: int, output_len: int, vocab, tokenizer, seed: int
):
    """SGLang's generated-shared-prefix workload: `groups` random system prompts of `system_len`
    tokens, each followed by `per_group` random questions of `question_len` tokens; shuffled."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(groups):
        system = [rng.choice(vocab) for _ in range(system_len)]
        for _ in range(per_group):
            ids = system + [rng.choice(vocab) for _ in range(question_len)]
            jobs.append(Job(ids, tokenizer.decode(ids) if tokenizer is not None else None, output_len))
    rng.shuffle(jobs)
    return jobs


def file_jobs(path: str, n: int, default_output_len: int, tokenizer):
    jobs = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            item = json.loads(line) if line.lstrip().startswith("{") else {"prompt": line.rstrip("\n")}
            text = item["prompt"]
            ids = tokenizer.encode(text) if tokenizer is not None else None
            jobs.append(Job(ids, text, int(item.get("output_len", default_output_len))))
    if not jobs:
        raise SystemExit(f"{path}: no prompts")
    return [jobs[i % len(jobs)] for i in range(n)]


# ---- backends: one blocking request -> Outcome ---------------------------------------------------------
class GrpcBackend:
    def __init__(self, addr: str):
        import grpc
        from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
        from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

        self.pb, self.grpc = pb, grpc
        self.channel = grpc.insecure_channel(addr, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        info = self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        self.vocab_size, self.model = info.vocab_size, info.served_model_name
        args = self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_args
        spec = "speculative_algorithm" in args and args["speculative_algorithm"]
        self.num_steps = int(args["speculative_num_steps"]) if spec else 0

    def __call__(self, job: Job, rid: str, timeout: float) -> Outcome:
        pb, out = self.pb, Outcome(prompt_tokens=len(job.prompt_ids))
        req = pb.GenerateRequest(
            request_id=rid,
            tokenized=pb.TokenizedInput(input_ids=job.prompt_ids),
            stream=True,
            sampling_params=pb.SamplingParams(max_new_tokens=job.output_len, ignore_eos=True),
        )
        start = last = time.perf_counter()
        try:
            for r in self.stub.Generate(req, timeout=timeout):
                now = time.perf_counter()
                if r.HasField("chunk"):
                    if out.output_tokens == 0:
                        out.ttft = now - start
                    else:
                        out.itls.append(now - last)
                    out.output_tokens += len(r.chunk.token_ids)
                    last = now
                else:
                    out.spec_accepted, out.spec_drafted = r.complete.spec_accepted_tokens, r.complete.spec_draft_tokens
                    out.cached_tokens = r.complete.cached_tokens
            out.ok, out.e2e = True, time.perf_counter() - start
        except self.grpc.RpcError as e:
            out.error = f"{e.code().name}: {e.details()}"
        return out


class OpenAIBackend:
    def __init__(self, base_url: str, model: str | None, ban_token: int | None = None):
        """`ban_token`: an id (the EOS) every request biases by -100 (OpenAI's logit_bias), for servers
        that do not take `ignore_eos`; without it the request asks for `ignore_eos`."""
        self.base_url = base_url.rstrip("/")
        self.ban_token = ban_token
        if model is None:
            with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=10) as resp:
                model = json.loads(resp.read())["data"][0]["id"]
        self.model, self.num_steps = model, 0

    def __call__(self, job: Job, rid: str, timeout: float) -> Outcome:
        out = Outcome(prompt_tokens=len(job.prompt_ids or ()))
        body = {
            "model": self.model,
            "prompt": job.prompt_text,
            "max_tokens": job.output_len,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **({"ignore_eos": True} if self.ban_token is None else {"logit_bias": {str(self.ban_token): -100}}),
        }
        req = urllib.request.Request(
            f"{self.base_url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        start = last = time.perf_counter()
        seen_text, events, usage = False, 0, False
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                for line in resp:
                    line = line.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    event, now = json.loads(line[5:]), time.perf_counter()
                    if event.get("usage"):
                        out.prompt_tokens = event["usage"]["prompt_tokens"]
                        out.output_tokens, usage = event["usage"]["completion_tokens"], True
                    if event.get("choices") and event["choices"][0].get("text"):
                        events += 1
                        if not seen_text:
                            out.ttft, seen_text = now - start, True
                        else:
                            out.itls.append(now - last)
                        last = now
            if not usage:  # a server without stream usage: one streamed piece per token
                out.output_tokens = events
            out.ok, out.e2e = seen_text, time.perf_counter() - start
            out.error = "" if seen_text else "no text streamed"
        except Exception as e:  # HTTP errors, timeouts, broken streams: a failed request
            out.error = repr(e)
        return out


# ---- the run -----------------------------------------------------------------------------------------
def run(
    jobs: list[Job], send, rate: float, max_concurrency: int | None, timeout: float, seed: int, progress: bool = True
) -> tuple[list[Outcome], float]:
    from tqdm import tqdm

    rng = random.Random(seed)
    slots = threading.Semaphore(max_concurrency or len(jobs))
    bar = tqdm(total=len(jobs), disable=not progress, desc="requests", unit="req")

    def one(i: int) -> Outcome:
        try:
            return send(jobs[i], f"load-{seed}-{i}", timeout)
        finally:
            slots.release()
            bar.update(1)

    started = time.perf_counter()
    with futures.ThreadPoolExecutor(max_workers=min(len(jobs), max_concurrency or len(jobs), 512)) as pool:
        pending = []
        for i in range(len(jobs)):
            if rate != float("inf"):
                time.sleep(rng.expovariate(rate))
            slots.acquire()
            pending.append(pool.submit(one, i))
        outcomes = [p.result() for p in pending]
    bar.close()
    return outcomes, time.perf_counter() - started


METRICS = (("ttft", "ttft"), ("itl", "itl"), ("tpot", "tpot"), ("e2e", "e2e_latency"))  # (ours, bench_serving's)


def _stats(name: str, values: list[float]) -> dict:
    """bench_serving's flat keys for one latency: mean_/median_/std_/p90_/p95_/p99_{name}_ms."""
    a = 1e3 * np.asarray(values) if values else None
    stats = {"mean": np.mean, "median": np.median, "std": np.std}
    out = {f"{k}_{name}_ms": float(f(a)) if a is not None else None for k, f in stats.items()}
    out.update({f"p{q}_{name}_ms": float(np.percentile(a, q)) if a is not None else None for q in (90, 95, 99)})
    return out


def report(outcomes: list[Outcome], duration: float, num_steps: int) -> dict:
    """SGLang bench_serving's flat JSON keys, plus ours: failed, errors, cached_token_ratio."""
    ok = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in ok)
    in_tokens = sum(o.prompt_tokens for o in ok)
    tpot = [(o.e2e - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    result = {
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "input_throughput": in_tokens / duration,
        "output_throughput": out_tokens / duration,
        "concurrency": sum(o.e2e for o in ok) / duration,  # mean requests in flight
        "errors": sorted({o.error for o in outcomes if not o.ok})[:10],
        "cached_token_ratio": sum(o.cached_tokens for o in ok) / max(1, in_tokens),
    }
    values = {"ttft": [o.ttft for o in ok], "itl": [x for o in ok for x in o.itls], "tpot": tpot}
    values["e2e"] = [o.e2e for o in ok]
    for ours, theirs in METRICS:
        result.update(_stats(theirs, values[ours]))
    drafted = sum(o.spec_drafted for o in ok)
    if num_steps and drafted:  # tokens per verify step = 1 + accepted drafts per step
        result["accept_length"] = 1 + sum(o.spec_accepted for o in ok) * num_steps / drafted
    return result


def print_report(r: dict) -> None:
    print(f"{'completed / failed':<28}{r['completed']} / {r['failed']}")
    print(f"{'duration (s)':<28}{r['duration']:.2f}")
    print(f"{'request throughput (req/s)':<28}{r['request_throughput']:.2f}")
    print(f"{'input tokens/s':<28}{r['input_throughput']:.1f}")
    print(f"{'output tokens/s':<28}{r['output_throughput']:.1f}")
    print(f"{'cached prompt tokens':<28}{r['cached_token_ratio']:.1%}")
    if "accept_length" in r:
        print(f"{'accept length':<28}{r['accept_length']:.2f}")
    print(f"{'(ms)':<28}{'mean':>10}{'median':>10}{'p99':>10}")
    for ours, theirs in METRICS:
        cells = [r[f"{k}_{theirs}_ms"] for k in ("mean", "median", "p99")]
        print(f"{ours.upper():<28}" + "".join(f"{c:>10.1f}" if c is not None else f"{'-':>10}" for c in cells))
    for e in r["errors"]:
        print(f"error: {e}")


def fixed_run(
    backend: list[str], tokenizer: str, n: int, concurrency: int, input_len: int, output_len: int, seed: int, out: str
) -> dict:
    """One run of `n` random prompts of exactly `input_len` tokens, `output_len` new tokens each, at most
    `concurrency` in flight, through `backend` (this tool's backend flags); its JSON report. `seed`
    picks the prompts: a new one per run keeps a server's prefix cache from holding an earlier run's."""
    main([*backend, "--tokenizer", tokenizer, "--num-prompts", str(n), "--max-concurrency", str(concurrency),
          "--seed", str(seed), "--random-input-len", str(input_len), "--random-range-ratio", "1.0",
          "--random-output-len", str(output_len), "--no-progress", "--output-json", out])  # fmt: skip
    with open(out) as f:
        return json.load(f)


def print_rows(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """`rows` as a markdown table: columns of (header, key, format spec)."""
    print("| " + " | ".join(h for h, _, _ in columns) + " |")
    print("|" + " --- |" * len(columns))
    for r in rows:
        print("| " + " | ".join(format(r[k], f) for _, k, f in columns) + " |")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.load_gen", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["grpc", "openai"], default="grpc")
    p.add_argument("--addr", default="127.0.0.1:30000", help="gRPC front door (backend grpc)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="OpenAI endpoint (backend openai)")
    p.add_argument("--model", default=None, help="OpenAI model name (default: the first of /v1/models)")
    p.add_argument("--ban-token", type=int, default=None, help="openai: bias this id (the EOS) by -100 instead of "
                   "asking for ignore_eos (servers without it)")  # fmt: skip
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (needed for text prompts)")
    p.add_argument("--dataset", choices=["random", "file", "generated-shared-prefix"], default="random")
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.5)
    p.add_argument("--gsp-num-groups", type=int, default=8, help="shared-prefix groups (system prompts)")
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=400)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of one request (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    tokenizer = None
    if args.tokenizer:
        from common.tools.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    elif args.backend == "openai" or args.dataset == "file":
        p.error("--tokenizer is needed for the openai backend and for --dataset file")
    if args.backend == "grpc":
        send = GrpcBackend(args.addr)
    else:
        send = OpenAIBackend(args.base_url, args.model, args.ban_token)
    if args.dataset == "file":
        if not args.dataset_path:
            p.error("--dataset file needs --dataset-path")
        jobs = file_jobs(args.dataset_path, args.num_prompts, args.random_output_len, tokenizer)
    else:
        special = set(tokenizer.all_special_ids) if tokenizer is not None else set()
        size = len(tokenizer) if tokenizer is not None else send.vocab_size
        vocab = [t for t in range(size) if t not in special]
    if args.dataset == "generated-shared-prefix":
        jobs = shared_prefix_jobs(
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            vocab,
            tokenizer if args.backend == "openai" else None,
            args.seed,
        )
    elif args.dataset == "random":
        jobs = random_jobs(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            vocab,
            tokenizer if args.backend == "openai" else None,
            args.seed,
        )
    outcomes, duration = run(
        jobs, send, args.request_rate, args.max_concurrency, args.timeout, args.seed, progress=not args.no_progress
    )
    result = report(outcomes, duration, send.num_steps)
    result["config"] = {k: v for k, v in vars(args).items() if k != "no_progress"}
    print_report(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
