"""n > 1 (issue 42 part 2): one prompt prefilled once, n samples decoding from its shared KV slots.

Sample i of an n > 1 request with seed s decodes exactly as an n = 1 request with seed
sample_seed(s, i) (in-process, overlap on and off, with penalties, logit bias and logprobs); greedy
samples are HF's greedy; the prompt's KV is reserved once (prompt + n x max_new slots); an abort at
each stage of the request's life ends every sample and frees each slot exactly once (pool
integrity); samples finishing at different steps free the prompt's slots with the last; over gRPC
every chunk and Complete carries its sample's index, and the answer ends after n Completes.
"""

import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.engine.sampling import SamplingParams, sample_seed
from tests.decode_harness import ManualPair, Pair
from tests.grpc_harness import GrpcPair
from tests.oracle import hf_greedy, hf_sampled
from tests.test_logprobs import LogprobOutputs

PROMPT = [5, 6, 7, 8, 9, 10, 11]
SEED = 1234


def _rids(rid: str, n: int) -> list[str]:
    return [rid] + [f"{rid}/{i}" for i in range(1, n)]


def _sampled(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True, "seed": SEED, **kw})


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize(
    "extra",
    [{}, {"frequency_penalty": 0.7, "logit_bias": {3: 2.0}, "return_logprob": True, "top_logprobs_num": 3}],
    ids=["plain", "penalties-logprobs"],
)
def test_each_sample_decodes_as_a_request_with_its_seed(checkpoint, overlap, extra):
    n = 3
    pair = Pair(checkpoint("llama"), overlap=overlap)
    pair.out = LogprobOutputs()
    try:
        pair.submit("many", PROMPT, _sampled(n=n, **extra))
        pair.wait(_rids("many", n))
        for i in range(n):  # the references: n = 1 requests, side by side as the samples ran
            pair.submit(f"one{i}", PROMPT, _sampled(**{**extra, "seed": sample_seed(SEED, i)}))
        pair.wait([f"one{i}" for i in range(n)])
    finally:
        pair.close()  # integrity: the prompt's slots freed once, with the last sample
    got = [pair.out.tokens[r] for r in _rids("many", n)]
    assert got == [pair.out.tokens[f"one{i}"] for i in range(n)]
    assert all(len(t) == 10 for t in got) and len({tuple(t) for t in got}) > 1, "samples did not differ"
    if extra:  # the same logprobs (within float noise: the batches' shapes differ on prefill)
        for r, i in zip(_rids("many", n), range(n)):
            mine, ref = pair.out.logprobs[r], pair.out.logprobs[f"one{i}"]
            assert len(mine) == len(ref) == 10
            for a, b in zip(mine, ref):
                assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("overlap", [True, False])
def test_each_sample_draws_from_hfs_distribution_with_its_own_uniforms(checkpoint, overlap):
    """Anchored to HF, not to our own n = 1 runs: sample i's tokens are the ones HF's distribution for
    its own history gives at sample i's uniforms (seed sample_seed(s, i)), its first token (drawn by
    prefill) included, with a frequency penalty and a logit bias over its own outputs."""
    from tests.test_penalties import Bias, FreqPres

    path, n, new = checkpoint("llama"), 3, 12
    extra = {"frequency_penalty": 0.9, "logit_bias": {3: 2.0, 40: -1.5}}
    pair = Pair(path, overlap=overlap)
    try:
        pair.submit("many", PROMPT, _sampled(n=n, max_new_tokens=new, **extra))
        pair.wait(_rids("many", n))
    finally:
        pair.close()
    got = [pair.out.tokens[r] for r in _rids("many", n)]
    assert len({tuple(t) for t in got}) == n, "samples alike: the per-sample draws went untested"
    for i, tokens in enumerate(got):
        procs = (FreqPres(len(PROMPT), 0.9, 0.0), Bias(extra["logit_bias"]))
        assert tokens == hf_sampled(path, PROMPT, new, sample_seed(SEED, i), 1.0, procs), f"sample {i}"


def test_greedy_samples_are_hf_greedy_and_the_prompt_is_reserved_once(checkpoint):
    path = checkpoint("qwen2")
    pair = ManualPair(path, decode_tokens=len(PROMPT) + 4 * 8)  # room for n = 4 only if the prompt is shared
    pair.submit("g", PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True, n=4))
    pair.scheduler.step()  # admission
    assert pair.worker.kv_allocator.num_used == len(PROMPT) + 4 * 8
    assert pair.worker.req_to_token_pool.allocator.num_used == 4
    pair.prefill()
    pair.run_until_idle()
    expected = hf_greedy(path, PROMPT, 8)
    assert [pair.out.tokens[r] for r in _rids("g", 4)] == [expected] * 4
    assert [pair.out.reasons[r] for r in _rids("g", 4)] == ["length"] * 4
    pair.close()


def test_samples_that_end_at_different_steps_free_the_prompt_with_the_last(checkpoint):
    """Sample 0 stops at its 2nd token (a stop id no other sample emits first): the other samples
    still read the prompt's slots, which are freed only when the last one ends."""
    path = checkpoint("llama")
    probe = ManualPair(path)
    probe.submit("p", PROMPT, _sampled(n=3))
    probe.scheduler.step()
    probe.prefill()
    probe.run_until_idle()
    tokens = [probe.out.tokens[r] for r in _rids("p", 3)]
    probe.close()
    stop = tokens[0][1]
    assert stop not in tokens[1] and stop not in tokens[2], "seed gave a stop id the others emit: pick another"
    pair = ManualPair(path)
    pair.submit("s", PROMPT, _sampled(n=3, stop_token_ids=(stop,)))
    pair.scheduler.step()
    pair.prefill()
    for _ in range(4):
        pair.scheduler.step()
    assert pair.out.reasons.get("s") == "stop" and "s/1" not in pair.out.reasons
    pair.scheduler.check_integrity()  # sample 0 is freed, the prompt's slots are still held
    assert pair.worker.kv_allocator.num_used >= len(PROMPT)
    pair.run_until_idle()
    assert [pair.out.tokens[r] for r in _rids("s", 3)] == [tokens[0][:2], tokens[1], tokens[2]]
    pair.close()


@pytest.mark.parametrize("stage", ["queued", "prefill", "handoff", "decode"])
def test_an_abort_ends_every_sample_and_frees_each_slot_once(checkpoint, stage):
    pair = ManualPair(checkpoint("llama"), decode_tokens=64)
    sp = _sampled(n=3)
    pair.submit("block", list(range(3, 40)), SamplingParams(max_new_tokens=20, ignore_eos=True))
    pair.submit("a", PROMPT, sp)
    pair.scheduler.step()  # admission: "a" (7 + 3 x 10 slots) waits behind "block" (57 of 64) when queued
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
        assert all(pair.out.tokens.get(r) for r in _rids("a", 3)), "not every sample decoded yet"
    pair.scheduler.abort("a")
    pair.prefill()  # a held prefill's late handoff finds the request gone
    pair.run_until_idle()
    assert [pair.out.reasons.get(r) for r in _rids("a", 3)] == ["abort"] * 3  # forked or not: every answer ends
    assert not pair.scheduler.books.groups
    pair.close()  # integrity: every slot back exactly once


def _generate(rid: str, n: int, stream: bool, temperature: float = 0.0) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=pb.SamplingParams(max_new_tokens=6, ignore_eos=True, n=n, temperature=temperature),
        stream=stream,
    )


@pytest.mark.parametrize("transfer", ["grpc", "shm", "mooncake"])
def test_n_over_grpc_tags_every_chunk_and_complete_with_its_index(checkpoint, transfer):
    path = checkpoint("llama")
    pair = GrpcPair(path, transfer=transfer)
    try:
        expected = hf_greedy(path, PROMPT, 6)
        for stream in (True, False):
            responses = list(pair.stub.Generate(_generate(f"g{stream}", 2, stream)))
            completes = {r.complete.index: r.complete for r in responses if r.HasField("complete")}
            assert sorted(completes) == [0, 1] and responses[-1].HasField("complete")
            assert [list(completes[i].output_ids) for i in (0, 1)] == [expected, expected]
            chunks = [r.chunk for r in responses if r.HasField("chunk")]
            for i in (0, 1):
                assert [t for c in chunks if c.index == i for t in c.token_ids] == (expected if stream else [])
        responses = list(pair.stub.Generate(_generate("t", 3, True, temperature=1.0)))
        completes = {r.complete.index: r.complete for r in responses if r.HasField("complete")}
        assert sorted(completes) == [0, 1, 2] and all(len(c.output_ids) == 6 for c in completes.values())
        for i in range(3):
            streamed = [t for r in responses if r.HasField("chunk") and r.chunk.index == i for t in r.chunk.token_ids]
            assert streamed == list(completes[i].output_ids)
        with pytest.raises(grpc.RpcError) as e:
            list(pair.stub.Generate(_generate("big", 129, False)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be" in e.value.details()
    finally:
        pair.close()


def test_each_sample_keeps_its_own_grammar_matcher(checkpoint):
    """A regex with n = 3 sampled: each sample's matcher is seeded with its own first token and
    advanced by its own outputs, so every sample matches the regex and equals its n = 1 twin."""
    import re

    from transformers import AutoTokenizer

    path = checkpoint("llama")
    regex = r"[a-z]{3,6}( [a-z]{2,5}){1,3}\."
    pair = Pair(path)
    try:
        pair.submit("re", PROMPT, _sampled(n=3, max_new_tokens=40, top_k=50, regex=regex, ignore_eos=False))
        pair.wait(_rids("re", 3))
        for i in range(3):
            pair.submit(
                f"one{i}",
                PROMPT,
                _sampled(max_new_tokens=40, top_k=50, regex=regex, ignore_eos=False, seed=sample_seed(SEED, i)),
            )
        pair.wait([f"one{i}" for i in range(3)])
    finally:
        pair.close()
    got = [pair.out.tokens[r] for r in _rids("re", 3)]
    assert got == [pair.out.tokens[f"one{i}"] for i in range(3)] and len({tuple(t) for t in got}) > 1
    tok = AutoTokenizer.from_pretrained(path)
    for ids in got:
        assert re.fullmatch(regex, tok.decode(ids[:-1])), tok.decode(ids)


def test_submit_refuses_what_n_samples_cannot_serve():
    from types import SimpleNamespace

    from common.request_rules import InvalidRequest
    from decode_service.submit_checks import check_submit

    info = SimpleNamespace(vocab_size=100, context_length=512)
    pool = SimpleNamespace(kv_allocator=SimpleNamespace(size=64), req_to_token_pool=SimpleNamespace(size=4))
    plain = SimpleNamespace(info=info, spec=None, worker=pool, books=SimpleNamespace(extra=0), stop_strings=None)
    check_submit(plain, PROMPT, SamplingParams(max_new_tokens=19, n=3))  # 7 + 3 x 19 = 64 slots: fits
    check_submit(plain, PROMPT, SamplingParams(max_new_tokens=2, n=4))  # 4 request slots: fits
    with pytest.raises(InvalidRequest, match=r"n \(5\) exceeds the 4 request slots .*--max-running-requests 4"):
        check_submit(plain, PROMPT, SamplingParams(max_new_tokens=2, n=5))  # could never be admitted
    with pytest.raises(InvalidRequest, match=r"n \(3\) x max_new_tokens \(20\)"):
        check_submit(plain, PROMPT, SamplingParams(max_new_tokens=20, n=3))
    eagle = SimpleNamespace(
        info=info, spec=SimpleNamespace(eagle_topk=1), worker=pool, books=SimpleNamespace(extra=4), stop_strings=None
    )
    check_submit(eagle, PROMPT, SamplingParams(max_new_tokens=14, n=3))  # 7 + 3 x (14 + 4) + 2 = 63: fits
    with pytest.raises(InvalidRequest, match="own last prompt position"):  # EAGLE: samples 1..2's own last slot
        check_submit(eagle, PROMPT, SamplingParams(max_new_tokens=15, n=3))  # 7 + 3 x (15 + 4) + 2 = 66


def test_over_grpc_n_above_the_slots_is_refused_and_an_unforked_abort_ends_every_sample(checkpoint):
    """n above --max-running-requests is INVALID_ARGUMENT at once (admission would wait for it forever,
    and everyone behind it); an n = 3 call aborted while queued (never forked) ends with 3 Completes."""
    import threading

    path = checkpoint("llama")
    pair = GrpcPair(path, decode_kw=dict(max_running_requests=4, max_total_tokens=64))
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(pair.stub.Generate(_generate("big", 5, True), timeout=20))  # unrefused it would never end
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-running-requests 4" in e.value.details()
        block = pair.generate(list(range(3, 40)), 20, stream=True, rid="block", ignore_eos=True)
        next(block)  # running: 57 of 64 KV slots held
        responses = []
        call = threading.Thread(
            target=lambda: responses.extend(pair.stub.Generate(_generate("queued", 3, True), timeout=20))
        )
        call.start()
        deadline = time.time() + 10  # the call reaches the queue in milliseconds; 10 s for a busy 2-core host
        while not pair.decode.scheduler.waiting and time.time() < deadline:
            time.sleep(0.01)
        assert [r.rid for r in pair.decode.scheduler.waiting][:1] == [pair.decode._live["queued"]]
        assert pair.stub.Abort(pb.AbortRequest(request_id="queued")).success
        call.join(timeout=10)
        assert not call.is_alive(), "the aborted call never ended"
        assert sorted((r.complete.index, r.complete.finish_reason) for r in responses) == [
            (i, "abort") for i in range(3)
        ]
        list(block)
    finally:
        pair.close()
