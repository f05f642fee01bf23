"""min_new_tokens: EOS and stop ids are masked until that many outputs, as HF's
MinNewTokensLengthLogitsProcessor masks EOS. The oracle is HF generate(min_new_tokens=m,
eos_token_id=s) with s a token greedy decoding would emit early (here our request's stop id), so
the mask decides the output; the prefill's first token is masked too (s = the first greedy token)."""

import pytest
import torch

from common.engine.sampling import SamplingBatch, SamplingParams
from tests.decode_harness import Pair
from tests.grpc_harness import GrpcPair
from tests.oracle import hf_greedy, hf_model

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3, 4]]


@torch.inference_mode()
def hf_min_tokens(path: str, prompt: list[int], stop: int, min_new: int, max_new: int) -> list[int]:
    out = hf_model(path).generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        do_sample=False,
        eos_token_id=stop,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def _cases(path: str) -> list[tuple[list[int], int, int]]:
    """(prompt, stop id, min_new_tokens): the stop is the 1st or 3rd greedy token, so unmasked it
    would end the request at once or early."""
    cases = []
    for i, p in enumerate(PROMPTS):
        ref = hf_greedy(path, p, 10)
        k = 0 if i % 2 == 0 else 2
        cases.append((p, ref[k], k + 3))
    return cases


def test_the_mask_holds_back_eos_and_stop_ids_only_below_the_minimum():
    logits = torch.zeros(3, 8)
    logits[:, 5] = 3.0  # EOS would win
    logits[:, 6] = 2.0  # then the stop id
    params = [
        SamplingParams(max_new_tokens=8, min_new_tokens=4, stop_token_ids=(6,)),
        SamplingParams(max_new_tokens=8, min_new_tokens=4, stop_token_ids=(6,)),
        SamplingParams(max_new_tokens=8),
    ]
    tokens = SamplingBatch(params, [1, 2, 3]).sample(logits, [3, 4, 0], eos_token_ids=(5,))
    assert tokens.tolist() == [0, 5, 5]  # row 0 below its minimum: neither 5 nor 6; the others free
    assert logits[0, 5] == 3.0  # the caller's logits are not changed
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=2, min_new_tokens=-1).validate()


@pytest.mark.parametrize("overlap", [True, False])
def test_min_new_tokens_match_hf_in_process(checkpoint, overlap):
    path = checkpoint("llama")
    pair = Pair(path, overlap=overlap)
    cases = _cases(path)
    for i, (p, stop, m) in enumerate(cases):
        pair.submit(str(i), p, SamplingParams(max_new_tokens=10, min_new_tokens=m, stop_token_ids=(stop,)))
    pair.wait([str(i) for i in range(len(cases))])
    for i, (p, stop, m) in enumerate(cases):
        want = hf_min_tokens(path, p, stop, m, 10)
        assert pair.out.tokens[str(i)] == want, f"prompt {i}"
        assert len(want) >= m
    pair.close()


def test_min_new_tokens_over_grpc_mask_the_prefill_token_too(checkpoint):
    path = checkpoint("llama")
    pair = GrpcPair(path)
    try:
        for i, (p, stop, m) in enumerate(_cases(path)):
            call = pair.generate(p, 10, stream=i % 2 == 0, rid=f"m{i}", min_new_tokens=m, stop_token_ids=[stop])
            ids, complete = pair.collect(call)
            assert ids == hf_min_tokens(path, p, stop, m, 10), f"prompt {i}"
            assert complete.finish_reason in ("stop", "length")
    finally:
        pair.close()


@pytest.mark.parametrize("algorithm,topk", [("EAGLE", 1), ("EAGLE3", 2)])
def test_min_new_tokens_with_eagle_match_hf(checkpoint, fitted_head, algorithm, topk):
    """EAGLE chain and tree: the verify's target at each node is masked by the node's own output
    position (drafts past the minimum may still stop the request). Fitted heads on chat prompts draft
    the stop id itself below the minimum (a spy sees it), so the mask inside the verify decides."""
    from common.engine.draft_runner import SpecArgs
    from tests.decode_harness import Hooks
    from tests.test_eagle import chat_prompts

    path = checkpoint("llama")
    cases = []  # the stop is greedy token k: k = 1 is always drafted from the first decode step's root
    for p, k in zip(chat_prompts(path, 4), (0, 1, 2, 1)):
        ref = hf_greedy(path, p, 10)
        cases.append((p, ref[k], k + 3))
    stops = {str(i): (stop, m) for i, (_, stop, m) in enumerate(cases)}
    early = []  # (rid, output index) of every stop id drafted below its request's minimum

    def spy(lanes, seq_lens, tokens, depth):
        for lane, ((rid, prompt_len), n) in enumerate(zip(lanes, seq_lens)):
            stop, m = stops[rid]
            pos = n - prompt_len  # output index of the pending bonus token
            early.extend((rid, pos + int(d)) for t, d in zip(tokens[lane], depth[lane]) if t == stop and pos + d < m)
        return tokens

    if topk == 1:
        hooks = Hooks(
            propose=lambda lanes, n, drafts: spy(
                lanes, n, drafts, torch.arange(1, drafts.shape[1] + 1).expand_as(drafts)
            )
        )
    else:
        hooks = Hooks(propose_tree=lambda lanes, n, tokens, parent, depth: spy(lanes, n, tokens, depth))
    steps, nodes = (3, 4) if topk == 1 else (2, 4)
    pair = Pair(path, spec=SpecArgs(algorithm, fitted_head("llama", algorithm), steps, topk, nodes), hooks=hooks)
    for i, (p, stop, m) in enumerate(cases):
        pair.submit(str(i), p, SamplingParams(max_new_tokens=10, min_new_tokens=m, stop_token_ids=(stop,)))
    pair.wait([str(i) for i in range(len(cases))])
    for i, (p, stop, m) in enumerate(cases):
        assert pair.out.tokens[str(i)] == hf_min_tokens(path, p, stop, m, 10), f"prompt {i}"
    assert early, "no stop id was drafted below the minimum: the verify's mask went untested"
    pair.close()
