"""The OpenAI HTTP API served by decode itself (--openai-port, issue 56), driven by the official
`openai` SDK against a pair on loopback: each answer is the engine's, token for token the same as the
same request over gRPC (and so as HF where those tests anchor it); streaming and non-streaming agree;
every field is honoured or refused by name; errors are OpenAI-shaped and the service keeps serving."""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.tools.tokenizer import load_tokenizer
from tests.grpc_harness import GrpcPair
from tests.oracle import hf_greedy
from tests.test_metrics import _scrape

N = 10
USER = [{"role": "user", "content": "The decode service then produces"}]


@pytest.fixture(scope="module")
def served(checkpoint):
    path = checkpoint("llama")
    pair = GrpcPair(path, decode_kw=dict(openai_port=0, tool_call_parser="hermes", metrics_port=0))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{pair.decode.openai.port}/v1", api_key="unused", max_retries=0)
    yield pair, client, pair.decode.served_model_name, load_tokenizer(path), path
    pair.close()


def _chat_ids(tok, messages=USER) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)  # fmt: skip


def _post(url: str, body, timeout: float = 30) -> tuple[int, dict]:
    """(status, JSON body) of a raw POST: `body` a dict (sent as JSON) or bytes as they are."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _grpc(pair, ids, n_tokens, **kw) -> tuple[list[int], pb.GenerateComplete]:
    return pair.collect(pair.generate(ids, n_tokens, rid=f"g{time.monotonic_ns()}", **kw))


def test_chat_and_completions_are_the_engines_greedy_tokens(served):
    pair, client, model, tok, path = served
    ids = _chat_ids(tok)
    want = hf_greedy(path, ids, N)
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=N, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == N
    assert r.choices[0].finish_reason == "length"
    c = client.completions.create(model=model, prompt=ids, max_tokens=N, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert c.choices[0].logprobs.tokens == [tok.decode([t]) for t in want]
    assert c.choices[0].text == tok.decode(want, skip_special_tokens=True)


def test_streaming_and_non_streaming_agree(served):
    pair, client, model, tok, _ = served
    # ASCII by a regex: a random model's bytes are rarely valid UTF-8, and a broken byte sequence may be
    # cut differently in a stream (the docs say so); the answers themselves are sampled and seeded
    kw = dict(model=model, messages=USER, max_tokens=12, temperature=0.9, seed=5, n=3,
              extra_body={"regex": "[a-z ]{1,30}"})  # fmt: skip
    whole = client.chat.completions.create(**kw)
    texts, reasons, usage = ["", "", ""], [None] * 3, None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in whole.choices] and all(texts)
    assert reasons == [c.finish_reason for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_logit_bias_forces_its_token_and_bad_values_are_refused(served):
    pair, client, model, tok, _ = served
    forced = 42
    c = client.completions.create(model=model, prompt="The prefill", max_tokens=6, temperature=0, logprobs=0,
                                  logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})  # fmt: skip
    assert c.choices[0].logprobs.tokens == [tok.decode([forced])] * 6
    for bias, what in (({"999999": 5}, "logit_bias"), ({str(forced): 200}, "logit_bias")):
        with pytest.raises(openai.BadRequestError, match=what):
            client.completions.create(model=model, prompt="x", max_tokens=2, logit_bias=bias)


def test_equal_seeds_give_equal_text_and_choice_i_draws_as_seed_plus_i(served):
    pair, client, model, tok, _ = served
    kw = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw, seed=7)
    b = client.completions.create(**kw, seed=7)
    other = client.completions.create(**kw, seed=8)
    assert a.choices[0].text == b.choices[0].text
    both = client.completions.create(**kw, seed=7, n=2)
    assert [c.text for c in both.choices] == [a.choices[0].text, other.choices[0].text]


def test_completions_logprobs_echo_and_token_id_prompts_match_grpc(served):
    pair, client, model, tok, _ = served
    prompts = [[5, 9, 14, 3, 22, 8], [31, 7, 2, 40, 11]]
    c = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0, logprobs=3, echo=True,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert len(c.choices) == 2
    for p, choice in zip(prompts, c.choices):
        ids, done = _grpc(pair, p, 5, ignore_eos=True)
        lp = choice.logprobs
        assert lp.tokens == [tok.decode([t]) for t in p + ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = pair.stub.Generate(pb.GenerateRequest(
            request_id="lp", tokenized=pb.TokenizedInput(input_ids=p), return_logprob=True, top_logprobs_num=3,
            logprob_start_len=0, sampling_params=pb.SamplingParams(max_new_tokens=5, ignore_eos=True)))  # fmt: skip
        complete = [r.complete for r in want if r.HasField("complete")][0]
        prompt_values = [e.value for e in complete.input_logprobs.token_logprobs[1:]]
        assert lp.token_logprobs[1:] == pytest.approx(prompt_values + list(complete.output_logprobs.token_logprobs))
        assert choice.text == tok.decode(p, skip_special_tokens=True) + tok.decode(ids, skip_special_tokens=True)
        assert len(lp.text_offset) == len(lp.tokens)


def test_sampling_fields_give_the_grpc_tokens(served):
    """Penalties, filters and min_tokens through the API are the same request over gRPC (greedy after
    the processors, so both are deterministic)."""
    pair, client, model, tok, _ = served
    ids = [31, 7, 2, 40, 11]
    fields = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3, top_k=5, min_p=0.05)
    want, _ = _grpc(pair, ids, 12, min_new_tokens=3, temperature=0, **fields)
    extra = dict(repetition_penalty=1.3, top_k=5, min_p=0.05, min_tokens=3)
    c = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0, logprobs=0,
                                  frequency_penalty=0.5, presence_penalty=0.3, extra_body=extra)  # fmt: skip
    assert c.choices[0].logprobs.tokens == [tok.decode([t]) for t in want]


def test_chat_logprobs_are_the_grpc_logprobs(served):
    pair, client, model, tok, _ = served
    ids = _chat_ids(tok)
    sp = pb.SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = list(pair.stub.Generate(pb.GenerateRequest(
        request_id="lp", tokenized=pb.TokenizedInput(input_ids=ids), return_logprob=True, top_logprobs_num=3,
        logprob_start_len=-1, sampling_params=sp)))[-1].complete  # fmt: skip
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [tok.decode([t]) for t in want.output_ids]
    assert [e.logprob for e in content] == pytest.approx(list(want.output_logprobs.token_logprobs), abs=1e-5)
    for e, top in zip(content, want.output_logprobs.top_logprobs):
        assert [t.token for t in e.top_logprobs] == [tok.decode([t]) for t in top.token_ids]
        assert e.bytes == list(e.token.encode())


def test_n_32(served):
    pair, client, model, tok, _ = served
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=4, temperature=1.0, seed=1, n=32)
    assert sorted(c.index for c in r.choices) == list(range(32))
    assert r.usage.completion_tokens == sum(4 for _ in r.choices) or all(c.finish_reason for c in r.choices)


def test_stop_strings_end_decoding_in_the_engine(served):
    """The answer without the stop (ASCII by a regex: a random model's bytes are rarely valid UTF-8),
    then with a stop string it first completes at token k: the engine ends there, the text before it."""
    pair, client, model, tok, path = served
    extra = {"ignore_eos": True, "regex": "[a-z ]{40}"}
    base = dict(model=model, prompt=[5, 9, 14, 3, 22, 8], max_tokens=40, temperature=0)
    full = client.completions.create(**base, logprobs=0, extra_body=extra).choices[0]
    text = ["".join(full.logprobs.tokens[:k]) for k in range(len(full.logprobs.tokens) + 1)]
    k = next(k for k in range(4, len(text)) if len(text[k]) >= 3 and text[k][-3:] not in text[k - 1])
    stop = text[k][-3:]  # first completed by token k
    c = client.completions.create(**base, stop=[stop], extra_body=extra)
    assert c.usage.completion_tokens == k and c.choices[0].finish_reason == "stop"  # the engine stopped there
    assert c.choices[0].text == text[k][: text[k].find(stop)]
    kept = client.completions.create(**base, stop=[stop], extra_body=dict(extra, include_stop_str_in_output=True))
    assert kept.choices[0].text == text[k][: text[k].find(stop) + 3]
    stream = client.completions.create(**base, stop=[stop], stream=True, extra_body=extra)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == c.choices[0].text


def test_max_tokens_unset_runs_to_the_end_of_the_context(served):
    pair, client, model, tok, _ = served
    c = client.completions.create(model=model, prompt=[5, 9, 14], temperature=0, extra_body={"ignore_eos": True})
    assert c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == pair.decode.runner.context_length - 3


def test_grammars_and_tool_choice(served):
    pair, client, model, tok, _ = served
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=40, temperature=0,
                                       response_format=fmt)  # fmt: skip
    assert set(json.loads(r.choices[0].message.content)) == {"a"}
    r = client.completions.create(model=model, prompt="x", max_tokens=20, temperature=0,
                                  extra_body={"regex": "(ab|cd)+[0-9]{2}"})  # fmt: skip
    assert re.fullmatch("(ab|cd)+[0-9]{2}", r.choices[0].text)
    r = client.completions.create(model=model, prompt="x", max_tokens=8, temperature=0,
                                  extra_body={"ebnf": 'root ::= "yes" | "no"'})  # fmt: skip
    assert r.choices[0].text in ("yes", "no")
    tag = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
           "triggers": ["<f>"]}  # fmt: skip
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=30, temperature=0,
                                       response_format=tag)  # fmt: skip
    for body in re.findall("<f>(.*?)</f>", r.choices[0].message.content, re.DOTALL):  # tagged parts: the schema
        assert set(json.loads(body)) == {"a"}
    with pytest.raises(openai.BadRequestError, match="structural_tag"):  # it reached the engine's compiler
        client.chat.completions.create(model=model, messages=USER, response_format={"type": "structural_tag",
                                       "structures": [{"begin": "<f>"}]})  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
        "additionalProperties": False}}}]  # fmt: skip
    answers = {}
    for choice in ("required", {"type": "function", "function": {"name": "get"}}):
        r = client.chat.completions.create(model=model, messages=USER, max_tokens=300, temperature=0,
                                           tools=tools, tool_choice=choice)  # fmt: skip
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get", r
        assert set(json.loads(calls[0].function.arguments)) == {"city"}
        assert r.choices[0].finish_reason == "tool_calls"
        answers[str(choice)] = calls[0].function.arguments
    stream = client.chat.completions.create(model=model, messages=USER, max_tokens=300, temperature=0,
                                            tools=tools, tool_choice="required", stream=True)  # fmt: skip
    deltas = [ch.choices[0].delta for ch in stream if ch.choices and ch.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0].tool_calls[0].function.name == "get"
    assert deltas[0].tool_calls[0].function.arguments == answers["required"]  # the same seed's call
    with pytest.raises(openai.BadRequestError, match="at most one constraint"):
        client.chat.completions.create(model=model, messages=USER, tools=tools, tool_choice="required",
                                       response_format={"type": "json_object"})  # fmt: skip


def test_hermes_and_llama3_tool_call_parsers():
    from decode_service.openai_api.chat import parse_calls

    content, calls = parse_calls("hermes", 'ok <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert content == "ok" and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    content, calls = parse_calls("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", '
                                 '"parameters": {}}')  # fmt: skip
    assert content is None and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert parse_calls("llama3_json", "Paris.") == ("Paris.", [])
    assert parse_calls("hermes", "<tool_call>{broken</tool_call>")[1] == []


def test_a_client_that_goes_away_aborts_and_frees_the_request(served):
    """A streaming client that closes after its first chunk, and a non-streaming one whose connection
    closes while its request decodes: both requests are aborted (counted), long before their 500
    tokens, and every slot comes back once. Waits are bounded (10 s for a request to reach the
    scheduler; the harness's idle wait)."""
    pair, client, model, tok, _ = served
    sched = pair.decode.scheduler
    aborts = _scrape(pair.decode.metrics_port)["disagg_aborted_requests_total"]
    stream = client.completions.create(model=model, prompt=[5, 9, 14], max_tokens=500, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(stream))
    stream.close()
    pair.wait_idle()  # every slot freed once (the pools' integrity checked)
    body = json.dumps({"model": model, "prompt": [5, 9], "max_tokens": 500, "ignore_eos": True}).encode()
    conn = socket.create_connection(("127.0.0.1", pair.decode.openai.port), timeout=10)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    deadline = time.time() + 10
    while not sched.reqs:  # the request reached the scheduler: now its client goes away
        assert time.time() < deadline, "the request never reached the scheduler"
        time.sleep(0.01)
    conn.close()
    pair.wait_idle()  # and the books balance (check_idle_books)
    assert _scrape(pair.decode.metrics_port)["disagg_aborted_requests_total"] == aborts + 2


def test_errors_are_openai_shaped_and_the_service_keeps_serving(served):
    pair, client, model, tok, _ = served
    url = f"http://127.0.0.1:{pair.decode.openai.port}/v1"
    status, body = _post(f"{url}/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = _post(f"{url}/completions", {"model": model, "prompt": "x", "temperature": 5})
    assert status == 400 and body["error"]["param"] == "temperature"
    status, body = _post(f"{url}/completions", {"model": model, "prompt": "x", "suffix": "y"})
    assert status == 400 and body["error"]["param"] == "suffix"
    status, body = _post(f"{url}/completions", {"model": "other", "prompt": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    conn = http.client.HTTPConnection("127.0.0.1", pair.decode.openai.port, timeout=10)
    conn.putrequest("POST", "/v1/completions")  # a body declared past the bound: refused before it is read
    conn.putheader("content-type", "application/json")
    conn.putheader("content-length", str(pair.decode.openai.limit + 1))
    conn.endheaders()
    reply = conn.getresponse()
    assert reply.status == 413 and json.loads(reply.read())["error"]["type"] == "invalid_request_error"
    conn.close()
    status, body = _post(f"{url}/completions", {"model": model, "prompt": [5] * 600})
    assert status == 400 and "context" in body["error"]["message"]
    status, body = _post(f"{url}/completions", {"model": model, "prompt": "x", "stop_regex": "a"})
    assert status == 400 and body["error"]["message"] == "unsupported field: stop_regex"
    with urllib.request.urlopen(f"{url.removesuffix('/v1')}/health") as r:
        assert r.status == 200
    r = client.completions.create(model=model, prompt="x", max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_the_api_key_guards_the_http_api_too(checkpoint):
    pair = GrpcPair(checkpoint("llama"), decode_kw=dict(openai_port=0, api_key="s3cret"))
    try:
        url = f"http://127.0.0.1:{pair.decode.openai.port}/v1"
        bad = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list().data] == [pair.decode.served_model_name]
    finally:
        pair.close()


def test_smg_over_http_forwards_what_its_grpc_path_drops(served, tmp_path):
    """smg 1.13 in front of decode's OpenAI API (--worker-urls http://...), the path compose and k8s
    take: logit_bias forces its token, equal seeds give equal text, completions return logprobs and
    stop strings end decoding in the engine (over gRPC smg drops the first three and matches stops
    itself). smg's own limits stay: token-id prompts and n above 10 are refused by the gateway."""
    from common.tools.smg import smg_in_front_of

    pair, _, model, tok, _ = served
    with smg_in_front_of(f"http://127.0.0.1:{pair.decode.openai.port}", str(tmp_path / "smg.log")) as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        r = c.completions.create(model=model, prompt="The prefill", max_tokens=4, temperature=0, logprobs=1,
                                 logit_bias={"42": 100}, extra_body={"ignore_eos": True})  # fmt: skip
        assert r.choices[0].logprobs.tokens == [tok.decode([42])] * 4
        kw = dict(model=model, messages=USER, max_tokens=10, temperature=1.0, seed=7)
        assert c.chat.completions.create(**kw).choices[0].message.content == (
            c.chat.completions.create(**kw).choices[0].message.content
        )
        r = c.completions.create(model=model, prompt="The prefill", max_tokens=30, temperature=0,
                                 stop=[tok.decode([42])], logit_bias={"42": 100})  # fmt: skip
        assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=model, prompt=[5, 9, 14], max_tokens=2)
