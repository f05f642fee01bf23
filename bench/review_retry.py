"""The security review's findings re-tried end to end (issue 53): the pair as users start it, on
loopback, with the real SmolLM2 (or --tiny), and each high and medium finding tried as the review did.

    python -m bench.review_retry [--tiny] [--model-path DIR]

Prints one line per finding: what was sent, what came back, how long it took, and what an ordinary
request (and the health check) saw meanwhile. The tests re-create each finding alone
(tests/test_hostile_caller.py, test_grammar_limits.py, test_compile_pool.py, test_shutdown_signal.py,
the TP store and Mooncake tests); this script runs them against real services, as a caller would.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.host import describe
from common.tools.client import Client
from common.tools.demo import model_folder, start_pair
from common.tools.procs import stop, wait_serving


def _timed(fn):
    start = time.perf_counter()
    try:
        out = fn()
        return "ok", out, time.perf_counter() - start
    except grpc.RpcError as e:
        return e.code().name, e.details()[:90], time.perf_counter() - start


def _ordinary(client: Client, **sampling):
    """A short greedy request (4 tokens) with its outcome and seconds."""
    return _timed(lambda: sum(client.generate_ids([1, 2, 3, 4], max_new_tokens=4, **sampling), []))


def _nested(depth: int) -> str:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return json.dumps(schema)


_WATCH = """
import sys, threading, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(sys.argv[1]))
worst, done = 0.0, threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while not done.wait(0.05):
    start = time.perf_counter()
    try:
        stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
    except grpc.RpcError:
        pass
    worst = max(worst, time.perf_counter() - start)
print(worst)
"""


class _HealthWatch:
    """Health checks every 50 ms from a process of their own (not behind this one's GIL, which is busy
    serializing the big message): the slowest answer while it runs."""

    def __init__(self, address: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WATCH, address], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        time.sleep(1.0)  # its first checks are in

    def stop(self) -> float:
        out, _ = self.proc.communicate("")
        return float(out.strip() or "nan")


def _parallel(calls) -> list:
    out = [None] * len(calls)
    threads = [threading.Thread(target=lambda i=i, f=f: out.__setitem__(i, _timed(f))) for i, f in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def run(address: str, say) -> None:
    client = Client(address)
    client.generate_ids([1, 2], max_new_tokens=1)  # warm
    say("baseline", "a 4-token request", _ordinary(client))

    # High: n above the request slots sat at the head of admission and held everyone back.
    big_n = _timed(lambda: sum(client.generate_ids([1, 2, 3], max_new_tokens=2, n=100), []))
    say("n = 100", "refused at the front door", big_n)
    say("n = 100", "a 4-token request after it", _ordinary(client))

    # Medium: grammar compiles starved everyone (22 s and 13.4 s compiles, kept running past 10 s).
    say(
        "schema nested 400",
        "refused by its bounds",
        _timed(lambda: sum(client.generate_ids([1], 2, json_schema=_nested(400)), [])),
    )
    slow = [json.dumps({"type": "string", "maxLength": 1000, "title": f"t{i}"}) for i in range(8)]
    storm = [lambda s=s: sum(client.generate_ids([1, 2], max_new_tokens=2, json_schema=s), []) for s in slow]
    during = {}
    storm.append(lambda: during.setdefault("constrained", _ordinary(client, regex="(yes|no)")) and [])
    storm.append(lambda: during.setdefault("unconstrained", _ordinary(client)) and [])
    start = time.perf_counter()
    results = _parallel(storm)
    codes = [r[0] for r in results[: len(slow)]]
    say("8 slow schemas at once", f"{codes.count('ok')} ok, others {sorted(set(codes) - {'ok'})}",
        ("ok", None, time.perf_counter() - start))  # fmt: skip
    say("8 slow schemas at once", "a constrained request meanwhile", during["constrained"])
    say("8 slow schemas at once", "an unconstrained request meanwhile", during["unconstrained"])
    say("after the storm", "a constrained request", _ordinary(client, regex="(maybe|so)"))

    # Medium: a 57 MiB Generate of ids stalled the event loop 5.5 s (health checks included).
    watch = _HealthWatch(address)
    ids = [200] * (57 << 19)  # 2-byte varints: ~57 MiB, as the review sent
    huge = pb.GenerateRequest(request_id="huge", tokenized=pb.TokenizedInput(input_ids=ids), stream=False)
    outcome = _timed(lambda: list(client.stub.Generate(huge, timeout=60)))
    worst = watch.stop()
    say("57 MiB of ids", f"refused (health checks meanwhile: slowest {worst * 1e3:.0f} ms)", outcome)
    say("57 MiB of ids", "a 4-token request after it", _ordinary(client))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="review-") as tmp:
        path = model_folder(args.model_path, args.tiny, tmp)
        prefill, decode, prefill_port, decode_port = start_pair(path, [])
        try:
            address = f"127.0.0.1:{decode_port}"
            wait_serving(f"127.0.0.1:{prefill_port}", prefill)
            wait_serving(address, decode)
            print(f"# {describe()}, model {os.path.basename(path)}, {time.strftime('%Y-%m-%d')}")
            print("| finding | what | outcome | seconds |\n| --- | --- | --- | --- |")

            def say(finding, what, result):
                code, detail, seconds = result
                shown = code if code == "ok" else f"{code}: {detail}"
                print(f"| {finding} | {what} | {shown} | {seconds:.2f} |", flush=True)

            run(address, say)
        finally:
            stop(decode)
            stop(prefill)


if __name__ == "__main__":
    sys.exit(main())
