"""Run a prefill + decode service pair in-process on loopback (port 0) and talk to it over gRPC."""

from __future__ import annotations

import os
import tempfile
import threading
import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.kv_transfer import mooncake
from decode_service.config import DecodeConfig
from decode_service.hooks import DecodeHooks
from decode_service.server import DecodeService
from prefill_service.config import PrefillConfig
from prefill_service.hooks import PrefillHooks
from prefill_service.server import PrefillService
from tests.decode_harness import check_idle_books


def wait_for(what: str, cond, timeout: float = 20.0) -> None:
    """Poll `cond` until true; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def assert_invalid_fields(pair, prompt: list[int], cases: list[tuple[dict, str]]) -> None:
    """Each (GenerateRequest keywords, field) is refused with INVALID_ARGUMENT naming the field."""
    for kw, field in cases:
        with pytest.raises(grpc.RpcError) as err:
            pair.collect(pair.generate(prompt, 4, rid="bad", **kw))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kw
        assert field in err.value.details(), (kw, err.value.details())


def held_worker(service: PrefillService) -> tuple[threading.Event, threading.Event]:
    """Latch a prefill service's worker step shut: (in_step, latch); its first step waits for latch."""
    in_step, latch, step = threading.Event(), threading.Event(), service.worker.step

    def held_step(*args, **kwargs):
        in_step.set()
        assert latch.wait(60), "the test never released the worker"
        return step(*args, **kwargs)

    service.worker.step = held_step
    return in_step, latch


MOONCAKE_MISSING = mooncake.available()  # None where the transfer engine loads (set-up installs it)
needs_mooncake = pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=f"no transfer engine: {MOONCAKE_MISSING}")


def _shm_dir() -> str:
    """The shm backend's folder in tests: /dev/shm where it has room (a container's default is 64 MB),
    else a temporary folder (file-backed maps: slower, the same code)."""
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize >= 1 << 30:
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="disagg-shm-")


SHM_DIR = _shm_dir()


class GrpcPair:
    """`transfer`: the KV data plane of both services (--disaggregation-transfer-backend);
    `prefill_hooks`: the prefill service's test hooks (prefill_service/hooks.py), e.g. Delays;
    `decode_hooks`: the decode service's (decode_service/hooks.py), e.g. drafts planted on every rank."""

    def __init__(
        self,
        path: str,
        overlap: bool = True,
        prefill_kw: dict | None = None,
        decode_kw: dict | None = None,
        transfer: str = "grpc",
        prefill_hooks: PrefillHooks | None = None,
        decode_hooks: DecodeHooks | None = None,
    ):
        common = {"disaggregation_transfer_backend": transfer, "disaggregation_shm_dir": SHM_DIR}
        common["disaggregation_network_private"] = transfer == "mooncake"  # loopback: nothing else reaches it
        prefill_kw = {**common, **(prefill_kw or {})}  # explicit flags win
        decode_kw = {**common, **(decode_kw or {})}
        config = PrefillConfig(path, port=0, debug_checks=True, **prefill_kw)
        self.prefill = PrefillService(config, hooks=prefill_hooks).start()
        self.decode = DecodeService(
            DecodeConfig(
                path,
                prefill_addr=self.prefill.address,
                port=0,
                debug_checks=True,
                disable_overlap_schedule=not overlap,
                **decode_kw,
            ),
            hooks=decode_hooks,
        ).start()
        self.channel = grpc.insecure_channel(self.decode.address)
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        deadline = time.time() + 20
        while not self.stub.HealthCheck(pb.HealthCheckRequest()).healthy:
            assert time.time() < deadline, "decode service never became healthy"
            time.sleep(0.05)

    def generate(self, prompt, max_new_tokens=None, stream=False, rid="r", **sampling):
        sp = pb.SamplingParams(**sampling)
        if max_new_tokens is not None:
            sp.max_new_tokens = max_new_tokens
        return self.stub.Generate(
            pb.GenerateRequest(
                request_id=rid, tokenized=pb.TokenizedInput(input_ids=prompt), sampling_params=sp, stream=stream
            )
        )

    def collect(self, responses) -> tuple[list[int], pb.GenerateComplete]:
        """Streamed ids (or the Complete's ids when not streaming) and the Complete."""
        streamed, complete = [], None
        for r in responses:
            assert complete is None, "a message after the Complete"
            if r.HasField("chunk"):
                streamed.extend(r.chunk.token_ids)
            else:
                complete = r.complete
        assert complete is not None
        return (streamed if streamed else list(complete.output_ids)), complete

    def check_against_oracle(self, path: str, prompts, max_new_tokens: int, rid: str = "o") -> None:
        """Each prompt (every other one streamed) gives HF greedy's tokens exactly."""
        from tests.oracle import hf_greedy

        for i, p in enumerate(prompts):
            ids, _ = self.collect(self.generate(p, max_new_tokens, stream=i % 2 == 0, rid=f"{rid}{i}", ignore_eos=True))
            assert ids == hf_greedy(path, p, max_new_tokens), f"prompt {i}"

    def wait_idle(self, timeout: float = 20) -> None:
        sched = self.decode.scheduler
        deadline = time.time() + timeout
        while not sched.idle:
            assert time.time() < deadline, "decode scheduler never went idle"
            time.sleep(0.01)
        time.sleep(0.05)
        check_idle_books(sched)

    def close(self) -> None:
        try:
            self.wait_idle()
        finally:
            self.channel.close()
            self.decode.stop()
            self.prefill.stop()


def _client_rid(rid: str) -> str:
    return rid.rsplit("#", 1)[0]  # decode's own id is the caller's request_id + "#n"


class AttemptLog:
    """Every prefill attempt of a decode service's PrefillClient, by the caller's request id: "ok" (the
    handoff arrived whole) or what ended it (a gRPC status name, or "ValueError"). A request whose first
    attempt failed and whose last is "ok" was retried successfully."""

    def __init__(self, client):
        self.attempts: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        stream = client._stream

        def logged(replica, request, *rest):
            try:
                handoff = stream(replica, request, *rest)
            except grpc.RpcError as e:
                self._add(request.rid, e.code().name)
                raise
            except ValueError:
                self._add(request.rid, "ValueError")
                raise
            self._add(request.rid, "ok")
            return handoff

        client._stream = logged

    def _add(self, rid: str, outcome: str) -> None:
        with self._lock:
            self.attempts.setdefault(_client_rid(rid), []).append(outcome)

    def of(self, rid: str) -> list[str]:
        with self._lock:
            return list(self.attempts.get(rid, []))

    def recovered(self) -> list[str]:
        """Request ids whose first attempt failed and a later one delivered the handoff."""
        with self._lock:
            return [rid for rid, a in self.attempts.items() if a[0] != "ok" and a[-1] == "ok"]


class FirstTokenTap:
    """Runs `hooks[request_id](decode_rid)` on the prefill-call thread as the request's first token
    arrives from its replica, before it is passed on: the replica serving it is known (`replica_of`) and
    is mid-handoff (its KV follows the first token), so a test can stop or kill it at that event."""

    def __init__(self, client):
        self._sink, self.hooks = client.sink, {}
        client.sink = self

    def __getattr__(self, name):
        return getattr(self._sink, name)

    def deliver_first_token(self, rid, token, position):
        hook = self.hooks.pop(_client_rid(rid), None)
        if hook is not None:
            hook(rid)
        return self._sink.deliver_first_token(rid, token, position)
