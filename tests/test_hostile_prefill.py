"""A hostile prefill replica: every bad reply fails its own request, never the decode service.

In process, bad handoffs go straight into the scheduler's inbox (out-of-vocabulary tokens, KV of the
wrong shape, an unsound EAGLE seed, a record whose fields raise while handled). Over gRPC, a fake
prefill replica on 127.0.0.1 forwards each call to a real one and tampers with the reply stream
(first tokens, KV chunks, written notices, the record, the draft seed). Each time the bad request
ends with an error, the pools balance, and the next request gives HF greedy's tokens exactly.
Decode's liveness turns NOT_SERVING when its scheduler dies, and only then.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent import futures

import grpc
import pytest
import torch
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.engine.draft_runner import SpecArgs
from common.engine.sampling import SamplingParams
from common.tools.eagle_checkpoint import build as build_head
from common.wire import tensor_codec
from common.wire.proto_gen import prefill_pb2_grpc
from decode_service.config import DecodeConfig
from decode_service.prefill_client import SERVICE_NAME
from decode_service.server import LIVENESS, DecodeService
from prefill_service.config import PrefillConfig
from prefill_service.server import PrefillService
from tests.decode_harness import ManualPair
from tests.grpc_harness import SHM_DIR, GrpcPair, wait_for
from tests.oracle import hf_greedy

PROMPT, GOOD = [5, 6, 7, 8, 9], list(range(10, 30))
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
K8S_DECODE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy", "k8s", "decode.yaml")
EAGLE_FLAGS = dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_num_draft_tokens=4)


# ---- in process: bad handoffs straight into the scheduler --------------------------------------------
def _in_process(pair: ManualPair, path: str, spoil) -> str:
    """Submit PROMPT (spoiled by `spoil(handoff, pair)`, which may post to the inbox itself) and GOOD;
    run to idle; GOOD must be exact and the pools balance (pair.close). Returns the bad one's error."""
    pair.submit("bad", PROMPT, PARAMS)
    pair.submit("good", GOOD, PARAMS)
    pair.scheduler.step()  # admission: both reserved
    handoffs = {h.rid: h for h in pair.prefill_worker.prefill(pair.pending)}
    pair.pending.clear()
    bad = spoil(handoffs["bad"], pair)
    for h in (bad, handoffs["good"]):
        if h is not None:
            pair.scheduler.inbox.deliver_handoff(h)
    pair.close()  # runs to idle (a scheduler-fatal error raises here), checks integrity
    assert pair.scheduler.alive and pair.out.reasons == {"bad": "error", "good": "length"}
    assert pair.out.tokens["good"] == hf_greedy(path, GOOD, PARAMS.max_new_tokens)
    return pair.out.finishes["bad"].error


def _vocab(pair) -> int:
    return pair.scheduler.info.vocab_size


def _first_token_message(h, pair):
    pair.scheduler.inbox.deliver_first_token(h.rid, _vocab(pair))  # streamed before the record
    return h


def _kv_chunk_of_wrong_width(h, pair):
    k = torch.stack(h.k)[:, :, :, :-1]  # head_dim one short
    pair.scheduler.inbox.deliver_kv(h.rid, 0, 0, k, k.clone())
    return None  # the record never comes: the chunk alone must fail it


SPOILERS = {
    "first token in the record": (lambda h, pair: dataclasses.replace(h, first_token=_vocab(pair)), "vocabulary"),
    "first token streamed": (_first_token_message, "vocabulary"),
    "cached tokens": (lambda h, pair: dataclasses.replace(h, cached_tokens=h.prompt_len + 1), "cached tokens"),
    "KV chunk of the wrong width": (_kv_chunk_of_wrong_width, "KV chunk"),
    "record KV of the wrong width": (
        lambda h, pair: dataclasses.replace(h, k=[t[..., :-1] for t in h.k], v=[t[..., :-1] for t in h.v]),
        "KV chunk",
    ),
    "record KV not tensors": (lambda h, pair: dataclasses.replace(h, k=[None] * len(h.k)), "bad reply"),
}


@pytest.mark.parametrize("case", list(SPOILERS))
def test_bad_handoff_in_process_fails_only_its_request(checkpoint, case):
    path = checkpoint("llama")
    spoil, expected = SPOILERS[case]
    assert expected in _in_process(ManualPair(path), path, spoil)


def _seed(**change):
    return lambda h, pair: dataclasses.replace(h, **{k: f(getattr(h, k), pair) for k, f in change.items()})


SEED_SPOILERS = {
    "hidden NaN": (_seed(draft_hidden=lambda t, _: torch.full_like(t, float("nan"))), "NaN"),
    "hidden of the wrong width": (_seed(draft_hidden=lambda t, _: t[:-1]), "draft hidden"),
    "hidden not floating": (_seed(draft_hidden=lambda t, _: t.to(torch.int64)), "draft hidden"),
    "top-k id out of the vocabulary": (_seed(draft_topk_ids=lambda t, pair: t + _vocab(pair)), "vocabulary"),
    "top-k p shape": (_seed(draft_topk_p=lambda t, _: t[:0]), "probabilities"),
}


@pytest.fixture(scope="module")
def eagle_head(checkpoint, tmp_path_factory):
    path = checkpoint("llama")
    return path, build_head(path, "EAGLE", str(tmp_path_factory.mktemp("eagle")))


@pytest.mark.parametrize("case", list(SEED_SPOILERS))
def test_unsound_eagle_seed_in_process_fails_only_its_request(eagle_head, case):
    path, head = eagle_head
    spoil, expected = SEED_SPOILERS[case]
    pair = ManualPair(path, spec=SpecArgs("EAGLE", head, 3, 1, 4))
    assert expected in _in_process(pair, path, spoil)


# ---- over gRPC: a fake prefill replica that tampers with a real one's replies ---------------------------
class HostilePrefill(prefill_pb2_grpc.PrefillServicer):
    """Forwards to `upstream`; a call whose input_ids are a key of `plan` has its reply stream
    rewritten by plan[ids](messages) (a generator of PrefillChunks)."""

    def __init__(self, upstream: str):
        self.channel = grpc.insecure_channel(upstream)
        self.stub = prefill_pb2_grpc.PrefillStub(self.channel)
        self.plan: dict[tuple, object] = {}
        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        prefill_pb2_grpc.add_PrefillServicer_to_server(self, self.server)
        status = health.HealthServicer()
        status.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(status, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Prefill(self, request, context):
        upstream = self.stub.Prefill(request)
        context.add_callback(upstream.cancel)
        yield from self.plan.get(tuple(request.input_ids), lambda messages: messages)(upstream)

    def GetLoad(self, request, context):
        return self.stub.GetLoad(request)

    def close(self) -> None:
        self.server.stop(0)
        self.channel.close()


def _rewrite(kind: str, fn):
    """A plan that passes every message through fn(message) if it carries `kind` (fn returns a list)."""
    return lambda messages: (m for message in messages for m in (fn(message) if message.HasField(kind) else [message]))


def _oov_first(vocab):
    """The first token (streamed and in the record) one past the vocabulary."""

    def fn(m):
        if m.HasField("first_token"):
            m.first_token.token_id = vocab
        elif m.HasField("record"):
            m.record.first_token = vocab
        return [m]

    return lambda messages: (m for message in messages for m in fn(message))


def _reshaped(m):
    m.kv.k.shape[:] = [*m.kv.k.shape[:2], m.kv.k.shape[2] * m.kv.k.shape[3], 1]  # same bytes, wrong shape
    return [m]


def _seed_field(name, change):
    def fn(m):
        t = tensor_codec.decode(m.record.draft_seed[name])
        m.record.draft_seed[name].CopyFrom(tensor_codec.encode(change(t)))
        return [m]

    return _rewrite("record", fn)


def _once(kind: str, fn):
    """fn applied to the first message carrying `kind` only."""
    seen = []

    def pick(m):
        if seen:
            return [m]
        seen.append(m)
        return fn(m)

    return _rewrite(kind, pick)


def _plans(vocab: int) -> dict:
    """name -> (plan, what the error says, backends it applies to)."""
    cached = lambda m: (setattr(m.record, "cached_tokens", m.record.prompt_len + 1), [m])[1]  # noqa: E731
    longer = lambda m: (setattr(m.record, "prompt_len", m.record.prompt_len + 1), [m])[1]  # noqa: E731
    return {
        "first token out of the vocabulary": (_oov_first(vocab), "vocabulary", ("grpc", "shm")),
        "second first token": (_rewrite("first_token", lambda m: [m, m]), "second first token", ("grpc",)),
        "record twice": (_rewrite("record", lambda m: [m, m]), "after its record", ("grpc", "shm")),
        "no record": (_rewrite("record", lambda m: []), "without a record", ("grpc",)),
        "record's prompt length": (_rewrite("record", longer), "record says", ("grpc",)),
        "record's cached tokens": (_rewrite("record", cached), "cached tokens", ("grpc",)),
        "KV chunk of the wrong shape": (_once("kv", _reshaped), "KV chunk", ("grpc",)),
        "KV chunk twice": (_once("kv", lambda m: [m, m]), "exactly once", ("grpc",)),
        "KV chunk missing": (_once("kv", lambda m: []), "exactly once", ("grpc",)),
        "written notice twice": (_once("written", lambda m: [m, m]), "exactly once", ("shm",)),
        "written notice missing": (_once("written", lambda m: []), "exactly once", ("shm",)),
    }


def _seed_plans(vocab: int) -> dict:
    return {
        "seed hidden NaN": (_seed_field("draft_hidden", lambda t: torch.full_like(t, float("nan"))), "NaN"),
        "seed hidden of the wrong width": (_seed_field("draft_hidden", lambda t: t[:-1]), "draft hidden"),
        "seed id out of the vocabulary": (_seed_field("draft_topk_ids", lambda t: t + vocab), "vocabulary"),
        "seed partial": (_rewrite("record", lambda m: (m.record.draft_seed.pop("draft_topk_p"), [m])[1]), "seed"),
    }


class HostilePair(GrpcPair):
    """A real prefill service behind a HostilePrefill, and a decode service that calls the fake."""

    def __init__(self, path: str, transfer: str, flags: dict | None = None):
        self.path, flags = path, flags or {}
        common = dict(flags, disaggregation_transfer_backend=transfer, disaggregation_shm_dir=SHM_DIR)
        common["disaggregation_network_private"] = transfer == "mooncake"  # loopback only
        self.prefill = PrefillService(PrefillConfig(path, port=0, debug_checks=True, max_chunk_bytes=2048, **common))
        self.prefill.start()
        self.fake = HostilePrefill(self.prefill.address)
        self.decode = DecodeService(
            DecodeConfig(path, prefill_addr=self.fake.address, port=0, debug_checks=True, **common)
        ).start()
        self.channel = grpc.insecure_channel(self.decode.address)
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        wait_for("decode healthy", self.decode.healthy)
        self.vocab = self.decode.model_config.vocab_size

    def check(self, plan, expected: str, prompt: list[int]) -> None:
        """`prompt` under `plan` fails with an error saying `expected`; the service then serves exactly."""
        self.fake.plan[tuple(prompt)] = plan
        with pytest.raises(grpc.RpcError) as failed:
            self.collect(self.generate(prompt, 8, rid="bad", ignore_eos=True))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        assert expected in failed.value.details()
        self.wait_idle()  # the pools balance, nothing leaked
        assert self.decode.scheduler.alive
        ids, _ = self.collect(self.generate(GOOD, 8, stream=True, rid="good", ignore_eos=True))
        assert ids == hf_greedy(self.path, GOOD, 8)

    def close(self) -> None:
        try:
            super().close()  # idle and balanced, then both services stop
        finally:
            self.fake.close()


@pytest.fixture(scope="module")
def hostile(checkpoint):
    pairs: dict[str, HostilePair] = {}

    def get(transfer: str, eagle: str | None = None) -> HostilePair:
        key = f"{transfer}/{eagle}"
        if key not in pairs:
            flags = dict(EAGLE_FLAGS, speculative_draft_model_path=eagle) if eagle else None
            pairs[key] = HostilePair(checkpoint("llama"), transfer, flags)
        return pairs[key]

    yield get
    for p in pairs.values():
        p.close()


CASES = [(name, backend) for name, (_, _, backends) in _plans(0).items() for backend in backends]


@pytest.mark.parametrize("name,transfer", CASES)
def test_hostile_prefill_replies_fail_only_their_request(hostile, name, transfer):
    pair = hostile(transfer)
    plan, expected, _ = _plans(pair.vocab)[name]
    pair.check(plan, expected, [3, len(name) % 7 + 1, *PROMPT])  # one prompt per case (the plan's key)


@pytest.mark.parametrize("name", list(_seed_plans(0)))
def test_hostile_eagle_seeds_fail_only_their_request(hostile, eagle_head, name):
    pair = hostile("grpc", eagle_head[1])
    plan, expected = _seed_plans(pair.vocab)[name]
    pair.check(plan, expected, [4, len(name) % 7 + 1, *PROMPT])


# ---- liveness -----------------------------------------------------------------------------------------
def test_liveness_turns_unhealthy_only_when_the_scheduler_dies(checkpoint):
    """No prefill replica: not ready, but live (a restart would not help). A dead scheduler: not live.
    deploy/k8s/decode.yaml's livenessProbe asks for that service on the gRPC port."""
    with open(K8S_DECODE) as f:
        deployment = next(d for d in yaml.safe_load_all(f) if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["grpc"] == {"port": container["ports"][0]["containerPort"], "service": LIVENESS}

    decode = DecodeService(DecodeConfig(checkpoint("llama"), prefill_addr="127.0.0.1:1", port=0)).start()
    channel = grpc.insecure_channel(decode.address)
    probe = health_pb2_grpc.HealthStub(channel)

    def status(service: str):
        return probe.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    try:
        SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        assert status(LIVENESS) == SERVING and status("") == NOT_SERVING  # no prefill replica: not ready, live

        def broken_step():
            raise RuntimeError("injected: the scheduler dies")

        decode.scheduler.step = broken_step
        decode.scheduler.inbox.wake.set()
        wait_for("liveness NOT_SERVING after the scheduler died", lambda: status(LIVENESS) == NOT_SERVING)
        assert not decode.scheduler.alive
    finally:
        channel.close()
        decode.stop()
