"""Structured output through smg's OpenAI API on the real model (issue 43 part 6): SmolLM2-135M-Instruct
(common.tools.smollm2) served by the gRPC pair with --constrained-json-disable-any-whitespace on both
services, smg in front, requests in the wire format an OpenAI SDK sends (urllib; the SDK is not a
dependency). smg turns `response_format` json_schema into the GenerateRequest's json_schema,
json_object into json_schema '{"type":"object"}', `regex` into regex, and `tool_choice: "required"`
into a json_schema of an array of {name, parameters}, which it parses back into `tool_calls`.

Every json_schema answer parses and validates against its schema (jsonschema); json_object answers
parse as objects; a regex answer matches in full; a required tool call names a tool and its
arguments validate against that tool's parameters. A drill (tests/drills.py): it loads the real model.
"""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest

from common.tools.smg import smg_in_front_of
from common.tools.smollm2 import ensure_smollm2
from tests.grpc_harness import GrpcPair
from tests.test_smg_gateway import _post, _sse

MODEL = "smollm2"
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    },
    "required": ["name", "population"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {
            "type": "array",
            "items": {"type": "string", "enum": ["English", "French", "German"]},
            "maxItems": 2,
        },
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def smg():
    path = ensure_smollm2()
    flags = dict(dtype="float32", constrained_json_disable_any_whitespace=True)
    pair = GrpcPair(path, prefill_kw=flags, decode_kw=dict(flags, served_model_name=MODEL))
    try:
        with smg_in_front_of(pair.decode.address, os.path.join(os.path.dirname(path), "smg-structured.log")) as base:
            yield base
    finally:
        pair.close()


def chat(base: str, question: str, stream: bool = False, **extra) -> tuple[dict, str]:
    """(the choice's message, its finish_reason) of a greedy chat completion."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 96, "temperature": 0}
    body.update(extra, stream=stream)
    if not stream:
        choice = _post(base, "/v1/chat/completions", body)["choices"][0]
        return choice["message"], choice["finish_reason"]
    choices = [c for e in _sse(_post(base, "/v1/chat/completions", body, stream=True)) for c in e["choices"]]
    content = "".join(c.get("delta", {}).get("content") or "" for c in choices)
    return {"content": content}, [c["finish_reason"] for c in choices if c.get("finish_reason")][-1]


@pytest.mark.parametrize(
    "question, schema, stream",
    [
        ("Give me the capital of France and its population as JSON.", CITY, False),
        ("Give me the capital of Italy and its population as JSON.", CITY, True),
        ("Describe a person who speaks French as JSON.", PERSON, False),
    ],
)
def test_json_schema_answers_parse_and_validate(smg, question, schema, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    message, finish = chat(smg, question, stream, response_format=fmt)
    assert finish == "stop", message  # the grammar ended (an EOS it allowed), within max_tokens
    jsonschema.validate(json.loads(message["content"]), schema)


@pytest.mark.parametrize(
    "question", ['Return {"ok": true} as JSON.', "Give a JSON object with a person's name and age."]
)
def test_json_object_answers_parse_as_objects(smg, question):
    message, finish = chat(smg, question, response_format={"type": "json_object"})
    assert finish == "stop" and isinstance(json.loads(message["content"]), dict), message


def test_regex_answer_matches_in_full(smg):
    regex = r"(Paris|London|Rome), [0-9]{1,2} degrees"
    message, finish = chat(smg, "What is the weather like in a European capital?", regex=regex)
    assert finish == "stop" and re.fullmatch(regex, message["content"]), message


@pytest.mark.parametrize("question", ["What is the weather in Paris?", "Weather in Rome please."])
def test_a_required_tool_call_validates_against_its_parameters(smg, question):
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    message, finish = chat(smg, question, tools=[WEATHER, TIME], tool_choice="required")
    assert finish == "tool_calls" and message["tool_calls"], message
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["function"]["name"] in tools, call
        jsonschema.validate(json.loads(call["function"]["arguments"]), tools[call["function"]["name"]])
