"""n > 1 with EAGLE (issue 42): each sample has its own draft seed and head KV at the last prompt position.

The head at the last prompt position L - 1 reads the sample's first token, so prefill computes samples
1..n-1's seeds and head KV there (prefill_service/draft_prefill.py), and decode gives each forked
sample its own slot at L - 1 (decode_service/sample_group.py). Checked: prefill's rows for sample i
equal what an n = 1 prefill with seed sample_seed(seed, i) computes; sample i of an n = 3 request
equals its n = 1 twin with that seed through a fitted EAGLE chain at temperature 1 (overlap on and off,
in one process and over the gRPC pair with the gRPC-bytes and Mooncake transports); greedy samples
are HF's greedy as a chain and a tree; the reservation counts each sample's own last-position slot;
an abort at each stage frees every slot once (pool integrity); a regex holds for each sample (its own
matcher and draft state); a record with unsound samples' seeds or head KV fails only its request; a
fork's prebuilt writes cross the TP codec whole; a default max_new_tokens leaves room for the drafts.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from common.engine.draft_runner import SpecArgs
from common.engine.handoff import HandoffRequest
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams, sample_seed
from prefill_service.worker import PrefillWorker
from tests.decode_harness import ManualPair, Outputs, Pair
from tests.grpc_harness import needs_mooncake
from tests.oracle import hf_greedy
from tests.test_eagle import chat_prompts

N, SEED, STEPS = 3, 1234, 3


def _rids(rid: str, n: int = N) -> list[str]:
    return [rid] + [f"{rid}/{i}" for i in range(1, n)]


def _chain(head: str, algorithm: str = "EAGLE") -> SpecArgs:
    return SpecArgs(algorithm, head, STEPS, 1, STEPS + 1)


def _sampled(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "seed": SEED, **kw})


def _prompt(path: str) -> list[int]:
    return chat_prompts(path, 1)[0]


def _first_tokens_differ(tokens: list[list[int]]) -> None:
    """The test means something only if some sample's first token is not sample 0's."""
    assert any(t[0] != tokens[0][0] for t in tokens[1:]), f"every sample began with {tokens[0][0]}: pick another seed"


def test_prefill_gives_each_sample_its_own_seed_and_last_head_kv(checkpoint, fitted_head):
    path = checkpoint("llama")
    runner = ModelRunner(
        RunnerArgs(path, max_total_tokens=512, max_running_requests=4, spec=_chain(fitted_head("llama", "EAGLE")))
    )
    worker = PrefillWorker(runner, chunk_size=16, radix_cache=False)
    prompt, last = _prompt(path), len(_prompt(path)) - 1
    [many] = worker.prefill([HandoffRequest("m", prompt, _sampled(n=N), SEED)])
    twins = worker.prefill([HandoffRequest(f"t{i}", prompt, _sampled(), sample_seed(SEED, i)) for i in range(N)])
    worker.check_idle_integrity()  # the scratch slots went back
    assert many.first_token == twins[0].first_token
    assert many.more_first_tokens == tuple(t.first_token for t in twins[1:])
    _first_tokens_differ([[many.first_token], *[[t] for t in many.more_first_tokens]])
    close = dict(rtol=1e-5, atol=1e-5)
    for i, twin in enumerate(twins[1:]):
        assert torch.equal(many.more_draft_topk_ids[i], twin.draft_topk_ids)
        torch.testing.assert_close(many.more_draft_topk_p[i], twin.draft_topk_p, **close)
        torch.testing.assert_close(many.more_draft_hidden[i], twin.draft_hidden, **close)
        torch.testing.assert_close(many.more_draft_k[i], twin.draft_k[0][last], **close)
        torch.testing.assert_close(many.more_draft_v[i], twin.draft_v[0][last], **close)
    torch.testing.assert_close(many.draft_k[0], twins[0].draft_k[0], **close)  # sample 0's as before


@pytest.mark.parametrize("overlap", [True, False])
def test_each_sample_decodes_as_its_twin_through_a_sampled_chain(checkpoint, fitted_head, overlap):
    path = checkpoint("llama")
    prompt = _prompt(path)
    pair = Pair(path, overlap=overlap, spec=_chain(fitted_head("llama", "EAGLE")))
    try:
        pair.submit("many", prompt, _sampled(n=N))
        pair.wait(_rids("many"))
        accepted_many = pair.scheduler.spec_stats.accepted
        for i in range(N):
            pair.submit(f"one{i}", prompt, _sampled(seed=sample_seed(SEED, i)))
        pair.wait([f"one{i}" for i in range(N)])
    finally:
        pair.close()  # integrity: the shared prompt slots and each sample's own, freed once
    got = [pair.out.tokens[r] for r in _rids("many")]
    assert got == [pair.out.tokens[f"one{i}"] for i in range(N)]
    assert all(len(t) == 16 for t in got) and len({tuple(t) for t in got}) == N, "samples did not differ"
    _first_tokens_differ(got)
    assert accepted_many > 0, "the head accepted nothing: its seeds were not exercised"


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("topk,draft_tokens", [(1, STEPS + 1), (4, 8)], ids=["chain", "tree"])
def test_greedy_samples_are_hf_greedy_and_each_has_its_last_slot(checkpoint, fitted_head, overlap, topk, draft_tokens):
    path = checkpoint("llama")
    prompt, max_new = _prompt(path), 16
    spec = SpecArgs("EAGLE3", fitted_head("llama", "EAGLE3"), STEPS, topk, draft_tokens)
    pair = ManualPair(path, overlap=overlap, spec=spec)
    pair.submit("g", prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True, n=N))
    pair.scheduler.step()  # admission: the prompt once, each sample's own (and samples 1..n-1's last position)
    extra = spec.extra_slots
    assert pair.worker.kv_allocator.num_used == len(prompt) + N * (max_new + extra) + (N - 1)
    assert pair.worker.req_to_token_pool.allocator.num_used == N
    pair.prefill()
    pair.run_until_idle()
    assert [pair.out.tokens[r] for r in _rids("g")] == [hf_greedy(path, prompt, max_new)] * N
    assert pair.scheduler.spec_stats.accepted > 0
    pair.close()


@pytest.mark.parametrize("stage", ["queued", "prefill", "handoff", "decode"])
def test_an_abort_frees_each_samples_own_last_slot_once(checkpoint, fitted_head, stage):
    path = checkpoint("llama")
    pair = ManualPair(path, decode_tokens=120, spec=_chain(fitted_head("llama", "EAGLE")))
    prompt = [5, 6, 7, 8, 9, 10, 11]
    pair.submit("block", list(range(3, 40)), SamplingParams(max_new_tokens=20, ignore_eos=True))  # 37 + 20 + 8
    pair.submit("a", prompt, _sampled(n=N, max_new_tokens=10))  # 7 + 3 x (10 + 8) + 2 = 63: waits
    pair.scheduler.step()
    assert [r.rid for r in pair.pending] == ["block"] and pair.worker.kv_allocator.num_used == 65
    if stage != "queued":
        pair.prefill("block")
        while "block" not in pair.out.reasons:
            pair.scheduler.step()
        pair.scheduler.step()  # now "a" is admitted: its prefill is held
        assert [r.rid for r in pair.pending] == ["a"]
    if stage in ("handoff", "decode"):
        pair.prefill("a")  # its handoff is in the inbox
    if stage == "decode":
        for _ in range(3):
            pair.scheduler.step()
        assert all(pair.out.tokens.get(r) for r in _rids("a")), "not every sample decoded yet"
        pair.scheduler.check_integrity()  # mid-decode: every slot held once (the shared ones by the group)
    pair.scheduler.abort("a")
    pair.prefill()  # a held prefill's late handoff finds the request gone
    pair.run_until_idle()
    assert pair.out.reasons["a"] == "abort"
    if stage == "decode":
        assert [pair.out.reasons[r] for r in _rids("a")] == ["abort"] * N
    assert not pair.scheduler.books.groups
    pair.close()  # integrity: every slot back exactly once


@pytest.mark.parametrize("transfer,tp", [("grpc", 1), ("grpc", 2), pytest.param("mooncake", 1, marks=needs_mooncake)])
def test_samples_over_the_grpc_pair_equal_their_twins(checkpoint, fitted_head, transfer, tp):
    """The samples' seeds and head KV travel in the record (PrebuiltRecord.more_draft) beside KV sent as
    gRPC chunks or written by the transfer engine; with tp 2 both services split over two ranks (a
    fork's last-slot writes reach the follower). Requests go in at the decode scheduler (the client
    API carries no seed), their prefill over the real Prefill call."""
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    from tests.grpc_harness import GrpcPair

    path = checkpoint("llama")
    prompt = _prompt(path)
    flags = dict(
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=fitted_head("llama", "EAGLE"),
        speculative_num_steps=STEPS,
        speculative_num_draft_tokens=STEPS + 1,
        **(dict(tp_size=tp, linear_layout="mkl") if tp > 1 else {}),
    )
    pair = GrpcPair(path, prefill_kw=dict(flags, max_chunk_bytes=4096), decode_kw=flags, transfer=transfer)
    out, scheduler = Outputs(), pair.decode.scheduler
    try:
        scheduler.submit("many", prompt, _sampled(n=N), out)
        for i in range(N):
            scheduler.submit(f"one{i}", prompt, _sampled(seed=sample_seed(SEED, i)), out)
        names = _rids("many") + [f"one{i}" for i in range(N)]
        deadline = time.time() + 60
        while not all(r in out.reasons for r in names):
            assert time.time() < deadline, sorted(out.reasons)
            time.sleep(0.01)
        got = [out.tokens[r] for r in _rids("many")]
        assert got == [out.tokens[f"one{i}"] for i in range(N)]
        _first_tokens_differ(got)
        assert (pair.prefill.kv_notices > 0) == (transfer != "grpc")
        greedy = pb.GenerateRequest(
            request_id="g",
            tokenized=pb.TokenizedInput(input_ids=prompt),
            sampling_params=pb.SamplingParams(max_new_tokens=8, ignore_eos=True, n=N),
        )
        completes = [r.complete for r in pair.stub.Generate(greedy) if r.HasField("complete")]
        assert sorted(c.index for c in completes) == list(range(N))
        assert all(list(c.output_ids) == hf_greedy(path, prompt, 8) for c in completes)
    finally:
        pair.close()  # integrity on the decode side


def test_a_default_max_new_tokens_leaves_room_for_every_samples_drafts():
    from types import SimpleNamespace

    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    from decode_service.request_validation import parse_generate
    from decode_service.submit_checks import check_submit

    prompt, size, extra = [5, 6, 7, 8, 9, 10, 11], 120, 8
    request = pb.GenerateRequest(
        request_id="d", tokenized=pb.TokenizedInput(input_ids=prompt), sampling_params=pb.SamplingParams(n=N)
    )
    _, params = parse_generate(request, 512, 1000, kv_room=size - extra, spec_extra=extra)
    assert params.max_new_tokens == 29  # 7 + 3 x (29 + 8) + 2 = 120 slots: the whole pool
    info, pool = (
        SimpleNamespace(vocab_size=100, context_length=512),
        SimpleNamespace(kv_allocator=SimpleNamespace(size=size), req_to_token_pool=SimpleNamespace(size=8)),
    )
    eagle = SimpleNamespace(
        info=info,
        spec=SimpleNamespace(eagle_topk=1),
        worker=pool,
        books=SimpleNamespace(extra=extra),
        stop_strings=None,
    )
    check_submit(eagle, prompt, params)  # admitted as it is
    _, plain = parse_generate(request, 512, 1000, kv_room=size)
    assert plain.max_new_tokens == (size - 7) // N  # without EAGLE as before


SPOILERS = {
    "seeds missing": (dict(more_draft_hidden=lambda t: None), "no draft seeds"),
    "one seed short": (dict(more_draft_topk_ids=lambda t: t[:-1]), "rows each"),
    "seed hidden NaN": (dict(more_draft_hidden=lambda t: torch.full_like(t, float("nan"))), "NaN"),
    "seed id out of the vocabulary": (dict(more_draft_topk_ids=lambda t: t + 10**6), "vocabulary"),
    "head KV of the wrong width": (dict(more_draft_k=lambda t: t[..., :-1]), "head K"),
}


@pytest.mark.parametrize("case", list(SPOILERS))
def test_a_bad_sample_seed_fails_only_its_request(checkpoint, fitted_head, case):
    """A prefill replica's record with unsound samples' seeds or head KV: that request ends with an error
    before anything of it is written, the pools balance, and the next request is exact."""
    path = checkpoint("llama")
    change, expected = SPOILERS[case]
    pair = ManualPair(path, spec=_chain(fitted_head("llama", "EAGLE")))
    good = list(range(10, 30))
    pair.submit("bad", [5, 6, 7, 8, 9], _sampled(n=N, max_new_tokens=8))
    pair.submit("good", good, SamplingParams(max_new_tokens=8, ignore_eos=True))
    pair.scheduler.step()
    handoffs = {h.rid: h for h in pair.prefill_worker.prefill(pair.pending)}
    pair.pending.clear()
    bad = handoffs["bad"]
    bad = dataclasses.replace(bad, **{k: f(getattr(bad, k)) for k, f in change.items()})
    for h in (bad, handoffs["good"]):
        pair.scheduler.inbox.deliver_handoff(h)
    pair.close()  # to idle, integrity
    samples = {f"bad/{i}": "error" for i in range(1, N)}  # never forked: each sample's answer ends with it
    assert pair.scheduler.alive and pair.out.reasons == {"bad": "error", **samples, "good": "length"}
    assert expected in pair.out.finishes["bad"].error
    assert pair.out.tokens["good"] == hf_greedy(path, good, 8)


def test_a_forked_samples_prebuilt_writes_cross_to_tp_followers():
    """Under tensor parallelism a fork's WritePrebuilt (its own seed, head KV and the slot its target KV
    is copied from) travels through the TP codec whole: every rank copies its own heads' KV."""
    from common.engine.handoff import Handoff
    from common.parallel import tp_codec
    from decode_service.handoff_writes import ForkSeed
    from decode_service.tp_messages import WritePrebuilt

    mine = Handoff("r/1", [1, 2, 3], _sampled(n=N), 7, 4, None, None, more_first_tokens=(4, 5))
    mine = dataclasses.replace(
        mine, draft_topk_ids=torch.tensor([4]), draft_topk_p=torch.tensor([1.0]), draft_hidden=torch.ones(8)
    )
    fork = ForkSeed(17, torch.randn(2, 4), torch.randn(2, 4))
    message = WritePrebuilt(3, torch.arange(5), mine, fork)
    back = tp_codec.loads(tp_codec.dumps(message), torch.device("cpu"))
    assert back.fork.last_from == 17 and torch.equal(back.handoff.draft_hidden, mine.draft_hidden)
    assert torch.equal(back.fork.draft_k, fork.draft_k)
    assert torch.equal(back.fork.draft_v, fork.draft_v)


def test_each_sample_keeps_its_grammar_through_a_sampled_chain(checkpoint, fitted_head):
    """A regex with n = 3 through EAGLE: each sample's matcher and draft state are its own, so every
    sample matches the regex and equals its n = 1 twin."""
    import re

    from transformers import AutoTokenizer

    path = checkpoint("llama")
    regex, prompt = r"[a-z]{3,6}( [a-z]{2,5}){1,3}\.", [5, 6, 7, 8, 9, 10, 11]
    pair = Pair(path, spec=_chain(fitted_head("llama", "EAGLE")))
    constrained = dict(max_new_tokens=40, top_k=50, regex=regex, ignore_eos=False)
    try:
        pair.submit("re", prompt, _sampled(n=N, **constrained))
        pair.wait(_rids("re"))
        for i in range(N):
            pair.submit(f"one{i}", prompt, _sampled(seed=sample_seed(SEED, i), **constrained))
        pair.wait([f"one{i}" for i in range(N)])
    finally:
        pair.close()
    got = [pair.out.tokens[r] for r in _rids("re")]
    assert got == [pair.out.tokens[f"one{i}"] for i in range(N)] and len({tuple(t) for t in got}) > 1
    _first_tokens_differ(got)
    tok = AutoTokenizer.from_pretrained(path)
    for ids in got:
        assert re.fullmatch(regex, tok.decode(ids[:-1])), tok.decode(ids)
