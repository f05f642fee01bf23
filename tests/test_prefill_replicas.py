"""Several prefill replicas behind one decode: balancing, retry on a broken handoff, no replica left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.tools.procs import free_port, wait_serving
from decode_service.config import DecodeConfig
from decode_service.server import DecodeService
from prefill_service.config import PrefillConfig
from prefill_service.hooks import Delays
from prefill_service.server import PrefillService
from tests.decode_harness import check_idle_books
from tests.grpc_harness import AttemptLog, FirstTokenTap, needs_mooncake
from tests.oracle import hf_greedy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _generate(stub, prompt, n, rid, stream=True):
    return stub.Generate(
        pb.GenerateRequest(
            request_id=rid,
            tokenized=pb.TokenizedInput(input_ids=prompt),
            stream=stream,
            sampling_params=pb.SamplingParams(max_new_tokens=n, ignore_eos=True),
        )
    )


def _tokens(responses) -> tuple[list[int], str]:
    ids, reason = [], None
    for r in responses:
        if r.HasField("chunk"):
            ids.extend(r.chunk.token_ids)
        else:
            reason = r.complete.finish_reason
    return ids, reason


def _wait_idle(decode: DecodeService) -> None:
    deadline = time.time() + 20
    while not decode.scheduler.idle:
        assert time.time() < deadline
        time.sleep(0.01)
    check_idle_books(decode.scheduler)


def test_two_replicas_both_get_work(checkpoint):
    path = checkpoint("qwen2")
    replicas = [
        PrefillService(PrefillConfig(path, port=0, max_chunk_bytes=2048), hooks=Delays(kv_message_s=0.01)).start()
        for _ in range(2)
    ]
    decode = DecodeService(DecodeConfig(path, prefill_addr=",".join(r.address for r in replicas), port=0)).start()
    try:
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(decode.address))
        prompts = [[5 + i, 6 + i, 7 + i, 8] for i in range(12)]
        with futures.ThreadPoolExecutor(12) as pool:
            results = list(pool.map(lambda i: _tokens(_generate(stub, prompts[i], 6, f"r{i}")), range(12)))
        for p, (ids, reason) in zip(prompts, results):
            assert ids == hf_greedy(path, p, 6) and reason == "length"
        assert all(r.num_prefilled > 0 for r in replicas), [r.num_prefilled for r in replicas]
        assert sum(r.num_prefilled for r in replicas) == 12
        _wait_idle(decode)
    finally:
        decode.stop()
        for r in replicas:
            r.stop()


def _start_prefill(path: str, port: int, transfer: str = "grpc") -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.drill_prefill",  # the prefill service with test hooks from its flags
            "--disaggregation-transfer-backend",
            transfer,
            *(["--disaggregation-network-private"] if transfer == "mooncake" else []),  # loopback only
            "--model-path",
            path,
            "--port",
            str(port),
            "--torch-threads",
            "1",
            "--max-chunk-bytes",
            "512",
            "--kv-message-delay-s",  # 20 KV messages: the victim is still mid-handoff 2 s after its first
            "0.1",  # token, so the kill lands first even when the test's thread waits on a busy 2-core host
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc


@pytest.mark.parametrize("transfer", ["grpc", pytest.param("mooncake", marks=needs_mooncake)])
def test_killing_prefill_processes_mid_handoff(checkpoint, transfer):
    """With mooncake the victim dies while it writes KV into decode's slots: the retry rewrites them,
    and a later request that reuses the slots is still exact."""
    path = checkpoint("llama")
    ports = [free_port(), free_port()]
    procs = {port: _start_prefill(path, port, transfer) for port in ports}
    decode = DecodeService(
        DecodeConfig(
            path,
            prefill_addr=",".join(f"127.0.0.1:{p}" for p in ports),
            port=0,
            prefill_wait_s=1.0,
            disaggregation_transfer_backend=transfer,
            disaggregation_network_private=transfer == "mooncake",
        )
    ).start()
    try:
        for port, proc in procs.items():
            wait_serving(f"127.0.0.1:{port}", proc)
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(decode.address))
        deadline = time.time() + 10  # decode's channels reconnect to replicas that came up after it
        while not stub.HealthCheck(pb.HealthCheckRequest()).healthy:
            assert time.time() < deadline, "decode never saw the replicas serving"
            time.sleep(0.05)
        prompt = list(range(5, 25))
        attempts, tap, killed = AttemptLog(decode.prefill), FirstTokenTap(decode.prefill), []

        def kill_its_replica(rid):  # as the first token arrives: its replica is mid-handoff (20 KV chunks follow)
            port = int(decode.prefill.replica_of(rid).rsplit(":", 1)[1])
            procs[port].send_signal(signal.SIGKILL)
            procs[port].wait()
            killed.append(port)

        # 1. the replica serving the handoff dies after the first token: the other one finishes it
        tap.hooks["survive"] = kill_its_replica
        call = _generate(stub, prompt, 10, "survive")
        first = next(call)
        rest, reason = _tokens(call)
        assert list(first.chunk.token_ids) + rest == hf_greedy(path, prompt, 10) and reason == "length"
        [victim] = killed
        outcomes = attempts.of("survive")  # the handoff was broken, then re-prefilled on the survivor
        assert len(outcomes) == 2 and outcomes[0] != "ok" and outcomes[1] == "ok", (outcomes, "killed too late?")
        assert decode.prefill.retries == 1
        _wait_idle(decode)
        # 2. the last replica dies mid-handoff: UNAVAILABLE, nothing leaks, decode stays up
        survivor = next(p for p in ports if p != victim)
        tap.hooks["orphan"] = kill_its_replica
        call = _generate(stub, prompt, 10, "orphan")
        next(call)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no prefill replica left" in err.value.details()
        assert killed == [victim, survivor] and "ok" not in attempts.of("orphan"), attempts.of("orphan")
        _wait_idle(decode)
        deadline = time.time() + 10
        while stub.HealthCheck(pb.HealthCheckRequest()).healthy:
            assert time.time() < deadline, "decode still reports healthy with no prefill up"
            time.sleep(0.1)
        # 3. a replica comes back: decode serves again
        procs[survivor] = _start_prefill(path, survivor, transfer)
        wait_serving(f"127.0.0.1:{survivor}", procs[survivor])
        deadline = time.time() + 10
        while not stub.HealthCheck(pb.HealthCheckRequest()).healthy:
            assert time.time() < deadline, "decode did not recover"
            time.sleep(0.1)
        ids, _ = _tokens(_generate(stub, prompt, 4, "back"))
        assert ids == hf_greedy(path, prompt, 4)
        _wait_idle(decode)
    finally:
        decode.stop()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_re_prefill_continues_the_seeded_stream(checkpoint):
    """A retry prefills prompt + sent tokens and samples output position len(sent): same tokens."""
    from common.engine.colocated import ColocatedLoop
    from common.engine.handoff import HandoffRequest
    from common.engine.model_runner import ModelRunner, RunnerArgs
    from common.engine.sampling import SamplingParams
    from prefill_service.worker import PrefillWorker

    path = checkpoint("qwen3")
    args = RunnerArgs(path, max_total_tokens=512, max_running_requests=4)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=77, ignore_eos=True)
    prompt = [9, 8, 7, 6, 5]
    [ref] = ColocatedLoop(ModelRunner(args), 16).generate([prompt], params)
    worker = PrefillWorker(ModelRunner(args), 16)
    for sent in range(4):
        [h] = worker.prefill([HandoffRequest("r", prompt + ref.output[:sent], params, 77, first_position=sent)])
        assert h.first_token == ref.output[sent] and h.first_position == sent and h.prompt_len == len(prompt) + sent


class _Health:
    """A stand-in health stub: answers SERVING / NOT_SERVING or raises an RpcError with a code."""

    def __init__(self):
        self.answer = "SERVING"

    def Check(self, request, timeout):
        from grpc_health.v1 import health_pb2

        if isinstance(self.answer, grpc.StatusCode):
            code = self.answer

            class Failed(grpc.RpcError):
                def code(self):
                    return code

            raise Failed()
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.ServingStatus.Value(self.answer))


def test_a_busy_replica_stays_serving_for_a_grace_but_a_refused_one_does_not():
    """A health check that times out keeps the last SERVING answer for BUSY_GRACE_S (a replica busy
    streaming KV on shared cores answered late, and every request picking it failed after 3 s);
    a refused connection or NOT_SERVING ends it at once, and so does the grace running out."""
    from decode_service import prefill_replicas

    replica = prefill_replicas.Replica(f"127.0.0.1:{free_port()}")
    replica.health = health = _Health()
    try:
        assert replica.serving()
        health.answer = grpc.StatusCode.DEADLINE_EXCEEDED
        assert replica.serving()  # busy: still serving
        replica.serving_at -= prefill_replicas.BUSY_GRACE_S
        assert not replica.serving()  # busy for longer than the grace: taken as down
        health.answer = "SERVING"
        assert replica.serving()
        health.answer = grpc.StatusCode.UNAVAILABLE
        assert not replica.serving()
        health.answer = grpc.StatusCode.DEADLINE_EXCEEDED
        assert not replica.serving()  # a time-out after a refusal proves nothing
        health.answer = "NOT_SERVING"
        assert not replica.serving()
    finally:
        replica.channel.close()
