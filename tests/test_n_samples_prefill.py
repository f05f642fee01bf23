"""n > 1 on the prefill side and the wire: one prefill of the prompt, n first tokens drawn from the same
last-position logits (penalised, biased and masked once), draw i seeded with sample_seed(seed, i) at
the same output position, so each is what an n = 1 request with that seed draws (its logprobs too);
greedy draws are all the argmax; an n = 1 row beside them is unchanged. Over gRPC the PrebuiltRecord
carries the n - 1 more tokens (and logprobs) and decode's prefill_stream turns them into a Handoff that
passes check_record; a record with the wrong count or an out-of-vocabulary token is refused."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from common.engine.handoff import Handoff, HandoffRequest
from common.engine.logprobs import TokenLogprobs
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams, sample_seed
from common.wire.proto_gen import prefill_pb2_grpc
from decode_service import prefill_request
from decode_service.prefill_stream import HandoffStream
from prefill_service.config import PrefillConfig
from prefill_service.server import PrefillService
from prefill_service.worker import PrefillWorker
from tests.oracle import hf_logits

PROMPT, OTHER = [5, 6, 7, 8, 9, 5, 6], list(range(10, 30))
SEED, N = 1234, 3
CASES = {
    "plain": SamplingParams(temperature=1.0, top_k=50, n=N),
    "processed": SamplingParams(temperature=1.0, repetition_penalty=1.6, logit_bias={11: 100.0, 13: 100.0}, n=N),
    "logprobs": SamplingParams(temperature=1.0, return_logprob=True, top_logprobs_num=5, token_ids_logprob=(3,), n=N),
    "processed_logprobs": SamplingParams(
        temperature=1.0,
        repetition_penalty=1.6,
        logit_bias={11: 100.0, 13: 100.0},
        return_logprob=True,
        top_logprobs_num=5,
        token_ids_logprob=(11,),
        n=N,
    ),
}


@pytest.fixture(scope="module")
def worker(checkpoint):
    """No prefix cache: every prefill of a prompt runs the same forward (same logits)."""
    runner = ModelRunner(RunnerArgs(checkpoint("llama"), max_total_tokens=512, max_running_requests=8))
    return PrefillWorker(runner, chunk_size=64, radix_cache=False)


def _draws(h: Handoff) -> tuple[list[int], list]:
    """(first tokens, their logprobs) of every sample of a handoff."""
    return [h.first_token, *h.more_first_tokens], [h.first_logprobs, *h.more_first_logprobs]


def _singles(worker, sp: SamplingParams, beside: list[HandoffRequest] = ()) -> list[Handoff]:
    """Sample i of `sp` as an n = 1 request seeded sample_seed(SEED, i), prefilled with `beside`."""
    one = dataclasses.replace(sp, n=1)
    out = []
    for i in range(sp.n):
        r = HandoffRequest(f"s{i}", PROMPT, one, sample_seed(SEED, i))
        out.append(worker.prefill([r, *beside])[0])
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_n_draws_are_the_n_single_requests_with_derived_seeds(worker, case):
    sp = CASES[case]
    (h,) = worker.prefill([HandoffRequest("n", PROMPT, sp, SEED)])
    h.check_record(worker.runner.config.vocab_size)
    tokens, logprobs = _draws(h)
    singles = _singles(worker, sp)
    assert tokens == [s.first_token for s in singles]
    assert len(set(tokens)) > 1, "every draw was the same token: the seeds did not differ"
    if sp.return_logprob:
        assert len(h.more_first_logprobs) == N - 1
        assert logprobs == [s.first_logprobs for s in singles]
        assert all(len(lp.top) == 5 and len(lp.ids) == 1 for lp in logprobs)
    else:
        assert h.more_first_logprobs == () and h.first_logprobs is None
    if sp.logit_bias:  # the more draws were biased too: only the boosted ids come up
        assert set(tokens) <= set(sp.logit_bias), tokens
    worker.check_idle_integrity()


def test_n_draws_logprobs_are_of_the_raw_logits(worker, checkpoint):
    """With a penalty and a bias, every draw's logprobs (its token's, the top 5, token_ids_logprob's) are
    HF's log-softmax of the raw last-position logits, not of the penalised and biased ones it drew from."""
    sp = CASES["processed_logprobs"]
    (h,) = worker.prefill([HandoffRequest("n", PROMPT, sp, SEED)])
    ref = torch.log_softmax(hf_logits(checkpoint("llama"), PROMPT)[-1], dim=-1)
    vals, ids = ref.topk(5)
    assert not set(ids.tolist()) & set(sp.logit_bias)  # the raw top 5 hold no boosted id: the processed top 2 are
    tokens, logprobs = _draws(h)
    assert len(logprobs) == N and set(tokens) <= set(sp.logit_bias)
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        assert abs(lp.logprob - float(ref[t])) < 1e-4, (i, t, lp.logprob, float(ref[t]))
        assert [x for x, _ in lp.top] == ids.tolist(), (i, lp.top)
        assert max(abs(a - b) for (_, a), b in zip(lp.top, vals.tolist())) < 1e-4, (i, lp.top)
        assert abs(lp.ids[0] - float(ref[11])) < 1e-4, (i, lp.ids)


def test_n_beside_an_n1_request_leaves_it_unchanged(worker):
    sp = CASES["logprobs"]
    other = HandoffRequest("o", OTHER, SamplingParams(temperature=0.8, top_k=20, return_logprob=True), 77)
    h, o = worker.prefill([HandoffRequest("n", PROMPT, sp, SEED), other])
    alone, o1 = worker.prefill([HandoffRequest("n1", PROMPT, dataclasses.replace(sp, n=1), SEED), other])
    assert (o.first_token, o.first_logprobs, o.more_first_tokens, o.more_first_logprobs) == (
        o1.first_token,
        o1.first_logprobs,
        (),
        (),
    )
    assert (h.first_token, h.first_logprobs) == (alone.first_token, alone.first_logprobs)
    singles = _singles(worker, sp, beside=[other])  # the same batch, so the same forward
    assert _draws(h) == ([s.first_token for s in singles], [s.first_logprobs for s in singles])


def test_greedy_n_gives_equal_tokens(worker):
    greedy = SamplingParams(n=2)  # argmax only: the batch's tokens are already the argmax
    (h,) = worker.prefill([HandoffRequest("g", PROMPT, greedy, SEED)])
    (ref,) = worker.prefill([HandoffRequest("g1", PROMPT, SamplingParams(), SEED)])
    assert h.more_first_tokens == (h.first_token,) and h.first_token == ref.first_token
    # beside a sampled request (the batch samples): a greedy row with logprobs still draws its argmax twice
    sampled = HandoffRequest("t", OTHER, SamplingParams(temperature=1.0, n=2), 5)
    lp = dataclasses.replace(greedy, return_logprob=True, top_logprobs_num=2)
    g, t = worker.prefill([HandoffRequest("gl", PROMPT, lp, SEED), sampled])
    assert g.more_first_tokens == (ref.first_token,) and g.first_token == ref.first_token
    assert g.more_first_logprobs == (g.first_logprobs,)
    assert len(t.more_first_tokens) == 1
    for x in (h, g, t):
        x.check_record(worker.runner.config.vocab_size)


# ---- over gRPC --------------------------------------------------------------------------------------
class _Sink:
    def deliver_first_token(self, rid, token, position):
        self.first = token

    def deliver_kv(self, rid, token_start, layer_start, k, v, draft, release):
        release()


@pytest.fixture(scope="module")
def service(checkpoint):
    config = PrefillConfig(checkpoint("llama"), port=0, disable_radix_cache=True, debug_checks=True)
    service = PrefillService(config).start()
    channel = grpc.insecure_channel(service.address)
    yield service, prefill_pb2_grpc.PrefillStub(channel)
    channel.close()
    service.stop()


def _call(stub, request: HandoffRequest) -> list:
    return list(stub.Prefill(prefill_request.build(request, 0), timeout=60))


def _read(service, request: HandoffRequest, messages) -> Handoff:
    """The decode side's reading of a Prefill stream (decode_service/prefill_stream.py)."""
    stream = HandoffStream(request, [], _Sink(), service.runner.config, None, 5.0, None)
    for m in messages:
        stream.add(m)
    return stream.finish()


def test_record_carries_the_more_first_tokens_and_decode_reads_them(service):
    service, stub = service
    sp = CASES["logprobs"]
    request = HandoffRequest("w", PROMPT, sp, SEED)
    messages = _call(stub, request)
    assert messages[0].HasField("first_token") and messages[-1].HasField("record")
    record = messages[-1].record
    assert len(record.more_first_tokens) == N - 1 and len(record.more_first_logprobs) == N - 1
    assert messages[0].first_token.token_id == record.first_token  # the early token is sample 0's
    h = _read(service, request, messages)  # check_record ran inside
    assert h.more_first_tokens == tuple(record.more_first_tokens)
    assert all(isinstance(lp, TokenLogprobs) for lp in h.more_first_logprobs)
    one = dataclasses.replace(sp, n=1)
    singles = []
    for i in range(N):
        r = HandoffRequest(f"w{i}", PROMPT, one, sample_seed(SEED, i))
        singles.append(_read(service, r, _call(stub, r)))
        assert singles[-1].more_first_tokens == () and not _call(stub, r)[-1].record.more_first_tokens
    assert _draws(h) == ([s.first_token for s in singles], [s.first_logprobs for s in singles])

    # a record that lies about the draws is refused by the decode side (ValueError: the attempt is broken)
    vocab = service.runner.config.vocab_size
    for lie in ("short", "vocab", "logprobs"):
        bad = [prefill_pb2_copy(m) for m in messages]
        rec = bad[-1].record
        if lie == "short":
            del rec.more_first_tokens[-1]
        elif lie == "vocab":
            rec.more_first_tokens[0] = vocab
        else:
            del rec.more_first_logprobs[-1]
        with pytest.raises(ValueError):
            _read(service, request, bad)


def prefill_pb2_copy(message):
    out = type(message)()
    out.CopyFrom(message)
    return out


def test_n_on_the_wire_defaults_to_one_and_is_bounded(service):
    service, stub = service
    msg = prefill_request.build(HandoffRequest("z", PROMPT, SamplingParams(temperature=1.0), SEED), 0)
    msg.sampling_params.ClearField("n")  # 0 on the wire: one sample
    assert not list(stub.Prefill(msg, timeout=60))[-1].record.more_first_tokens
    msg.sampling_params.n = 129
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Prefill(msg, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be" in err.value.details()


# ---- the record's own checks ------------------------------------------------------------------------
def test_check_record_refuses_a_wrong_count_or_an_out_of_vocab_token():
    sp = SamplingParams(temperature=1.0, n=3)
    ok = Handoff("r", [1, 2, 3], sp, 5, 4, None, None, more_first_tokens=(1, 2))
    ok.check_record(10)
    for more in ((1,), (1, 2, 3), (1, 10), (-1, 2)):
        with pytest.raises(ValueError):
            dataclasses.replace(ok, more_first_tokens=more).check_record(10)
    with pytest.raises(ValueError):  # n = 1 with more tokens
        dataclasses.replace(ok, params=SamplingParams(), more_first_tokens=(1,)).check_record(10)
    lp = TokenLogprobs(-1.0, (), ())
    asks = dataclasses.replace(sp, return_logprob=True)
    with pytest.raises(ValueError):  # asked for logprobs: one per more token
        dataclasses.replace(ok, params=asks, first_logprobs=lp, more_first_logprobs=(lp,)).check_record(10)
    dataclasses.replace(ok, params=asks, first_logprobs=lp, more_first_logprobs=(lp, lp)).check_record(10)


def test_the_more_draws_travel_between_tp_ranks():
    """TP prefill: the request (its n) goes to the followers in Admit; a Handoff with the more draws
    round-trips through the TP codec (decode's followers get handoffs in their messages)."""
    from common.parallel import tp_codec
    from prefill_service.tp_messages import Admit

    cpu = torch.device("cpu")
    admit = Admit(HandoffRequest("r", [1, 2], SamplingParams(temperature=1.0, n=4), 9))
    assert tp_codec.loads(bytearray(tp_codec.dumps(admit)), cpu).request.params.n == 4
    lp = TokenLogprobs(-0.5, ((3, -0.5),), ())
    h = Handoff("r", [1, 2], SamplingParams(n=3), 5, 3, None, None, more_first_tokens=(4, 5))
    h.more_first_logprobs = (lp, lp)
    back = tp_codec.loads(bytearray(tp_codec.dumps(h)), cpu)
    assert back.more_first_tokens == (4, 5) and back.more_first_logprobs == (lp, lp)
