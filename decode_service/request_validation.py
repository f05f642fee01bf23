"""Turn an SglangScheduler GenerateRequest into (prompt ids, SamplingParams), or say what is wrong.

Proto3 zeros are normalised (top_p 0 -> 1, top_k 0 -> -1, repetition_penalty 0 -> 1, n 0 -> 1;
temperature 0 means greedy). Fields we do not support yet are rejected by name, never ignored.
"""

from __future__ import annotations

from common.engine.sampling import SamplingParams
from common.request_rules import InvalidRequest, default_max_new_tokens, validate_prompt


def _unsupported(req, sp) -> str | None:
    if sp.n > 1:
        return "n > 1"
    if list(sp.stop):
        return "stop (stop strings)"
    constraint = sp.WhichOneof("constraint")
    if constraint:
        return constraint
    if sp.frequency_penalty or sp.presence_penalty:
        return "frequency_penalty" if sp.frequency_penalty else "presence_penalty"
    if sp.repetition_penalty not in (0.0, 1.0):
        return "repetition_penalty"
    if sp.min_new_tokens:
        return "min_new_tokens"
    if len(sp.logit_bias):
        return "logit_bias"
    if req.return_logprob or req.top_logprobs_num or len(req.token_ids_logprob):
        return "return_logprob"
    if req.return_hidden_states:
        return "return_hidden_states"
    if req.HasField("mm_inputs"):
        return "mm_inputs"
    if req.lora_id:
        return "lora_id"
    return None


def parse_generate(req, vocab_size: int, context_length: int, default_max_new_tokens_: int) -> tuple[list[int], SamplingParams]:
    """(prompt ids, SamplingParams) of a GenerateRequest; InvalidRequest naming the field if it is bad."""
    ids = list(req.tokenized.input_ids)
    sp = req.sampling_params
    field = _unsupported(req, sp)
    if field:
        raise InvalidRequest(f"unsupported field: {field}")
    if sp.HasField("max_new_tokens"):
        max_new = sp.max_new_tokens
    else:
        max_new = default_max_new_tokens(len(ids), default_max_new_tokens_, context_length) if ids else 1
    params = SamplingParams(
        max_new_tokens=max_new, temperature=sp.temperature, top_k=sp.top_k if sp.top_k != 0 else -1,
        top_p=sp.top_p if sp.top_p != 0 else 1.0, min_p=sp.min_p,
        stop_token_ids=tuple(sp.stop_token_ids), ignore_eos=sp.ignore_eos)
    validate_prompt(ids, params, vocab_size, context_length)
    return ids, params
