"""An OpenAI request as the engine's GenerateRequest (smg's proto, the message gRPC clients send), so
both doors share every rule of request_validation.py and the engine's answer is the same token for
token. The seed, which the proto cannot carry, travels beside it (DecodeService.generate).

Constraints: `response_format` json_object / json_schema / structural_tag, SGLang's `regex` / `ebnf`,
and the grammar a tool choice implies (chat.py) are one engine constraint: two at once are refused.
Stops: `stop` strings are matched in the engine (decode_service/stop_strings.py), so decoding ends at
them; the text is cut here (text.py).
"""

from __future__ import annotations

import json

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from decode_service.openai_api.protocol import ApiError, Sampling


def constraint(req: Sampling, tool_schema: str | None = None) -> dict[str, str]:
    """The one engine constraint (the proto's oneof field name -> its text) the request asks for."""
    found = {}
    fmt = req.response_format or {"type": "text"}
    kind = fmt.get("type")
    if kind == "json_object":
        found["response_format"] = ("json_schema", json.dumps({"type": "object"}))
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ApiError(400, "response_format.json_schema needs a `schema` object", "response_format")
        found["response_format"] = ("json_schema", json.dumps(spec.get("schema", {"type": "object"})))
    elif kind == "structural_tag":
        found["response_format"] = ("structural_tag", json.dumps({k: v for k, v in fmt.items() if k != "type"}))
    elif kind != "text":
        raise ApiError(400, f"response_format type {kind!r} is not one of text, json_object, json_schema, "
                       "structural_tag", "response_format")  # fmt: skip
    if req.regex is not None:
        found["regex"] = ("regex", req.regex)
    if req.ebnf is not None:
        found["ebnf"] = ("ebnf_grammar", req.ebnf)
    if tool_schema is not None:
        found["tool_choice"] = ("json_schema", tool_schema)
    if len(found) > 1:
        raise ApiError(400, f"at most one constraint per request; got {', '.join(sorted(found))}", sorted(found)[1])
    return dict(found.values())


def build(
    req: Sampling,
    request_id: str,
    ids: list[int],
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    prompt_logprobs: bool = False,
    tool_schema: str | None = None,
) -> pb.GenerateRequest:
    sp = pb.SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty,
        stop=req.stops(),
        stop_token_ids=req.stop_token_ids or [],
        n=req.n,
        min_new_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logit_bias=req.logit_bias or {},
        **constraint(req, tool_schema),
    )
    if max_tokens is not None:
        sp.max_new_tokens = max_tokens
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=sp,
        return_logprob=logprobs or prompt_logprobs,
        top_logprobs_num=top_logprobs,
        logprob_start_len=0 if prompt_logprobs else -1,
        stream=req.stream,
    )
