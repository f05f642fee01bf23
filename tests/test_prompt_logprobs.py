"""Prompt logprobs (issue 42: `logprob_start_len` = s >= 0 with return_logprob, computed on prefill):
for prompt positions max(s, 1).. the log-softmax of the raw logits at the position before, within
1e-4 of HF's `model(input_ids).logits` log-softmax (fp32, CPU), with top_logprobs_num candidates and
the token_ids_logprob values; position 0 has none. On the prefill worker (chunked prefill, the prefix
cache bounded for such requests, a request that does not ask unchanged beside one that does), in
process through the decode scheduler (every sample's first output with n > 1), and over gRPC (the
first streamed chunk and the Complete, SGLang's InputLogProbs shape), with the front door's bounds."""

import grpc
import pytest
import torch

from common.engine.handoff import HandoffRequest
from common.engine.sampling import SamplingParams
from decode_service.output import RequestOutput
from prefill_service.worker import PrefillWorker
from tests.decode_harness import Outputs, Pair, runners
from tests.grpc_harness import GrpcPair
from tests.oracle import hf_model
from tests.test_logprobs import check, hf_reference

LONG = [(7 * i + 3) % 50 + 2 for i in range(40)]  # longer than the chunk size (16): chunked prefill
SHORT = [5, 6, 7, 8, 9, 10]
TOP, IDS, N = 4, (3, 7, 11), 4


def _params(start: int, top: int = TOP, ids=IDS, **kw) -> SamplingParams:
    base = dict(max_new_tokens=N, ignore_eos=True, return_logprob=True, top_logprobs_num=top, token_ids_logprob=ids)
    return SamplingParams(**base, logprob_start_len=start, **kw)


@torch.inference_mode()
def hf_prompt(path: str, prompt: list[int]) -> torch.Tensor:
    """log-softmax [len, V] of HF's logits over the prompt (row j - 1 gives prompt[j]'s logprob)."""
    return torch.log_softmax(hf_model(path)(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check_prompt(got, prompt: list[int], params: SamplingParams, ref: torch.Tensor) -> None:
    first = max(params.logprob_start_len, 1)
    assert got is not None and len(got) == len(prompt) - first, (len(got or ()), len(prompt), first)
    for lp, j in zip(got, range(first, len(prompt))):
        row = ref[j - 1]  # the logits before position j give prompt[j]'s logprob
        assert abs(lp.logprob - float(row[prompt[j]])) < 1e-4, (j, lp.logprob, float(row[prompt[j]]))
        vals, ids = row.topk(params.top_logprobs_num)
        assert [t for t, _ in lp.top] == ids.tolist(), j
        assert all(abs(a - b) < 1e-4 for (_, a), b in zip(lp.top, vals.tolist())), j
        assert len(lp.ids) == len(params.token_ids_logprob)
        assert all(abs(v - float(row[t])) < 1e-4 for v, t in zip(lp.ids, params.token_ids_logprob)), j


def test_prefill_worker_prompt_logprobs_match_hf_chunked_cached_and_beside_plain(checkpoint):
    path = checkpoint("llama")
    prefill, _ = runners(path)
    worker = PrefillWorker(prefill, chunk_size=16)  # radix cache on
    ref_long, ref_short = hf_prompt(path, LONG), hf_prompt(path, SHORT)
    asks = {
        "s0": (LONG, _params(0)),
        "mid": (LONG, _params(21, top=1, ids=())),
        "last": (SHORT, _params(len(SHORT) - 1)),
        "one": (SHORT, _params(1, top=20, ids=(0,))),
    }
    plain = HandoffRequest("plain", LONG, SamplingParams(max_new_tokens=N), 1)
    alone = worker.prefill([HandoffRequest("alone", LONG, SamplingParams(max_new_tokens=N), 1)])[0]
    reqs = [HandoffRequest(rid, p, sp, 1) for rid, (p, sp) in asks.items()] + [plain]
    out = worker.prefill(reqs)  # the long prompt is in the cache now: plain reuses it, the asking ones less
    for h, (rid, (p, sp)) in zip(out, asks.items()):
        check_prompt(h.prompt_logprobs, p, sp, ref_long if p is LONG else ref_short)
        assert h.cached_tokens <= max(sp.logprob_start_len, 1) - 1, rid
        h.check_record(prefill.config.vocab_size)
    assert out[0].cached_tokens == 0 and out[1].cached_tokens == 20  # the cache serves positions below s - 1
    assert out[-1].prompt_logprobs is None and out[-1].cached_tokens > 0
    assert out[-1].first_token == alone.first_token == int(ref_long[-1].argmax())
    worker.check_idle_integrity()


def test_record_with_the_wrong_count_is_refused(checkpoint):
    prefill, _ = runners(checkpoint("llama"))
    h = PrefillWorker(prefill, chunk_size=16).prefill([HandoffRequest("r", SHORT, _params(2), 1)])[0]
    h.check_record(prefill.config.vocab_size)
    h.prompt_logprobs = h.prompt_logprobs[:-1]
    with pytest.raises(ValueError, match="prompt logprobs"):
        h.check_record(prefill.config.vocab_size)


class PromptOutputs(Outputs):
    def __init__(self):
        super().__init__()
        self.prompt: dict[str, list] = {}  # rid -> the prompt logprobs of each record that had them

    def __call__(self, out: RequestOutput):
        if out.prompt_logprobs is not None:
            assert out.rid not in self.tokens, f"{out.rid}: prompt logprobs after its first record"
            self.prompt.setdefault(out.rid, []).append(out.prompt_logprobs)
        super().__call__(out)  # collects the output logprobs too


def test_in_process_first_output_of_each_sample_carries_them(checkpoint):
    path = checkpoint("llama")
    pair = Pair(path)  # prefill chunk size 16
    pair.out = PromptOutputs()
    try:
        cases = {"s0": (LONG, _params(0)), "mid": (LONG, _params(17)), "short": (SHORT, _params(3, top=0))}
        for rid, (p, sp) in cases.items():
            pair.submit(rid, p, sp)
        pair.submit("plain", LONG, SamplingParams(max_new_tokens=N, ignore_eos=True))
        n2 = _params(2, temperature=1.0, n=2, seed=5)
        pair.submit("n2", SHORT, n2)
        pair.wait([*cases, "plain", "n2", "n2/1"])
        refs = {id(LONG): hf_prompt(path, LONG), id(SHORT): hf_prompt(path, SHORT)}
        for rid, (p, sp) in cases.items():
            assert len(pair.out.prompt[rid]) == 1, rid
            check_prompt(pair.out.prompt[rid][0], p, sp, refs[id(p)])
            tokens, ref = hf_reference(path, p, sp, N)  # the outputs and their logprobs are unchanged
            assert pair.out.tokens[rid] == tokens
            if sp.top_logprobs_num:  # (test_logprobs.check wants candidates)
                check(pair.out.logprobs[rid], tokens, ref, sp)
        assert (
            "plain" not in pair.out.prompt and pair.out.tokens["plain"] == hf_reference(path, LONG, _params(-1), N)[0]
        )
        for rid in ("n2", "n2/1"):  # the same prompt's, on each sample's first record
            assert len(pair.out.prompt[rid]) == 1, rid
            check_prompt(pair.out.prompt[rid][0], SHORT, n2, refs[id(SHORT)])
    finally:
        pair.close()


def _request(rid, prompt, start: int, stream: bool, top: int = TOP):
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(max_new_tokens=N, ignore_eos=True),
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=top,
        token_ids_logprob=list(IDS),
        stream=stream,
    )


def _check_input(msg, prompt: list[int], start: int, top: int, ref: torch.Tensor) -> None:
    """smg's InputLogProbs: one entry per prompt id from `start`, position 0 without a value."""
    assert list(msg.token_ids) == prompt[start:]
    assert len(msg.token_logprobs) == len(prompt) - start
    assert len(msg.top_logprobs) == (len(prompt) - start if top else 0)
    for i, j in enumerate(range(start, len(prompt))):
        entry = msg.token_logprobs[i]
        if j == 0:
            assert not entry.HasField("value") and (not top or not msg.top_logprobs[i].token_ids)
            continue
        assert abs(entry.value - float(ref[j - 1, prompt[j]])) < 1e-4, j
        if top:
            vals, ids = ref[j - 1].topk(top)
            assert list(msg.top_logprobs[i].token_ids) == ids.tolist(), j
            assert max(abs(a - b) for a, b in zip(msg.top_logprobs[i].values, vals.tolist())) < 1e-4


def test_over_grpc_first_chunk_and_complete_carry_input_logprobs(checkpoint):
    path = checkpoint("llama")
    pair = GrpcPair(path, prefill_kw={"chunked_prefill_size": 16})
    refs = {id(LONG): hf_prompt(path, LONG), id(SHORT): hf_prompt(path, SHORT)}
    try:
        for prompt, start, top in ((LONG, 0, TOP), (LONG, 25, 0), (SHORT, 4, 2)):
            for stream in (True, False):
                chunks, complete = [], None
                for r in pair.stub.Generate(_request(f"g{start}{stream}", prompt, start, stream, top)):
                    if r.HasField("chunk"):
                        chunks.append(r.chunk)
                    else:
                        complete = r.complete
                assert complete.finish_reason == "length" and len(complete.output_ids) == N
                _check_input(complete.input_logprobs, prompt, start, top, refs[id(prompt)])
                assert complete.output_logprobs.token_logprobs  # the outputs' still there
                if stream:
                    assert chunks and chunks[0].input_logprobs == complete.input_logprobs
                    assert not any(c.HasField("input_logprobs") for c in chunks[1:])
        plain = list(pair.stub.Generate(_request("none", SHORT, -1, False)))
        assert not plain[-1].complete.HasField("input_logprobs")
        for bad in (len(SHORT), len(SHORT) + 5, -2):
            with pytest.raises(grpc.RpcError) as e:
                list(pair.stub.Generate(_request(f"bad{bad}", SHORT, bad, False)))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprob_start_len" in e.value.details()
    finally:
        pair.close()


def test_prompt_logprobs_too_large_for_one_record_are_refused():
    from common.request_rules import MAX_PROMPT_LOGPROB_VALUES, InvalidRequest, validate_prompt

    wide = dict(return_logprob=True, top_logprobs_num=20, token_ids_logprob=tuple(range(64)))
    prompt = [5] * (MAX_PROMPT_LOGPROB_VALUES // 105 + 2)  # 105 values per position
    validate_prompt(prompt, SamplingParams(max_new_tokens=1, logprob_start_len=2, **wide), 100, 1 << 20)
    with pytest.raises(InvalidRequest, match="raise logprob_start_len"):
        validate_prompt(prompt, SamplingParams(max_new_tokens=1, logprob_start_len=0, **wide), 100, 1 << 20)


def test_n_samples_carry_the_prompt_logprobs_once(checkpoint):
    """With n > 1 the prompt logprobs (the same for every sample) travel once per call: in sample 0's
    first chunk and Complete, equal to an n = 1 call's; the other samples' messages carry none."""
    path = checkpoint("llama")
    pair = GrpcPair(path)
    ref = hf_prompt(path, SHORT)
    try:
        for stream in (True, False):
            request = _request(f"n{stream}", SHORT, 2, stream, 2)
            request.sampling_params.n = 3
            request.sampling_params.temperature = 1.0
            chunks, completes = {}, {}
            for r in pair.stub.Generate(request):
                if r.HasField("chunk"):
                    chunks.setdefault(r.chunk.index, []).append(r.chunk)
                else:
                    completes[r.complete.index] = r.complete
            assert sorted(completes) == [0, 1, 2]
            _check_input(completes[0].input_logprobs, SHORT, 2, 2, ref)
            assert not any(completes[i].HasField("input_logprobs") for i in (1, 2))
            if stream:
                assert chunks[0][0].input_logprobs == completes[0].input_logprobs
                assert not any(c.HasField("input_logprobs") for i in (0, 1, 2) for c in chunks[i][int(i == 0) :])
    finally:
        pair.close()
