"""Faults under load: injected handoff failures and stalls, client cancels, a stopped replica, SIGTERM
with streams open. Every call ends with a result or a status, results stay exact, nothing leaks."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.tools.procs import free_port, wait_serving
from decode_service.config import DecodeConfig
from decode_service.server import DecodeService
from prefill_service.config import PrefillConfig
from prefill_service.fault_injection import FaultInjector, FaultPlan
from prefill_service.server import PrefillService
from tests.decode_harness import check_idle_books
from tests.grpc_harness import AttemptLog, FirstTokenTap, needs_mooncake
from tests.oracle import hf_greedy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _request(prompt, n, rid, stream=True):
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        stream=stream,
        sampling_params=pb.SamplingParams(max_new_tokens=n, ignore_eos=True),
    )


def _ids(responses) -> list[int]:
    ids, complete = [], None
    for r in responses:
        if r.HasField("chunk"):
            ids.extend(r.chunk.token_ids)
        else:
            complete = r.complete
    return ids or list(complete.output_ids)


def _balanced(decode: DecodeService, replicas=()) -> None:
    deadline = time.time() + 20
    while not decode.scheduler.idle or any(r.num_running or r.num_queued() for r in replicas):
        assert time.time() < deadline, "services never went idle"
        time.sleep(0.02)
    time.sleep(0.1)
    check_idle_books(decode.scheduler)
    for r in replicas:
        r.worker.check_idle_integrity()  # every used KV slot is the prefix cache's, each once; no lock left


def test_fault_plan_parsing():
    assert FaultPlan.parse("fail=0.05,stall=0.02,seed=3") == FaultPlan(0.05, 0.02, 3)
    assert not FaultPlan.parse(None).active
    for bad in ("fail=2", "explode=0.1", "fail=0.7,stall=0.7"):
        with pytest.raises(ValueError, match="inject-faults"):
            FaultPlan.parse(bad)


def test_300_requests_with_injected_faults_and_cancels(checkpoint):
    path = checkpoint("llama")
    faults = [FaultInjector(FaultPlan.parse(f"fail=0.05,stall=0.02,seed={i}")) for i in range(2)]
    config = PrefillConfig(path, port=0, debug_checks=True, max_chunk_bytes=1024)
    replicas = [PrefillService(config, hooks=hooks).start() for hooks in faults]
    decode = DecodeService(
        DecodeConfig(
            path,
            prefill_addr=",".join(r.address for r in replicas),
            port=0,
            debug_checks=True,
            prefill_progress_timeout_s=1.0,
        )
    ).start()
    rng = random.Random(0)
    prompts = [[5 + (7 * i + j) % 200 for j in range(3 + 5 * i)] for i in range(12)]
    refs = {i: hf_greedy(path, p, 24) for i, p in enumerate(prompts)}
    plan = [(rng.randrange(12), rng.randrange(4, 25), rng.random() < 0.5, rng.random() < 0.1) for _ in range(300)]
    stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(decode.address))
    attempts = AttemptLog(decode.prefill)

    def one(k):
        p, n, stream, cancel = plan[k]
        call = stub.Generate(_request(prompts[p], n, f"load{k}", stream), timeout=60)
        if cancel:  # cancel at a random moment: before, during or after the first messages
            threading.Timer(rng.random() * 0.2, call.cancel).start()
        try:
            ids = _ids(call)
        except grpc.RpcError as e:
            return e.code()
        assert ids == refs[p][:n], f"request {k} is not exact"
        return "ok"

    try:
        with futures.ThreadPoolExecutor(32) as pool:
            outcomes = list(pool.map(one, range(300)))
        counts = {o: outcomes.count(o) for o in set(outcomes)}
        assert set(counts) <= {"ok", grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE}, counts
        for k, outcome in enumerate(outcomes):  # exact unless cancelled or every replica's attempt broke
            tried = attempts.of(f"load{k}")
            if outcome == grpc.StatusCode.UNAVAILABLE:
                assert tried and "ok" not in tried, (k, tried)  # each replica it reached broke it
            elif not plan[k][3]:  # never cancelled: a broken attempt was retried to an exact result
                assert outcome == "ok" and tried[-1] == "ok", (k, outcome, tried)
        recovered = [rid for rid in attempts.recovered() if outcomes[int(rid[4:])] == "ok"]
        injected = sum(sum(hooks.injected.values()) for hooks in faults)
        assert injected >= 5 and len(recovered) >= 5, (injected, recovered)  # retries that delivered, exactly
        assert decode.prefill.retries >= len(recovered)
        print(f"faults: {injected} injected, {len(recovered)} requests recovered by a retry, {counts}")
        _balanced(decode, replicas)
        assert stub.HealthCheck(pb.HealthCheckRequest()).healthy
    finally:
        decode.stop()
        for r in replicas:
            r.stop()


def _prefill_proc(path: str, port: int, *extra: str) -> subprocess.Popen:
    """A prefill replica process; `extra` may hold bench/drill_prefill.py's hook flags."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.drill_prefill",
            "--model-path",
            path,
            "--port",
            str(port),
            "--torch-threads",
            "1",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("transfer", ["grpc", pytest.param("mooncake", marks=needs_mooncake)])
def test_calls_on_a_stopped_replica_are_retried_elsewhere(checkpoint, transfer):
    """A replica frozen mid-handoff (with mooncake: mid-transfer, a write that never completes)."""
    path = checkpoint("llama")
    ports = [free_port(), free_port()]
    flags = ("--max-chunk-bytes", "512", "--kv-message-delay-s", "0.05", "--disaggregation-transfer-backend")
    private = ("--disaggregation-network-private",) if transfer == "mooncake" else ()  # loopback only
    procs = {p: _prefill_proc(path, p, *flags, transfer, *private) for p in ports}
    decode = None
    try:
        for port, proc in procs.items():
            wait_serving(f"127.0.0.1:{port}", proc)
        addrs = ",".join(f"127.0.0.1:{p}" for p in ports)
        config = DecodeConfig(
            path,
            prefill_addr=addrs,
            port=0,
            prefill_progress_timeout_s=3.0,
            disaggregation_transfer_backend=transfer,
            disaggregation_network_private=bool(private),
        )
        decode = DecodeService(config).start()
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(decode.address))
        prompt = list(range(5, 45))
        attempts, tap, stopped = AttemptLog(decode.prefill), FirstTokenTap(decode.prefill), []

        def stop_its_replica(rid):  # as the first token arrives: its replica is mid-handoff (40 KV chunks follow)
            port = int(decode.prefill.replica_of(rid).rsplit(":", 1)[1])
            os.kill(procs[port].pid, signal.SIGSTOP)
            stopped.append(port)

        tap.hooks["wedge"] = stop_its_replica
        call = stub.Generate(_request(prompt, 8, "wedge"), timeout=60)
        first = next(call)
        rest = _ids(call)
        assert list(first.chunk.token_ids) + rest == hf_greedy(path, prompt, 8)
        # no clock bound: the wedged call was cancelled by the progress watchdog (CANCELLED, not the
        # call's own deadline) and re-prefilled on the other replica
        assert len(stopped) == 1 and attempts.of("wedge") == ["CANCELLED", "ok"], attempts.of("wedge")
        assert decode.prefill.retries == 1
        _balanced(decode)
    finally:
        if decode is not None:
            decode.stop()
        for proc in procs.values():
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


def _smg(decode_addr: str) -> tuple[subprocess.Popen, str]:
    from tests.test_smg_gateway import _smg_binary

    port = free_port()
    proc = subprocess.Popen(
        [
            _smg_binary(),
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--worker-urls",
            f"grpc://{decode_addr}",
            "--worker-startup-check-interval",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base, deadline = f"http://127.0.0.1:{port}", time.time() + 60
    while True:
        try:
            if '"ready"' in urllib.request.urlopen(f"{base}/readiness", timeout=2).read().decode():
                return proc, base
        except OSError:
            pass
        assert time.time() < deadline and proc.poll() is None, "smg did not become ready"
        time.sleep(0.3)


def test_sigterm_with_open_streams_and_smg_exits_within_the_grace_period(checkpoint):
    path = checkpoint("llama")
    pport, dport = free_port(), free_port()
    prefill = _prefill_proc(path, pport, "--max-chunk-bytes", "256", "--kv-message-delay-s", "0.5")
    decode = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "decode_service",
            "--model-path",
            path,
            "--port",
            str(dport),
            "--prefill-addr",
            f"127.0.0.1:{pport}",
            "--torch-threads",
            "1",
            "--shutdown-grace-s",
            "1",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    smg = None
    try:
        wait_serving(f"127.0.0.1:{pport}", prefill)
        wait_serving(f"127.0.0.1:{dport}", decode)
        smg, base = _smg(f"127.0.0.1:{dport}")
        ended = {}

        def http_stream():  # a streaming completion through the gateway, held open by the slow handoff
            body = {
                "model": os.path.basename(path),
                "prompt": "hello there",
                "max_tokens": 200,
                "stream": True,
                "ignore_eos": True,
            }
            req = urllib.request.Request(
                f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    for _ in resp:
                        pass
                ended["http"] = "closed"
            except TimeoutError:  # nothing for 30 s: the gateway left the stream hanging
                ended["http"] = "timed out"
            except OSError as e:
                ended["http"] = f"closed ({type(e).__name__})"

        reader = threading.Thread(target=http_stream)
        reader.start()
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(f"127.0.0.1:{dport}"))
        calls = [stub.Generate(_request(list(range(5, 40)), 50, f"open{i}"), timeout=30) for i in range(4)]
        next(calls[0])  # streams are open and one is mid-handoff
        deadline = time.time() + 10
        while stub.GetLoads(pb.GetLoadsRequest()).loads[0].num_total_reqs < 5:  # the gateway's call too
            assert time.time() < deadline, "the gateway's request never reached decode"
            time.sleep(0.05)
        decode.send_signal(signal.SIGTERM)
        # no clock bound: the open streams would take 35 s or more (70 KV chunks at 0.5 s each), so exiting
        # while they are open (each ends UNAVAILABLE below) is what shows the 1 s grace was kept;
        # this timeout only catches a decode that never exits
        decode.wait(timeout=60)
        assert decode.returncode == 0, decode.stderr.read()
        for c in calls:  # each stream ended with a status, not silence
            with pytest.raises(grpc.RpcError) as err:
                _ids(c)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        reader.join(60)  # its reads time out after 30 s at most
        assert ended.get("http", "").startswith("closed"), f"the gateway's stream hung: {ended}"
        assert "Traceback" not in decode.stderr.read()
        prefill.send_signal(signal.SIGTERM)
        prefill.wait(timeout=10)
    finally:
        for proc in (decode, prefill, smg):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_killing_a_prefill_process_under_load_then_restarting_it(checkpoint):
    path = checkpoint("llama")
    ports = [free_port(), free_port()]
    extra = ("--max-chunk-bytes", "1024", "--kv-message-delay-s", "0.01")
    procs = {p: _prefill_proc(path, p, *extra) for p in ports}
    decode = None
    try:
        for port, proc in procs.items():
            wait_serving(f"127.0.0.1:{port}", proc)
        decode = DecodeService(
            DecodeConfig(path, prefill_addr=",".join(f"127.0.0.1:{p}" for p in ports), port=0, debug_checks=True)
        ).start()
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(decode.address))
        prompts = [[5 + 3 * i + j for j in range(6 + 4 * i)] for i in range(8)]
        refs = [hf_greedy(path, p, 12) for p in prompts]
        done = threading.Semaphore(0)

        def one(k):
            try:
                ids = _ids(stub.Generate(_request(prompts[k % 8], 12, f"kill{k}"), timeout=60))
            except grpc.RpcError as e:
                return e.code()
            finally:
                done.release()
            assert ids == refs[k % 8], f"request {k} is not exact"
            return "ok"

        victim, survivor = ports
        with futures.ThreadPoolExecutor(8) as pool:
            pending = [pool.submit(one, k) for k in range(40)]
            for _ in range(10):
                done.acquire()
            procs[victim].kill()  # mid-load: some calls are streaming from it
            procs[victim].wait()
            outcomes = [f.result() for f in pending]
        assert set(outcomes) <= {"ok", grpc.StatusCode.UNAVAILABLE} and outcomes.count("ok") >= 35, outcomes
        _balanced(decode)
        procs[victim] = _prefill_proc(path, victim, *extra)  # restart on the same port
        wait_serving(f"127.0.0.1:{victim}", procs[victim])
        procs[survivor].kill()  # from now on only the restarted replica can serve
        procs[survivor].wait()
        deadline = time.time() + 5
        while True:
            try:
                assert _ids(stub.Generate(_request(prompts[0], 12, "after"), timeout=30)) == refs[0]
                break
            except grpc.RpcError as e:  # health may not have caught up with the kill yet
                assert time.time() < deadline, e
                time.sleep(0.2)
        _balanced(decode)
    finally:
        if decode is not None:
            decode.stop()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
