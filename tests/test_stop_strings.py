"""Stop strings (issue 42 c): decode detokenizes as tokens arrive and finishes at the first token whose
text completes a stop string (finish "stop", matched_stop_str), in-process (overlap on and off, EAGLE
chain: several tokens per step) and over gRPC; bad `stop` values are INVALID_ARGUMENT naming it."""

import grpc
import pytest

from common.engine.sampling import SamplingParams
from common.tools.tokenizer import load_tokenizer
from decode_service.stop_strings import StopStrings
from tests.decode_harness import Pair
from tests.grpc_harness import GrpcPair
from tests.oracle import hf_greedy

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [3, 4, 3, 4, 3]]
N = 16


def stop_case(path: str, prompt: list[int], k: int) -> tuple[str, list[int]]:
    """A stop string that the text of greedy token k completes (its last characters, spanning into the
    token before when it can), found nowhere earlier; and the ids up to that token."""
    tok = load_tokenizer(path)
    ref = hf_greedy(path, prompt, N)
    for j in range(k, N):
        before, text = (
            tok.decode(ref[:j], skip_special_tokens=False),
            tok.decode(ref[: j + 1], skip_special_tokens=False),
        )
        new = len(text) - len(before)
        if new < 1 or text.endswith("\ufffd"):
            continue
        for width in range(min(len(text), new + 2), 0, -1):
            stop = text[-width:]
            if stop not in text[:-1] and stop.strip() and "\ufffd" not in stop:
                return stop, ref[: j + 1]
    raise AssertionError("no usable stop string in the greedy text")


@pytest.mark.parametrize("overlap", [True, False])
def test_stop_strings_in_process(checkpoint, overlap):
    path = checkpoint("llama")
    pair = Pair(path, overlap=overlap)
    pair.scheduler.stop_strings = StopStrings(path)
    try:
        cases = [stop_case(path, p, k) for p, k in zip(PROMPTS, (3, 6, 0))]
        for i, (p, (stop, _)) in enumerate(zip(PROMPTS, cases)):
            pair.submit(str(i), p, SamplingParams(max_new_tokens=N, ignore_eos=True, stop_strings=(stop, "\x00never")))
        pair.wait([str(i) for i in range(len(PROMPTS))])
        for i, (stop, want) in enumerate(cases):
            assert pair.out.tokens[str(i)] == want, f"prompt {i}"
            finish = pair.out.finishes[str(i)]
            assert (finish.reason, finish.matched_stop_str, finish.matched_stop) == ("stop", stop, None)
    finally:
        pair.close()


def test_stop_strings_with_eagle_cut_inside_a_step(checkpoint, fitted_head):
    from common.engine.draft_runner import SpecArgs
    from tests.test_eagle import chat_prompts

    path = checkpoint("llama")
    prompts = chat_prompts(path, 3)
    pair = Pair(path, spec=SpecArgs("EAGLE", fitted_head("llama", "EAGLE"), 3, 1, 4))
    pair.scheduler.stop_strings = StopStrings(path)
    try:
        cases = [stop_case(path, p, k) for p, k in zip(prompts, (2, 5, 7))]
        for i, (p, (stop, _)) in enumerate(zip(prompts, cases)):
            pair.submit(str(i), p, SamplingParams(max_new_tokens=N, ignore_eos=True, stop_strings=(stop,)))
        pair.wait([str(i) for i in range(len(prompts))])
        for i, (stop, want) in enumerate(cases):
            assert pair.out.tokens[str(i)] == want, f"prompt {i}"
            assert pair.out.finishes[str(i)].matched_stop_str == stop
        assert sum(f.spec_accepted for f in pair.out.finishes.values()) > 0
    finally:
        pair.close()


def test_stop_strings_over_grpc(checkpoint):
    path = checkpoint("llama")
    pair = GrpcPair(path)
    try:
        for i, (p, k) in enumerate(zip(PROMPTS, (4, 1))):
            stop, want = stop_case(path, p, k)
            ids, complete = pair.collect(pair.generate(p, N, stream=i == 0, rid=f"s{i}", ignore_eos=True, stop=[stop]))
            assert ids == want
            assert complete.finish_reason == "stop" and complete.matched_stop_str == stop
            assert complete.WhichOneof("matched_stop") == "matched_stop_str"
        for stop in ([""], ["x" * 300], ["a"] * 17):
            with pytest.raises(grpc.RpcError) as err:
                pair.collect(pair.generate(PROMPTS[0], 4, rid="bad", stop=stop))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop" in err.value.details()
    finally:
        pair.close()


class _Counting:
    """A tokenizer that counts the ids each decode call is given."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, **kw):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_incremental_search_finds_what_the_whole_text_holds_at_a_bounded_cost(checkpoint, seed):
    """Token by token over 1,500 ids: the first check that reports a stop is the first whose whole
    decoded text holds one, with the same (earliest) stop; every check decodes a few ids, not the
    whole output (it decoded everything at every token before: 4.8 ms a token at 8k tokens)."""
    from types import SimpleNamespace

    import torch

    path = checkpoint("llama")
    tok = load_tokenizer(path)
    g = torch.Generator().manual_seed(seed)
    plain = [i for i in range(3, 300) if (t := tok.decode([i])) and t.isascii() and t.isprintable()]  # whole characters
    ids = [plain[j] for j in torch.randint(0, len(plain), (1500,), generator=g).tolist()]
    text = tok.decode(ids, skip_special_tokens=False)
    at = int(torch.randint(len(text) // 2, len(text) - 12, (1,), generator=g))
    stops = (text[at : at + 9], text[at + 3 : at + 5] + "\x00", "\x00nowhere")
    matcher = StopStrings(path)
    matcher._tokenizer = counting = _Counting(tok)
    req = SimpleNamespace(params=SamplingParams(stop_strings=stops), output_ids=[], stop_scan=(0, 0, ""))
    got = None
    for k, t in enumerate(ids, 1):
        req.output_ids.append(t)
        if (found := matcher.match(req)) is not None:
            got = (k, found)
            break
    whole = next(
        k for k in range(1, len(ids) + 1) if any(s in tok.decode(ids[:k], skip_special_tokens=False) for s in stops)
    )
    assert got == (whole, stops[0])
    assert max(counting.sizes) <= 2, "a check decoded more than the newest token and the one before"
