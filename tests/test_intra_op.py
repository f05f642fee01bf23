"""One OpenMP pool per process (common/forward/intra_op.py): loading, warm-up and importing the project
start no pool on the main thread; the forward stream's worker computes with the creator's thread count
and is the only thread that starts one. Run in a fresh interpreter (pytest's own threads and earlier
tests' pools would blur the count); native threads = OS threads the threading module does not know."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, os, sys, threading, time
import torch
torch.set_num_threads(2)
def native(expect=None):
    # threads that are exiting (torch resizes its own helper pool when a thread count changes) may
    # still be listed for a moment: wait up to 5 s for the expected count; a pool worker never leaves
    deadline = time.monotonic() + 5
    while True:
        n = len(os.listdir("/proc/self/task")) - len(threading.enumerate())
        if expect is None or n == expect or time.monotonic() > deadline:
            return n
        time.sleep(0.05)
base = native()
from common.forward.forward_batch import ForwardBatch
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.streams import WorkerStream
runner = ModelRunner(RunnerArgs(sys.argv[1], max_total_tokens=64, max_running_requests=2))
runner.warmup()
after_load = native(expect=base)
stream = WorkerStream()
seen = {}
def work():
    row, slots = runner.req_to_token_pool.alloc(), runner.kv_allocator.alloc(16)
    runner.req_to_token_pool.write(row, 0, slots)
    runner.forward(ForwardBatch.extend(runner.req_to_token_pool.req_to_token, [row], [0], [list(range(3, 15))]))
    seen["stream_threads"] = torch.get_num_threads()
stream.submit(work)
stream.synchronize(timeout=60)
after_forward = native(expect=base + 1)
print(json.dumps(dict(base=base, after_load=after_load, after_forward=after_forward,
                      main_threads=torch.get_num_threads(), **seen)))
"""


def test_only_the_forward_stream_starts_an_openmp_pool(checkpoint):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, checkpoint("llama")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    ).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["main_threads"] == 2 and seen["stream_threads"] == 2, seen  # counts kept and inherited
    assert seen["after_load"] == seen["base"], seen  # importing, loading, warm-up: no pool on main
    assert seen["after_forward"] == seen["base"] + 1, seen  # the stream's pool: one worker beside it


CHECK_SPIN = r"""
import os, sys
import common.omp_spin as omp_spin
set_default = omp_spin.set_default
def checked(service):
    assert "torch" not in sys.modules, "torch (libgomp) loaded before GOMP_SPINCOUNT was set"
    set_default(service)
omp_spin.set_default = checked
import importlib
importlib.import_module(sys.argv[1] + ".__main__")
print(os.environ["GOMP_SPINCOUNT"])
"""


def test_services_set_their_openmp_spin_before_torch_loads():
    """Prefill spins briefly (its idle workers leave the cores to decode), decode as long as libgomp's
    default (its forwards follow each other)."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    env["PYTHONPATH"] = os.getcwd()
    for service, spins in (("decode_service", "300000"), ("prefill_service", "10000")):
        out = subprocess.run(
            [sys.executable, "-c", CHECK_SPIN, service],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=True,
        ).stdout
        assert out.strip().splitlines()[-1] == spins, (service, out)
    env["GOMP_SPINCOUNT"] = "123"  # an operator's own setting wins
    out = subprocess.run(
        [sys.executable, "-c", CHECK_SPIN, "decode_service"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    ).stdout
    assert out.strip().splitlines()[-1] == "123"


def test_a_stream_sets_its_count_back_when_something_changed_it():
    """intra_op.hold: the forward stream checks its count before each piece of work (in the decode
    service something dropped it to 1 a few forwards in, and every later forward ran on one core)."""
    import torch

    from common.engine.streams import WorkerStream

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        stream = WorkerStream("hold")
    finally:
        torch.set_num_threads(before)
    seen = []
    stream.submit(lambda: seen.append(torch.get_num_threads()))
    stream.submit(lambda: torch.set_num_threads(1))  # as the unknown cause does
    stream.submit(lambda: seen.append(torch.get_num_threads()))
    stream.synchronize(timeout=30)
    stream.close()
    assert seen == [2, 2] and stream._restored == 1


CHECK_NICE = r"""
import os, sys, threading
from decode_service.__main__ import main
base = os.getpriority(os.PRIO_PROCESS, 0)
try:
    main(["--model-path", sys.argv[1], "--prefill-addr", "127.0.0.1:1", "--cpu-nice", sys.argv[2]])
except BaseException as e:  # SystemExit for a refused flag; the missing checkpoint's error after the step
    print("exit:", e)
seen = []
t = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
t.start()
t.join()
print(os.getpriority(os.PRIO_PROCESS, 0) - base, seen[0] - base)
"""


def test_decode_lowers_its_cpu_priority_before_its_threads_start(tmp_path):
    """--cpu-nice N (a CPU host shared with prefill: prefill first): decode's process, and every thread
    it starts after (the model's OpenMP pool, the server's), runs N nice levels lower; out of 0-19 the
    start refuses it. Here the model folder does not exist, so the start ends right after the step."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    missing = str(tmp_path / "no-model")

    def run(nice: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", CHECK_NICE, missing, nice], capture_output=True, text=True, timeout=120, env=env
        )
        return out.stdout.strip().splitlines()

    assert run("3")[-1] == "3 3"
    assert run("0")[-1] == "0 0"
    out = run("25")
    assert out[-2] == "exit: --cpu-nice takes 0 to 19, got 25" and out[-1] == "0 0"
