"""Penalties and logit_bias (issue 42 a): repetition (HF), frequency and presence (OpenAI: output
tokens only) and logit_bias, in that order, token-exact against HF generate(do_sample=False) with
HF's own RepetitionPenaltyLogitsProcessor and short processors written here for the others; in every
mode: in-process with overlap on and off, EAGLE chain and tree (each verify node penalised with its
own path), and over gRPC (the prefill's first token penalised from the prompt on the other side)."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from common.engine.penalties import LogitProcessors, PenaltyCounts, state_from_ids
from common.engine.sampling import SamplingParams
from tests.decode_harness import Pair
from tests.grpc_harness import GrpcPair, assert_invalid_fields
from tests.oracle import hf_greedy, hf_model

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [3, 4, 3, 4, 3]]
N = 12
N_EAGLE = 32  # EAGLE's penalty counts: a bonus token left out of them first changed a token at 14 (of 24)


class FreqPres(LogitsProcessor):
    """OpenAI's frequency and presence penalties: output tokens only (past the prompt)."""

    def __init__(self, prompt_len: int, freq: float, pres: float):
        self.prompt_len, self.freq, self.pres = prompt_len, freq, pres

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.freq * counts - self.pres * (counts > 0).to(scores.dtype)


class Bias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]):
        self.bias = bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for t, b in self.bias.items():
            scores[:, t] += b
        return scores


@torch.inference_mode()
def hf_processed(path: str, prompt: list[int], params: SamplingParams, max_new: int = N) -> list[int]:
    procs = []
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        procs.append(FreqPres(len(prompt), params.frequency_penalty, params.presence_penalty))
    if params.logit_bias:
        procs.append(Bias(params.logit_bias))
    out = hf_model(path).generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        logits_processor=LogitsProcessorList(procs),
    )
    return out[0, len(prompt) :].tolist()


def _params(path: str) -> list[SamplingParams]:
    """One of each processor, each strong enough to change HF's greedy output on its prompt."""
    ref = hf_greedy(path, PROMPTS[2], N)
    return [
        SamplingParams(max_new_tokens=N, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(max_new_tokens=N, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.7),
        SamplingParams(max_new_tokens=N, ignore_eos=True, logit_bias={ref[3]: -100.0, 17: 3.0}, presence_penalty=-0.5),
    ]


@pytest.fixture(scope="module")
def cases(checkpoint):
    path = checkpoint("llama")
    params = _params(path)
    want = [hf_processed(path, p, sp) for p, sp in zip(PROMPTS, params)]
    changed = [w != hf_greedy(path, p, N) for p, w in zip(PROMPTS, want)]
    assert all(changed), f"a processor left HF's greedy output unchanged: {changed}"
    return path, params, want


def test_penalize_matches_hf_repetition_and_openai_semantics():
    torch.manual_seed(0)
    logits = torch.randn(2, 16)
    ids = torch.tensor([[1, 2, 2, 5], [3, 3, 3, 9]])
    want = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    want = FreqPres(2, 0.4, 0.25)(ids, want)
    want = Bias({4: 2.0})(ids, want)
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25, logit_bias={4: 2.0})]
    procs = LogitProcessors(params * 2, torch.device("cpu"))
    state = state_from_ids([r[:2] for r in ids.tolist()], [r[2:] for r in ids.tolist()], 16, "cpu")
    assert torch.allclose(procs.apply(logits, *state), want)
    counts = PenaltyCounts(4, 16, "cpu")  # the decode side's per-row state gives the same
    for row, r in zip((1, 3), ids.tolist()):
        counts.seed(row, r[:2], r[2:3])
    counts.add(torch.tensor([1, 3]), ids[:, 3])
    assert torch.allclose(procs.apply(logits, *counts.gather(torch.tensor([1, 3]))), want)


def test_verify_nodes_are_penalised_with_their_own_path():
    """apply_on_paths == penalize each node with the base state plus its ancestors' tokens."""
    torch.manual_seed(1)
    b, m, v = 3, 5, 12
    logits = torch.randn(b, m, v)
    tokens = torch.randint(0, 6, (b, m))
    parent = torch.tensor([[0, 0, 0, 1, 3], [0, 0, 1, 2, 3], [0, 0, 1, 1, 2]])
    anc = torch.zeros(b, m, m, dtype=torch.bool)
    for i in range(b):
        for node in range(m):
            j = node
            while True:
                anc[i, node, j] = True
                if j == 0:
                    break
                j = int(parent[i, j])
    params = [
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2, logit_bias={2: 1.0}),
        SamplingParams(),
        SamplingParams(frequency_penalty=-0.7),
    ]
    procs = LogitProcessors(params, torch.device("cpu"))
    prompts, outputs = [[1, 7], [], [8]], [[2], [], [3, 3]]
    state = state_from_ids([prompts[i] for i in procs.rows_cpu], [outputs[i] for i in procs.rows_cpu], v, "cpu")
    got = procs.apply_on_paths(logits, *state, anc, tokens)
    for i in range(b):
        for node in range(m):
            path = [int(tokens[i, j]) for j in range(m) if anc[i, node, j]]
            one = LogitProcessors([params[i]], torch.device("cpu"))
            if not one.rows_cpu:
                assert torch.equal(got[i, node], logits[i, node])
                continue
            st = state_from_ids([prompts[i]], [outputs[i] + path], v, "cpu")
            assert torch.allclose(got[i, node], one.apply(logits[i, node][None], *st)[0]), (i, node)


@pytest.mark.parametrize("overlap", [True, False])
def test_penalties_match_hf_in_process(cases, overlap):
    path, params, want = cases
    pair = Pair(path, overlap=overlap)
    try:
        for i, (p, sp) in enumerate(zip(PROMPTS, params)):
            pair.submit(str(i), p, sp)
        pair.submit("plain", PROMPTS[0], SamplingParams(max_new_tokens=N, ignore_eos=True))  # shares the batch
        pair.wait([str(i) for i in range(len(PROMPTS))] + ["plain"])
        for i in range(len(PROMPTS)):
            assert pair.out.tokens[str(i)] == want[i], f"prompt {i}"
        assert pair.out.tokens["plain"] == hf_greedy(path, PROMPTS[0], N)
    finally:
        pair.close()


@pytest.mark.parametrize("algorithm,topk", [("EAGLE", 1), ("EAGLE3", 2)])
def test_penalties_with_eagle_match_hf(checkpoint, fitted_head, algorithm, topk):
    """A chain and a tree over 32 tokens: every committed token (the bonus too) joins the counts the
    next verify's processors read; each prompt's processor changes HF's output."""
    from common.engine.draft_runner import SpecArgs
    from tests.test_eagle import chat_prompts

    path, n = checkpoint("llama"), N_EAGLE
    prompts = chat_prompts(path, 3)
    params = [
        SamplingParams(max_new_tokens=n, ignore_eos=True, repetition_penalty=1.6),
        SamplingParams(max_new_tokens=n, ignore_eos=True, frequency_penalty=1.2, presence_penalty=0.4),
        SamplingParams(max_new_tokens=n, ignore_eos=True, logit_bias={hf_greedy(path, prompts[2], n)[2]: -50.0}),
    ]
    want = [hf_processed(path, p, sp, n) for p, sp in zip(prompts, params)]
    assert all(w != hf_greedy(path, p, n) for p, w in zip(prompts, want)), "a processor changed nothing"
    steps, nodes = (3, 4) if topk == 1 else (2, 4)
    pair = Pair(path, spec=SpecArgs(algorithm, fitted_head("llama", algorithm), steps, topk, nodes))
    try:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            pair.submit(str(i), p, sp)
        pair.wait([str(i) for i in range(len(prompts))])
        for i in range(len(prompts)):
            assert pair.out.tokens[str(i)] == want[i], f"prompt {i}"
        assert sum(f.spec_accepted for f in pair.out.finishes.values()) > 0, "no draft accepted: verify untested"
    finally:
        pair.close()


def test_penalties_over_grpc_match_hf(cases):
    path, params, want = cases
    pair = GrpcPair(path)
    try:
        for i, (p, sp) in enumerate(zip(PROMPTS, params)):
            call = pair.generate(
                p,
                N,
                stream=i % 2 == 0,
                rid=f"p{i}",
                ignore_eos=True,
                repetition_penalty=sp.repetition_penalty,
                frequency_penalty=sp.frequency_penalty,
                presence_penalty=sp.presence_penalty,
                logit_bias={str(t): b for t, b in sp.logit_bias.items()},
            )
            ids, _ = pair.collect(call)
            assert ids == want[i], f"prompt {i}"
        bad = [
            ({"frequency_penalty": 2.5}, "frequency_penalty"),
            ({"presence_penalty": -3.0}, "presence_penalty"),
            ({"repetition_penalty": 2.5}, "repetition_penalty"),
            ({"logit_bias": {"5": 101.0}}, "logit_bias"),
            ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
            ({"logit_bias": {"999999": 1.0}}, "logit_bias"),
        ]
        assert_invalid_fields(pair, PROMPTS[0], bad)
    finally:
        pair.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_sampled_penalties_match_the_colocated_loop(checkpoint, overlap):
    """temperature > 0 with seeds: the pair (device counts updated on the stream) draws the same tokens
    as the colocated reference loop (counts from the ids on the host), whatever the overlap."""
    from common.engine.colocated import ColocatedLoop
    from common.engine.model_runner import ModelRunner, RunnerArgs

    path = checkpoint("llama")
    params = [
        SamplingParams(max_new_tokens=N, ignore_eos=True, temperature=0.9, seed=11, repetition_penalty=1.5),
        SamplingParams(max_new_tokens=N, ignore_eos=True, temperature=1.2, top_k=20, seed=12, frequency_penalty=1.5),
        SamplingParams(max_new_tokens=N, ignore_eos=True, temperature=0.8, top_p=0.9, seed=13, logit_bias={9: 5.0}),
    ]
    loop = ColocatedLoop(ModelRunner(RunnerArgs(path, max_total_tokens=512, max_running_requests=4)))
    want = [r.output for r in loop.generate(PROMPTS, params)]
    plain = [r.output for r in loop.generate(PROMPTS, [dataclasses_replace_plain(sp) for sp in params])]
    assert all(w != p for w, p in zip(want, plain)), "a processor did not change the sampled output"
    pair = Pair(path, overlap=overlap)
    try:
        for i, (p, sp) in enumerate(zip(PROMPTS, params)):
            pair.submit(str(i), p, sp)
        pair.wait([str(i) for i in range(len(PROMPTS))])
        for i in range(len(PROMPTS)):
            assert pair.out.tokens[str(i)] == want[i], f"prompt {i}"
    finally:
        pair.close()


def dataclasses_replace_plain(sp: SamplingParams) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(sp, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, logit_bias={})


def test_a_step_with_penalties_and_logprobs_travels_between_tp_ranks():
    """A SamplingBatch that has cached its processors and logprob rows, and a Handoff with the first
    token's logprobs, round-trip through the TP message codec (decode's followers run the same step)."""
    from common.engine.handoff import Handoff
    from common.engine.logprobs import TokenLogprobs
    from common.engine.sampling import SamplingBatch
    from common.parallel import tp_codec

    params = [SamplingParams(frequency_penalty=1.0, logit_bias={3: 2.0}, return_logprob=True, top_logprobs_num=2)]
    batch = SamplingBatch(params, [5])
    cpu = torch.device("cpu")
    assert batch.processors(cpu) is not None and batch.logprob_rows(cpu) is not None
    back = tp_codec.loads(bytearray(tp_codec.dumps(batch)), cpu)
    assert torch.equal(back.processors(cpu).bias_ids, batch.processors(cpu).bias_ids)
    assert back.params[0].logit_bias == {3: 2.0}
    lp = TokenLogprobs(-0.5, ((3, -0.5), (4, -1.0)), ())
    h = Handoff("r", [1, 2], params[0], 5, 3, None, None, first_logprobs=lp)
    assert tp_codec.loads(bytearray(tp_codec.dumps(h)), cpu).first_logprobs == lp
