"""Output logprobs (issue 42 b): the log-softmax of the raw logits (before penalties and bias) of every
output token, its top_logprobs_num candidates and the token_ids_logprob values, within 1e-4 of HF's
log-softmax of generate's raw logits (`output_logits=True`), fp32 on CPU; the first token's computed
on prefill and carried by the handoff record; under EAGLE from the verify logits at the committed
positions; in-process (overlap on and off), EAGLE chain and tree, and over gRPC, where the streamed
chunks' logprobs add up to the Complete's."""

import dataclasses
import math

import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from common.engine.logprobs import LogprobRows, TokenLogprobs
from common.engine.sampling import SamplingParams
from decode_service.output import RequestOutput
from tests.decode_harness import Outputs, Pair
from tests.grpc_harness import GrpcPair
from tests.oracle import hf_model
from tests.test_penalties import FreqPres

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [3, 4, 3, 4, 3]]
N, TOP, IDS = 8, 5, (3, 7, 11)


class LogprobOutputs(Outputs):
    """Outputs (which collects `logprobs`) checking one TokenLogprobs per new id."""

    def __call__(self, out: RequestOutput):
        if out.logprobs is not None:
            assert len(out.logprobs) == len(out.new_token_ids), out
        super().__call__(out)


@torch.inference_mode()
def hf_reference(path: str, prompt: list[int], params: SamplingParams, n: int = N):
    """(tokens, log-softmax of the raw logits [n, V]) of HF generate with the request's processors."""
    procs = []
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        procs.append(FreqPres(len(prompt), params.frequency_penalty, params.presence_penalty))
    out = hf_model(path).generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        logits_processor=LogitsProcessorList(procs),
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.log_softmax(torch.cat(out.logits).float(), dim=-1)


def check(got: list[TokenLogprobs], tokens: list[int], ref: torch.Tensor, params: SamplingParams) -> None:
    assert len(got) == len(tokens)
    for i, (lp, t) in enumerate(zip(got, tokens)):
        assert abs(lp.logprob - float(ref[i, t])) < 1e-4, (i, lp.logprob, float(ref[i, t]))
        vals, ids = ref[i].topk(params.top_logprobs_num)
        assert [x for x, _ in lp.top] == ids.tolist(), i
        assert max(abs(a - b) for (_, a), b in zip(lp.top, vals.tolist())) < 1e-4, i
        assert len(lp.ids) == len(params.token_ids_logprob)
        for v, tid in zip(lp.ids, params.token_ids_logprob):
            assert abs(v - float(ref[i, tid])) < 1e-4, (i, tid)


def _params() -> list[SamplingParams]:
    base = dict(max_new_tokens=N, ignore_eos=True, return_logprob=True)
    return [
        SamplingParams(**base, top_logprobs_num=TOP, token_ids_logprob=IDS),
        SamplingParams(**base, top_logprobs_num=1, repetition_penalty=1.8),  # logprobs of the raw logits
        SamplingParams(**base, top_logprobs_num=20, frequency_penalty=1.0, token_ids_logprob=(0,)),
    ]


def test_rows_that_do_not_ask_get_nothing_and_widths_are_per_request():
    params = [SamplingParams(), SamplingParams(return_logprob=True, top_logprobs_num=2, token_ids_logprob=(1,))]
    rows = LogprobRows(params, torch.device("cpu"))
    logits = torch.randn(2, 3, 10)
    step = rows.compute(logits, torch.zeros(2, 3, dtype=torch.int64))
    assert step.rows_cpu == [1] and step.token.shape == (1, 3)
    lp = step.at(0, 2, params[1])
    want = torch.log_softmax(logits[1, 2], -1)
    assert math.isclose(lp.logprob, float(want[0]), abs_tol=1e-6) and len(lp.top) == 2 and len(lp.ids) == 1
    assert LogprobRows.build([SamplingParams()], torch.device("cpu")) is None


@pytest.mark.parametrize("overlap", [True, False])
def test_logprobs_match_hf_in_process(checkpoint, overlap):
    path = checkpoint("llama")
    pair = Pair(path, overlap=overlap)
    pair.out = LogprobOutputs()
    try:
        params = _params()
        for i, (p, sp) in enumerate(zip(PROMPTS, params)):
            pair.submit(str(i), p, sp)
        pair.submit("plain", PROMPTS[0], SamplingParams(max_new_tokens=N, ignore_eos=True))
        pair.wait([str(i) for i in range(len(PROMPTS))] + ["plain"])
        for i, (p, sp) in enumerate(zip(PROMPTS, params)):
            tokens, ref = hf_reference(path, p, sp)
            assert pair.out.tokens[str(i)] == tokens, f"prompt {i}"
            check(pair.out.logprobs[str(i)], tokens, ref, sp)  # one per token: the first's from prefill
        assert "plain" not in pair.out.logprobs
    finally:
        pair.close()


@pytest.mark.parametrize("algorithm,topk", [("EAGLE", 1), ("EAGLE3", 2)])
def test_logprobs_with_eagle_match_hf(checkpoint, fitted_head, algorithm, topk):
    from common.engine.draft_runner import SpecArgs
    from tests.test_eagle import chat_prompts

    path = checkpoint("llama")
    prompts = chat_prompts(path, 3)
    params = _params()
    steps, nodes = (3, 4) if topk == 1 else (2, 4)
    pair = Pair(path, spec=SpecArgs(algorithm, fitted_head("llama", algorithm), steps, topk, nodes))
    pair.out = LogprobOutputs()
    try:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            pair.submit(str(i), p, sp)
        pair.wait([str(i) for i in range(len(prompts))])
        for i, (p, sp) in enumerate(zip(prompts, params)):
            tokens, ref = hf_reference(path, p, sp)
            assert pair.out.tokens[str(i)] == tokens, f"prompt {i}"
            check(pair.out.logprobs[str(i)], tokens, ref, sp)
        assert sum(f.spec_accepted for f in pair.out.finishes.values()) > 0, "no draft accepted"
    finally:
        pair.close()


def test_logprobs_over_grpc_add_up_and_match_hf(checkpoint):
    path = checkpoint("llama")
    pair = GrpcPair(path)
    try:
        for i, (p, sp) in enumerate(zip(PROMPTS, _params())):
            for stream in (True, False):
                call = pair.stub.Generate(
                    _request(f"g{i}{stream}", p, sp, stream),
                )
                chunks, complete = [], None
                for r in call:
                    if r.HasField("chunk"):
                        chunks.append(r.chunk)
                    else:
                        complete = r.complete
                tokens, ref = hf_reference(path, p, sp)
                assert list(complete.output_ids) == tokens
                lp = complete.output_logprobs
                assert list(lp.token_ids) == tokens
                got = [
                    TokenLogprobs(
                        v,
                        tuple(zip(top.token_ids, top.values)),
                        tuple(lp.token_ids_logprobs[j].values) if sp.token_ids_logprob else (),
                    )
                    for j, (v, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs))
                ]
                check(got, tokens, ref, sp)
                if stream:  # the chunks' logprobs, concatenated, are the Complete's
                    assert [t for c in chunks for t in c.token_ids] == tokens
                    assert [v for c in chunks for v in c.output_logprobs.token_logprobs] == list(lp.token_logprobs)
                    tops = [list(t.values) for c in chunks for t in c.output_logprobs.top_logprobs]
                    assert tops == [list(t.values) for t in lp.top_logprobs]
                else:
                    assert not chunks
    finally:
        pair.close()


def _request(rid, prompt, sp: SamplingParams, stream: bool):
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(
            max_new_tokens=sp.max_new_tokens,
            ignore_eos=True,
            repetition_penalty=sp.repetition_penalty,
            frequency_penalty=sp.frequency_penalty,
        ),
        return_logprob=True,
        logprob_start_len=-1,
        top_logprobs_num=sp.top_logprobs_num,
        token_ids_logprob=list(sp.token_ids_logprob),
        stream=stream,
    )


def test_held_first_token_streams_with_its_logprobs_and_aborts_free_once(checkpoint):
    """An early first token of a logprob request waits for the record (which brings its logprobs);
    an abort in between frees the request once (pool integrity), its sibling finishes whole."""
    from tests.decode_harness import ManualPair

    path = checkpoint("llama")
    pair = ManualPair(path)
    pair.out = LogprobOutputs()
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True, return_logprob=True, top_logprobs_num=2)
    pair.submit("a", PROMPTS[0], sp)
    pair.submit("b", PROMPTS[1], sp)
    pair.scheduler.step()  # admission: both prefills are held in `pending`
    handoffs = pair.prefill_worker.prefill(list(pair.pending))
    pair.pending.clear()
    for h in handoffs:
        assert h.first_logprobs is not None
        pair.scheduler.inbox.deliver_first_token(h.rid, h.first_token, 0)
    pair.scheduler.step()
    assert not pair.out.tokens, "a first token went out before its logprobs"
    pair.scheduler.abort(handoffs[0].rid)
    for h in handoffs:
        pair.scheduler.inbox.deliver_handoff(h)
    pair.run_until_idle()
    a, b = handoffs[0].rid, handoffs[1].rid
    assert pair.out.reasons[a] == "abort" and pair.out.tokens.get(a, []) == []
    assert pair.out.reasons[b] == "length" and len(pair.out.tokens[b]) == 6
    assert pair.out.logprobs[b][0] == handoffs[1].first_logprobs
    tokens, ref = hf_reference(path, PROMPTS[1], sp, 6)
    check(pair.out.logprobs[b], tokens, ref, dataclasses.replace(sp, top_logprobs_num=2))
    pair.close()  # integrity: every slot back exactly once


def test_logprobs_and_penalties_with_tensor_parallel_services(checkpoint):
    """Both services at --tp-size 2: the followers run the same penalised steps (the batch's cached
    processors and logprob rows travel in the step message) and logprobs still match HF; an n = 2
    request's samples both give HF's greedy (penalised) tokens."""
    path = checkpoint("llama")
    tp = dict(tp_size=2, linear_layout="mkl")
    pair = GrpcPair(path, prefill_kw=tp, decode_kw=tp)
    try:
        for i, (p, sp) in enumerate(zip(PROMPTS, _params())):
            complete = [r.complete for r in pair.stub.Generate(_request(f"t{i}", p, sp, False))][-1]
            tokens, ref = hf_reference(path, p, sp)
            assert list(complete.output_ids) == tokens, f"prompt {i}"
            for j, (v, t) in enumerate(zip(complete.output_logprobs.token_logprobs, tokens)):
                assert abs(v - float(ref[j, t])) < 1e-4, (i, j)
        n2 = _request("n2", PROMPTS[0], _params()[0], False)  # n = 2: the forked sample's row on every rank
        n2.sampling_params.n = 2
        completes = sorted((r.complete for r in pair.stub.Generate(n2)), key=lambda c: c.index)
        tokens, _ = hf_reference(path, PROMPTS[0], _params()[0])
        assert [c.index for c in completes] == [0, 1] and [list(c.output_ids) for c in completes] == [tokens] * 2
    finally:
        pair.close()
