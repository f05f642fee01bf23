"""Turn an SglangScheduler GenerateRequest into (prompt ids, SamplingParams), or say what is wrong.

Proto3 zeros are normalised (top_p 0 -> 1, top_k 0 -> -1, repetition_penalty 0 -> 1, n 0 -> 1;
temperature 0 means greedy). Every field this service does not honour is rejected by name when it
is set, never silently ignored; fields that only shape text on the client side (skip_special_tokens,
spaces_between_special_tokens, no_stop_trim, require_reasoning, timestamp, log_metrics) are accepted.
stop_token_ids: at most MAX_STOP_TOKEN_IDS (64), each in the vocabulary. Penalties and logit_bias in
OpenAI's ranges (SamplingParams.validate): frequency/presence in [-2, 2], repetition in (0, 2],
logit_bias values in [-100, 100] with keys that are ids of the vocabulary. Logprobs: return_logprob
with top_logprobs_num in [0, 20] and at most 64 token_ids_logprob; logprob_start_len (only read with
return_logprob, as SGLang) -1 for none, or s in [0, prompt length) for the prompt logprobs of
positions s.. (SGLang's: 0 is from the first token, which has no value; proto3's unset is 0, so a
direct client leaves prompt logprobs off with -1, as smg always sends): computed on prefill
(common/engine/prompt_logprobs.py), s beyond the prompt refused naming the field. n in [1, 128]
samples of the prompt (sample_group.py). A constraint (the oneof: regex, json_schema, ebnf_grammar,
structural_tag) becomes SamplingParams' field of the same name (common/engine/grammar.py).
"""

from __future__ import annotations

import math

from common.engine.logprobs import MAX_TOKEN_IDS_LOGPROB
from common.engine.penalties import MAX_LOGIT_BIAS
from common.engine.sampling import SamplingParams
from common.request_rules import InvalidRequest, default_max_new_tokens, stop_token_ids
from decode_service.stop_strings import check_stop_strings


def _unsupported(req, sp) -> str | None:
    """The name of the first set field we do not honour, or None."""
    checks = [
        (sp.HasField("custom_params"), "custom_params"),
        (sp.HasField("stream_interval") and sp.stream_interval != 1, "stream_interval (only 1)"),
        (req.return_hidden_states, "return_hidden_states"),
        (req.HasField("mm_inputs"), "mm_inputs"),
        (req.lora_id != "", "lora_id"),
        (req.custom_logit_processor != "", "custom_logit_processor"),
        (len(req.input_embeds) > 0, "input_embeds"),
        (req.HasField("disaggregated_params"), "disaggregated_params (this service is its own PD pair)"),
        (req.HasField("data_parallel_rank") and req.data_parallel_rank != 0, "data_parallel_rank (only 0)"),
    ]
    return next((name for bad, name in checks if bad), None)


def constraint(sp) -> dict[str, str]:
    """smg's oneof constraint (regex, json_schema, ebnf_grammar, structural_tag) as SamplingParams'
    field of the same name; compiled (and refused by name when it does not compile) at submit."""
    which = sp.WhichOneof("constraint")
    return {which: getattr(sp, which)} if which is not None else {}


def stop_strings(stops) -> tuple[str, ...]:
    try:
        return check_stop_strings(stops)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def logit_bias(entries) -> dict[int, float]:
    """smg's map<string, float> (OpenAI's JSON keys) as {token id: bias}; InvalidRequest naming the
    field for a key that is not an id or a value that is not finite (ranges: SamplingParams.validate)."""
    if len(entries) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias has {len(entries)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out = {}
    for key, value in entries.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}") from None
        if not math.isfinite(value):
            raise InvalidRequest(f"logit_bias values must be finite, got {value} for {key!r}")
        out[token] = float(value)
    return out


def parse_generate(
    req,
    context_length: int,
    default_max_new_tokens_: int,
    kv_room: int | None = None,
    spec_extra: int = 0,
) -> tuple[list[int], SamplingParams]:
    """(prompt ids, SamplingParams) of a GenerateRequest; InvalidRequest naming the field if it is bad.
    A request without max_new_tokens gets the default, clamped to the context and to `kv_room` (the
    most prompt + output tokens one request can reserve in the decode pool; `spec_extra`: EAGLE's
    draft slots each sample reserves past that, and with n > 1 samples 1..n-1 one more each)."""
    if len(req.tokenized.input_ids) >= context_length:  # before the ids are copied or scanned
        raise InvalidRequest(
            f"prompt ({len(req.tokenized.input_ids)} tokens) exceeds the context length {context_length}: "
            "no room for an output token"
        )
    ids = list(req.tokenized.input_ids)
    sp = req.sampling_params
    field = _unsupported(req, sp)
    if field:
        raise InvalidRequest(f"unsupported field: {field}")
    if not math.isfinite(sp.temperature):
        raise InvalidRequest(f"temperature must be finite, got {sp.temperature}")
    if sp.top_k < -1:
        raise InvalidRequest(f"top_k must be -1 (off), 0 (off) or > 0, got {sp.top_k}")
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        if not math.isfinite(getattr(sp, name)):
            raise InvalidRequest(f"{name} must be finite, got {getattr(sp, name)}")
    if sp.HasField("max_new_tokens"):
        max_new = sp.max_new_tokens
    else:
        room = context_length if kv_room is None else min(context_length, kv_room)
        if kv_room is not None and sp.n > 1:  # the prompt's slots once, n samples' own (sample_group.py)
            shared_out = kv_room + spec_extra - len(ids) - (sp.n - 1) * (1 if spec_extra else 0)
            room = min(room, len(ids) + max(shared_out // sp.n - spec_extra, 0))
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
        repetition_penalty=sp.repetition_penalty if sp.repetition_penalty != 0 else 1.0,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        logit_bias=logit_bias(sp.logit_bias),
        stop_strings=stop_strings(sp.stop),
        n=sp.n if sp.n != 0 else 1,
        return_logprob=req.return_logprob,  # top_logprobs_num / token_ids_logprob only with it (as SGLang)
        top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
        token_ids_logprob=tuple(req.token_ids_logprob) if req.return_logprob else (),
        logprob_start_len=req.logprob_start_len if req.return_logprob else -1,  # < -1: validate names it
        **constraint(sp),
    )
    if len(req.token_ids_logprob) > MAX_TOKEN_IDS_LOGPROB:
        raise InvalidRequest(f"token_ids_logprob has {len(req.token_ids_logprob)} ids; at most {MAX_TOKEN_IDS_LOGPROB}")
    if params.min_new_tokens > params.max_new_tokens:
        raise InvalidRequest(f"min_new_tokens ({sp.min_new_tokens}) exceeds max_new_tokens ({params.max_new_tokens})")
    return ids, params  # the prompt and params against the model and pool: the scheduler's check
