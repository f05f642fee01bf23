"""Turn an SglangScheduler GenerateRequest into (prompt ids, SamplingParams), or say what is wrong.

Proto3 zeros are normalised (top_p 0 -> 1, top_k 0 -> -1, repetition_penalty 0 -> 1, n 0 -> 1;
temperature 0 means greedy). Every field this service does not honour is rejected by name when it
is set, never silently ignored; fields that only shape text on the client side (skip_special_tokens,
spaces_between_special_tokens, no_stop_trim, require_reasoning, timestamp, log_metrics) are accepted.
stop_token_ids: at most MAX_STOP_TOKEN_IDS (64), each in the vocabulary.
"""

from __future__ import annotations

import math

from common.engine.sampling import SamplingParams
from common.request_rules import InvalidRequest, default_max_new_tokens, stop_token_ids, validate_prompt


def _unsupported(req, sp) -> str | None:
    """The name of the first set field we do not honour, or None."""
    checks = [
        (sp.n > 1, "n > 1"),
        (len(sp.stop) > 0, "stop (stop strings)"),
        (sp.WhichOneof("constraint") is not None, sp.WhichOneof("constraint")),
        (sp.frequency_penalty != 0, "frequency_penalty"),
        (sp.presence_penalty != 0, "presence_penalty"),
        (sp.repetition_penalty not in (0.0, 1.0), "repetition_penalty"),
        (len(sp.logit_bias) > 0, "logit_bias"),
        (sp.HasField("custom_params"), "custom_params"),
        (sp.HasField("stream_interval") and sp.stream_interval != 1, "stream_interval (only 1)"),
        (req.return_logprob or req.top_logprobs_num != 0 or len(req.token_ids_logprob) > 0, "return_logprob"),
        (req.return_hidden_states, "return_hidden_states"),
        (req.HasField("mm_inputs"), "mm_inputs"),
        (req.lora_id != "", "lora_id"),
        (req.custom_logit_processor != "", "custom_logit_processor"),
        (len(req.input_embeds) > 0, "input_embeds"),
        (req.HasField("disaggregated_params"), "disaggregated_params (this service is its own PD pair)"),
        (req.HasField("data_parallel_rank") and req.data_parallel_rank != 0, "data_parallel_rank (only 0)"),
    ]
    return next((name for bad, name in checks if bad), None)


def parse_generate(
    req,
    vocab_size: int,
    context_length: int,
    default_max_new_tokens_: int,
    kv_room: int | None = None,
) -> tuple[list[int], SamplingParams]:
    """(prompt ids, SamplingParams) of a GenerateRequest; InvalidRequest naming the field if it is bad.
    A request without max_new_tokens gets the default, clamped to the context and to `kv_room` (the
    most prompt + output tokens one request can reserve in the decode pool)."""
    ids = list(req.tokenized.input_ids)
    sp = req.sampling_params
    field = _unsupported(req, sp)
    if field:
        raise InvalidRequest(f"unsupported field: {field}")
    if not math.isfinite(sp.temperature):
        raise InvalidRequest(f"temperature must be finite, got {sp.temperature}")
    if sp.top_k < -1:
        raise InvalidRequest(f"top_k must be -1 (off), 0 (off) or > 0, got {sp.top_k}")
    if sp.HasField("max_new_tokens"):
        max_new = sp.max_new_tokens
    else:
        room = context_length if kv_room is None else min(context_length, kv_room)
        max_new = default_max_new_tokens(len(ids), default_max_new_tokens_, room) if ids else 1
    params = SamplingParams(
        max_new_tokens=max_new,
        temperature=sp.temperature,
        top_k=sp.top_k if sp.top_k != 0 else -1,
        top_p=sp.top_p if sp.top_p != 0 else 1.0,
        min_p=sp.min_p,
        stop_token_ids=stop_token_ids(sp.stop_token_ids),  # at most MAX_STOP_TOKEN_IDS
        ignore_eos=sp.ignore_eos,
        min_new_tokens=sp.min_new_tokens,
    )
    if params.min_new_tokens > params.max_new_tokens:
        raise InvalidRequest(f"min_new_tokens ({sp.min_new_tokens}) exceeds max_new_tokens ({params.max_new_tokens})")
    validate_prompt(ids, params, vocab_size, context_length)
    return ids, params
