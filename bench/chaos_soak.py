"""Soak and chaos drill: steady load on the pair while replicas die, stall and fail, then the books.

    python -m bench.chaos_soak [--minutes 10] [--rate 2] [--concurrency 8] [--transfer-backend grpc]

On loopback, all processes on this machine: two prefill replicas (B with --inject-faults: started as
bench/drill_prefill.py) and one decode service (--debug-checks: pool integrity whenever idle), on a
tiny random Llama. A load thread sends greedy requests (16 fixed prompts, EOS ignored, HF greedy
references computed up front) as a Poisson stream at --rate per second, at most --concurrency in
flight; ~5% are cancelled by the client after their first tokens, ~5% aborted with the Abort RPC,
~5% read slowly. Chaos: replica A is SIGKILLed and restarted every 60 s; replica B is SIGSTOPped for
8 s once, at a third of the run. Report: calls by outcome (exact, wrong tokens, cancelled, aborted,
failed with status, no end), p99 TTFT and ITL per minute, decode RSS at start, middle and end, and
after the load decode's KV and request slots in use (GetLoads) and its own pool check. A timing
drill, never a test.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import numpy as np
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.tools.procs import free_port, stop, wait_serving
from common.tools.tiny_checkpoint import build

NEW_TOKENS = 24


def references(path: str, prompts: list[list[int]]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=0)
            out.append(ids[0, len(p) :].tolist())
    return out


def start(module: str, path: str, port: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", module, "--model-path", path, "--port", str(port), "--torch-threads", "1", *flags]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class Load:
    """Sends the requests and keeps every call's outcome and timings."""

    def __init__(self, addr: str, prompts, refs, rate: float, concurrency: int, seed: int):
        self.stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(addr))
        self.prompts, self.refs, self.rate = prompts, refs, rate
        self.slots = threading.Semaphore(concurrency)
        self.rng = random.Random(seed)
        self.outcomes: collections.Counter = collections.Counter()
        self.samples: list[tuple[float, str, float]] = []  # (time, "ttft"|"itl", seconds)
        self.lock = threading.Lock()
        self.open = 0

    def one(self, n: int, t0: float) -> None:
        i, mode = n % len(self.prompts), self.rng.choices(["plain", "cancel", "abort", "slow"], [85, 5, 5, 5])[0]
        rid = f"soak-{n}"
        sp = pb.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        req = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=self.prompts[i]), stream=True,
                                 sampling_params=sp)  # fmt: skip
        started, last, ids, outcome = time.perf_counter(), None, [], "no end"
        try:
            call = self.stub.Generate(req, timeout=120)
            for r in call:
                now = time.perf_counter()
                if r.HasField("chunk") and r.chunk.token_ids:
                    kind, gap = ("ttft", now - started) if last is None else ("itl", now - last)
                    with self.lock:
                        self.samples.append((now - t0, kind, gap))
                    last = now
                    ids += r.chunk.token_ids
                    if mode == "cancel" and len(ids) >= 3:
                        call.cancel()
                    if mode == "abort" and len(ids) >= 3:
                        self.stub.Abort(pb.AbortRequest(request_id=rid), timeout=10)
                    if mode == "slow":
                        time.sleep(0.2)
                elif r.HasField("complete"):
                    reason = r.complete.finish_reason
                    exact = ids == self.refs[i]
                    outcome = "aborted" if reason == "abort" else ("exact" if exact else "WRONG TOKENS")
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and mode == "cancel":
                outcome = "cancelled"
            else:
                outcome = f"failed: {e.code().name}"
        with self.lock:
            self.outcomes[outcome] += 1
            self.open -= 1
        self.slots.release()

    def run(self, seconds: float) -> None:
        t0, n, threads = time.perf_counter(), 0, []
        while time.perf_counter() - t0 < seconds:
            time.sleep(self.rng.expovariate(self.rate))
            self.slots.acquire()
            with self.lock:
                self.open += 1
            th = threading.Thread(target=self.one, args=(n, t0), daemon=True)
            th.start()
            threads.append(th)
            n += 1
        for th in threads:
            th.join(timeout=180)
        self.outcomes["no end"] += sum(th.is_alive() for th in threads)


def chaos(stop_at: float, path: str, ports, procs, log: list[str]) -> None:
    t0, killed, stopped = time.perf_counter(), 0, False
    while time.perf_counter() - t0 < stop_at:
        time.sleep(1)
        elapsed = time.perf_counter() - t0
        if not stopped and elapsed > stop_at / 3:
            os.kill(procs["b"].pid, signal.SIGSTOP)
            time.sleep(8)
            os.kill(procs["b"].pid, signal.SIGCONT)
            log.append(f"{elapsed:.0f}s: replica B stopped for 8 s")
            stopped = True
        if elapsed // 60 > killed:
            killed += 1
            procs["a"].kill()
            procs["a"].wait()
            procs["a"] = start("prefill_service", path, ports["a"])
            log.append(f"{elapsed:.0f}s: replica A killed and restarted")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--transfer-backend", default="grpc", choices=["grpc", "mooncake", "shm"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = build(tmp, "llama")
        prompts = [[rng.randrange(5, 380) for _ in range(rng.randrange(4, 60))] for _ in range(16)]
        refs = references(path, prompts)
        ports = {"a": free_port(), "b": free_port(), "decode": free_port(), "metrics": free_port()}
        transfer = ("--disaggregation-transfer-backend", args.transfer_backend)
        transfer += ("--disaggregation-network-private",) if args.transfer_backend == "mooncake" else ()  # loopback
        faults = ("--inject-faults", "fail=0.05,stall=0.02")
        procs = {"a": start("prefill_service", path, ports["a"], *transfer),
                 "b": start("bench.drill_prefill", path, ports["b"], *transfer, *faults)}  # fmt: skip
        addrs = f"127.0.0.1:{ports['a']},127.0.0.1:{ports['b']}"
        procs["decode"] = start("decode_service", path, ports["decode"], "--prefill-addr", addrs, "--debug-checks",
                                "--prefill-progress-timeout-s", "3", *transfer)  # fmt: skip
        addr = f"127.0.0.1:{ports['decode']}"
        try:
            for name in ("a", "b", "decode"):
                wait_serving(f"127.0.0.1:{ports[name]}", procs[name])
            load = Load(addr, prompts, refs, args.rate, args.concurrency, args.seed)
            seconds, log, rss = args.minutes * 60, [], [("start", rss_mb(procs["decode"].pid))]
            threading.Thread(target=chaos, args=(seconds, path, ports, procs, log), daemon=True).start()
            mid = threading.Timer(seconds / 2, lambda: rss.append(("middle", rss_mb(procs["decode"].pid))))
            mid.start()
            load.run(seconds)
            time.sleep(3)
            rss.append(("end", rss_mb(procs["decode"].pid)))
            loads = load.stub.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0]
            report(args, load, log, rss, loads, procs["decode"].poll())
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGCONT)
                stop(proc)


def report(args, load: Load, log, rss, loads, decode_exit) -> None:
    print(f"# chaos soak: {args.minutes:g} min, {args.rate:g} req/s, <= {args.concurrency} in flight, "
          f"KV over {args.transfer_backend}")  # fmt: skip
    print("\n| outcome | calls |\n| --- | --- |")
    for outcome, count in sorted(load.outcomes.items()):
        print(f"| {outcome} | {count} |")
    print("\n| minute | TTFT p99 (ms) | ITL p99 (ms) | tokens |\n| --- | --- | --- | --- |")
    for minute in range(int(np.ceil(args.minutes))):
        ttft = [s for t, k, s in load.samples if k == "ttft" and minute * 60 <= t < (minute + 1) * 60]
        itl = [s for t, k, s in load.samples if k == "itl" and minute * 60 <= t < (minute + 1) * 60]
        p99 = lambda xs: f"{1e3 * np.percentile(xs, 99):.0f}" if xs else "-"  # noqa: E731
        print(f"| {minute + 1} | {p99(ttft)} | {p99(itl)} | {len(ttft) + len(itl)} |")
    print("\ndecode RSS (MB): " + ", ".join(f"{k} {v:.0f}" for k, v in rss))
    in_use = loads.num_running_reqs + loads.num_waiting_reqs
    print(f"after the load: {loads.num_used_tokens} KV slots and {in_use} requests in use; decode still "
          f"running: {decode_exit is None} (--debug-checks checks the pools when idle)")  # fmt: skip
    print("chaos: " + "; ".join(log))


if __name__ == "__main__":
    main()
