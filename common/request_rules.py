"""Request rules, written once: what a valid request is, and why a request finishes.

Used by the colocated loop, the prefill worker and service, the decode scheduler and the decode
front door. Every violation raises `InvalidRequest` (a ValueError) with a message naming the field;
the services map it to INVALID_ARGUMENT.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the engine's colocated loop imports these rules
    from common.engine.sampling import SamplingParams

MAX_PROMPT_LOGPROB_VALUES = 1 << 20  # ~8 MB on the wire: well inside gRPC's 64 MiB message bound


class InvalidRequest(ValueError):
    """The request is malformed or does not fit this model (INVALID_ARGUMENT)."""


class KvStartRefused(ValueError):
    """A prefill replica will not send the KV from `kv_start` on: the prefix ids it got do not match
    their digest (FAILED_PRECONDITION). Decode's answer is to ask again for the whole prompt's KV."""


class Overloaded(Exception):
    """The request is refused for now, not for what it is (RESOURCE_EXHAUSTED: retry later)."""


MAX_STOP_TOKEN_IDS = 64  # every output token is looked up in them on the scheduler thread
# A GenerateRequest's bytes beside its prompt ids, at most: a constraint (64 Ki chars), stop strings (16 x
# 256 chars), logit_bias (1024 entries), token_ids_logprob, the rest small; 1 MiB is several times that.
MAX_REQUEST_OVERHEAD_BYTES = 1 << 20


def stop_token_ids(ids) -> tuple[int, ...]:
    """A request's stop_token_ids as a tuple; InvalidRequest if there are more than MAX_STOP_TOKEN_IDS
    (counted before they are copied). Their vocabulary range is SamplingParams.validate's check."""
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
    return tuple(ids)


def max_request_bytes(context_length: int) -> int:
    """The most bytes a valid GenerateRequest takes: each prompt id a varint of at most 5 bytes, a prompt
    shorter than the context, and MAX_REQUEST_OVERHEAD_BYTES beside it. The front door's receive limit:
    a larger message is refused by gRPC before it is parsed (a 57 MiB one stalled the event loop 5.5 s)."""
    return 5 * context_length + MAX_REQUEST_OVERHEAD_BYTES


def validate_prompt(
    prompt: list[int], params: SamplingParams, vocab_size: int, context_length: int, kv_capacity: int | None = None
) -> None:
    """A non-empty prompt of in-vocabulary ids whose prompt + max_new_tokens fits the context (and,
    when given, whose prompt fits a KV pool of `kv_capacity` slots); valid sampling params."""
    if not prompt:
        raise InvalidRequest("empty prompt: input_ids has no tokens")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"input_ids outside the vocabulary [0, {vocab_size}): {bad[:8]}")
    try:
        params.validate(vocab_size)
    except ValueError as e:
        raise InvalidRequest(str(e)) from e
    if params.prompt_logprobs and params.logprob_start_len >= len(prompt):
        raise InvalidRequest(
            f"logprob_start_len ({params.logprob_start_len}) must be below the prompt length ({len(prompt)})"
        )
    if params.prompt_logprobs:  # the handoff record and the answer carry them all: bound their size
        width = 1 + 2 * params.top_logprobs_num + len(params.token_ids_logprob)
        values = (len(prompt) - params.logprob_start_len) * width
        if values > MAX_PROMPT_LOGPROB_VALUES:
            raise InvalidRequest(
                f"prompt logprobs from logprob_start_len ({params.logprob_start_len}) with top_logprobs_num "
                f"({params.top_logprobs_num}) and {len(params.token_ids_logprob)} token_ids_logprob are {values} "
                f"values; at most {MAX_PROMPT_LOGPROB_VALUES} are served: raise logprob_start_len"
            )
    if len(prompt) + params.max_new_tokens > context_length:
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the context "
            f"length {context_length}"
        )
    if kv_capacity is not None and len(prompt) > kv_capacity:
        raise InvalidRequest(f"prompt of {len(prompt)} tokens exceeds the KV pool ({kv_capacity} slots)")


class ErrorKind(enum.StrEnum):
    """What an "error" finish was: whose fault, and so what the caller is told (decode_service/responses.py)."""

    BROKEN = "broken"  # the handoff broke (replicas gone, a bad reply, a failed call): UNAVAILABLE, retry later
    REFUSED = "refused"  # a prefill replica refused the request as invalid: INVALID_ARGUMENT, no other replica tried
    KV_START_REFUSED = "kv_start_refused"  # a prefill replica refused the handoff from kv_start: decode asks for
    # the whole prompt's KV (scheduler.refetch_whole); a client hears it only if that cannot be done


def check_fits_pool(prompt_len: int, max_new_tokens: int, pool_size: int, extra: int = 0) -> None:
    """A request reserves prompt + max_new_tokens (+ `extra` slots for EAGLE's drafts) KV slots at
    admission; one that can never fit the pool would wait forever, and everyone behind it too."""
    if prompt_len + max_new_tokens + extra > pool_size:
        drafts = f" less {extra} for EAGLE's drafts" if extra else ""
        raise InvalidRequest(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"{pool_size - extra} KV slots one request can reserve here (--max-total-tokens {pool_size}{drafts})"
        )


def default_max_new_tokens(prompt_len: int, default: int, context_length: int) -> int:
    """max_new_tokens for a request that gives none: the server default, clamped to the context."""
    if prompt_len >= context_length:
        raise InvalidRequest(f"prompt of {prompt_len} tokens leaves no room in the context length {context_length}")
    return min(default, context_length - prompt_len)


class FinishReason(enum.StrEnum):
    """Why a request ended: the one name for each end (a str: it goes on the wire as SGLang's string)."""

    STOP = "stop"  # an EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # the client aborted or went away, or the service stopped
    ERROR = "error"  # a broken handoff, a bad prefill reply, a refused request, a failed scheduler


def finish_reason(params: SamplingParams, output: list[int], eos_ids: tuple[int, ...]) -> FinishReason | None:
    """Why a request stops after its newest output token ("stop" or "length"), or None to go on. Under a
    grammar an EOS is a stop even with ignore_eos: the mask allows one only where the grammar may end.
    (Stop strings, matched in text, are the decode scheduler's: decode_service/stop_strings.py.)"""
    token = output[-1]
    if token in eos_ids and (not params.ignore_eos or params.constraint is not None):
        return FinishReason.STOP
    if token in params.stop_token_ids:
        return FinishReason.STOP
    if len(output) >= params.max_new_tokens:
        return FinishReason.LENGTH
    return None
