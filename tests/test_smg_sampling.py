"""Issue 42 through smg's OpenAI API (the wire format an OpenAI SDK sees): chat logprobs with
top_logprobs and frequency / presence penalties, once refused with HTTP 400 "unsupported field",
now answered; the text and every logprob match HF (penalised greedy tokens, log-softmax of the raw
logits); and n = 3 (one prompt, three samples sharing its KV on decode): three choices, indexed 0..2."""

import pytest

from common.engine.sampling import SamplingParams
from common.tools.tokenizer import load_tokenizer
from tests.test_logprobs import hf_reference
from tests.test_smg_gateway import MODEL, _post, gateway  # noqa: F401 (the module's smg + pair fixture)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_and_penalties_through_smg(gateway, stream):  # noqa: F811
    base, path, _, _ = gateway
    tok = load_tokenizer(path)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "frequency_penalty": 1.2,
        "presence_penalty": 0.6,
        "stream": stream,
    }
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    params = SamplingParams(max_new_tokens=8, frequency_penalty=1.2, presence_penalty=0.6, return_logprob=True)
    tokens, ref = hf_reference(path, ids, params, 8)
    if stream:
        from tests.test_smg_gateway import _sse

        choices = [c for e in _sse(_post(base, "/v1/chat/completions", body, stream=True)) for c in e["choices"]]
        content = [x for c in choices if c.get("logprobs") for x in c["logprobs"]["content"]]
        text = "".join(c.get("delta", {}).get("content") or "" for c in choices)
    else:
        choice = _post(base, "/v1/chat/completions", body)["choices"][0]
        content, text = choice["logprobs"]["content"], choice["message"]["content"] or ""
    eos = set(load_tokenizer(path).all_special_ids)
    cut = next((i for i, t in enumerate(tokens) if t in eos), None)
    want = tokens if cut is None else tokens[: cut + 1]
    assert text.rstrip("\ufffd") == tok.decode(want, skip_special_tokens=True).rstrip("\ufffd")
    positions = list(range(len(want)))
    if stream:  # smg streams logprobs only with chunks whose text it emits (not a token ending mid-character)
        assert content, "no logprobs streamed"
        positions, j = [], 0
        for entry in content:  # each streamed entry is the next position with that logprob
            while abs(entry["logprob"] - float(ref[j, want[j]])) >= 1e-4:
                j += 1
                assert j < len(want), f"streamed logprob {entry['logprob']} matches no later position"
            positions.append(j)
            j += 1
    else:
        assert len(content) == len(want)
    for entry, i in zip(content, positions):
        t = want[i]
        assert abs(entry["logprob"] - float(ref[i, t])) < 1e-4, i
        top = ref[i].topk(3).values.tolist()
        got = [x["logprob"] for x in entry["top_logprobs"]]
        assert len(got) == 3 and max(abs(a - b) for a, b in zip(got, top)) < 1e-4, i


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_n_samples_through_smg(gateway, temperature):  # noqa: F811
    base, path, _, _ = gateway
    tok = load_tokenizer(path)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "n": 3, "temperature": temperature}
    choices = _post(base, "/v1/chat/completions", body)["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2]
    texts = [c["message"]["content"] or "" for c in sorted(choices, key=lambda c: c["index"])]
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    if temperature == 0:  # greedy: every sample is HF's greedy answer
        ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
        from tests.oracle import hf_greedy

        want = hf_greedy(path, ids, 6)
        eos = set(tok.all_special_ids)
        cut = next((i for i, t in enumerate(want) if t in eos), None)
        text = tok.decode(want if cut is None else want[: cut + 1], skip_special_tokens=True)
        assert [t.rstrip("\ufffd") for t in texts] == [text.rstrip("\ufffd")] * 3  # smg holds a partial character
