"""The smg gateway in front of the decode service: OpenAI API text equals the HF oracle's text.

Fails (does not skip) when smg is missing: it is part of the dev extra.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest

from common.models.config import load_model_config
from common.tools.smg import smg_binary, smg_in_front_of
from common.tools.tokenizer import load_tokenizer
from tests.grpc_harness import GrpcPair
from tests.oracle import hf_greedy

MODEL = "tiny-llama"


def _smg_binary() -> str:
    try:
        return smg_binary()
    except FileNotFoundError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def gateway(checkpoint):
    path = checkpoint("llama")
    pair = GrpcPair(path, decode_kw=dict(served_model_name=MODEL, default_max_new_tokens=16))
    sched, reasons = pair.decode.scheduler, {}
    finish = sched.finish
    sched.finish = lambda req, reason, *a, **k: (reasons.__setitem__(req.rid, reason), finish(req, reason, *a, **k))
    try:
        with smg_in_front_of(pair.decode.address, os.path.join(os.path.dirname(path), "smg.log")) as base:
            yield base, path, pair, reasons
    finally:
        pair.close()


def _post(base: str, route: str, body: dict, stream: bool = False):
    req = urllib.request.Request(
        f"{base}{route}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    resp = urllib.request.urlopen(req, timeout=60)
    if not stream:
        return json.loads(resp.read())
    return resp


def _sse(resp) -> list[dict]:
    events = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def _oracle(path: str, ids: list[int], max_tokens: int) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) the gateway should report for greedy decoding."""
    ref = hf_greedy(path, ids, max_tokens)
    eos = load_model_config(path).eos_token_ids
    cut = next((i for i, t in enumerate(ref) if t in eos), None)
    ref = ref if cut is None else ref[: cut + 1]
    text = load_tokenizer(path).decode(ref, skip_special_tokens=True)
    return text.rstrip("\ufffd"), len(ref), "length" if cut is None else "stop"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_routes_match_the_oracle(gateway, route, stream):
    base, path, _, _ = gateway
    tok = load_tokenizer(path)
    body = {"model": MODEL, "max_tokens": 10, "temperature": 0, "stream": stream}
    if route == "/v1/completions":
        body["prompt"] = "Hello, world! How are you"
        ids = tok.encode(body["prompt"])
    else:
        body["messages"] = [{"role": "user", "content": "What is the capital of France?"}]
        ids = list(tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)["input_ids"])
    if stream:
        body["stream_options"] = {"include_usage": True}
        events = _sse(_post(base, route, body, stream=True))
        choices = [c for e in events for c in e.get("choices", [])]
        key = "text" if route == "/v1/completions" else "delta"
        text = "".join((c.get(key) if key == "text" else c.get("delta", {}).get("content")) or "" for c in choices)
        finish = [c["finish_reason"] for c in choices if c.get("finish_reason")][-1]
        usage = [e["usage"] for e in events if e.get("usage")][-1]
    else:
        reply = _post(base, route, body)
        choice = reply["choices"][0]
        text = choice["text"] if route == "/v1/completions" else choice["message"]["content"] or ""
        finish, usage = choice["finish_reason"], reply["usage"]
    want_text, want_tokens, want_finish = _oracle(path, ids, 10)
    assert text.rstrip("\ufffd") == want_text
    assert finish == want_finish and usage["completion_tokens"] == want_tokens
    assert usage["prompt_tokens"] == len(ids)


def test_models_lists_the_served_name(gateway):
    base = gateway[0]
    models = json.loads(urllib.request.urlopen(f"{base}/v1/models", timeout=10).read())
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_closing_a_stream_aborts_on_the_decode_service(gateway):
    base, _, pair, reasons = gateway
    resp = _post(
        base,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        },
        stream=True,
    )
    for _ in range(3):
        resp.readline()
    before = set(reasons)
    resp.close()
    deadline = time.time() + 10
    while not any(reasons[r] == "abort" for r in set(reasons) - before):
        assert time.time() < deadline, f"no abort seen on the decode service: {reasons}"
        time.sleep(0.05)
    pair.wait_idle()


def test_load_generator_through_the_openai_endpoint(gateway):
    from bench import load_gen

    base, path, pair, _ = gateway
    result = load_gen.main(
        [
            "--backend",
            "openai",
            "--base-url",
            base,
            "--tokenizer",
            path,
            "--num-prompts",
            "8",
            "--max-concurrency",
            "4",
            "--random-input-len",
            "16",
            "--random-output-len",
            "6",
            "--no-progress",
        ]
    )
    assert result["completed"] == 8 and result["failed"] == 0, result["errors"]
    assert result["output_throughput"] > 0 and result["median_ttft_ms"] > 0
    pair.wait_idle()


def test_repeated_prompt_reports_cached_tokens_in_usage(gateway):
    """The prefill side's prefix cache shows in the OpenAI usage smg builds from the Complete."""
    base, path, _, _ = gateway
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "prompt": "One two three four five six seven eight."}
    n = len(load_tokenizer(path).encode(body["prompt"]))
    _post(base, "/v1/completions", body)
    usage = _post(base, "/v1/completions", body)["usage"]
    assert usage["prompt_tokens"] == n
    assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens") == n - 1, usage


def test_cache_aware_routing_keeps_each_conversation_on_the_decode_that_holds_its_kv(checkpoint, tmp_path):
    """Two decode replicas (each with its prefix cache, on by default) behind smg's cache_aware policy,
    over their OpenAI APIs (compose's path): each follow-up turn of a conversation reaches the replica
    that served its earlier turns and reads their KV from that replica's cache."""
    from decode_service.config import DecodeConfig
    from decode_service.server import DecodeService
    from tests.test_metrics import _scrape

    path = checkpoint("llama")
    kw = dict(served_model_name=MODEL, openai_port=0, metrics_port=0)
    pair = GrpcPair(path, decode_kw=kw)
    second = DecodeService(DecodeConfig(path, prefill_addr=pair.prefill.address, port=0, debug_checks=True, **kw))
    decodes = [pair.decode, second.start()]

    def counts() -> list[tuple[float, float]]:  # (requests finished, decode cache hit tokens) per replica
        out = []
        for d in decodes:
            m = _scrape(d.metrics_port)
            done = sum(v for k, v in m.items() if k.startswith("disagg_requests_total"))
            out.append((done, m.get("disagg_decode_cache_hit_tokens_total", 0.0)))
        return out

    served: dict[int, list[int]] = {}  # conversation -> the replica of each turn
    hits: dict[int, list[float]] = {}
    try:
        urls = [f"http://127.0.0.1:{d.openai.port}" for d in decodes]
        with smg_in_front_of(urls, str(tmp_path / "smg.log"), "--policy", "cache_aware") as base:
            words = ["Apples", "Rivers", "Copper", "Violins"]  # distinct first tokens: no shared prefix
            texts = [f"{words[c]} are what conversation {c} is about: tell me more." for c in range(4)]
            firsts = [len(load_tokenizer(path).encode(t)) for t in texts]
            for turn in range(3):
                for c in range(4):
                    before = counts()
                    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "prompt": texts[c]}
                    texts[c] += _post(base, "/v1/completions", body)["choices"][0]["text"] + f" And then {turn}?"
                    after = counts()
                    which = [i for i in range(2) if after[i][0] > before[i][0]]
                    assert len(which) == 1, (before, after)
                    served.setdefault(c, []).append(which[0])
                    hits.setdefault(c, []).append(after[which[0]][1] - before[which[0]][1])
    finally:
        second.stop()
        pair.close()
    for c in range(4):
        assert len(set(served[c])) == 1, served  # every turn on the replica that holds the conversation
        assert all(h >= firsts[c] - 2 for h in hits[c][1:]), (hits, firsts)  # follow-ups read its cache
