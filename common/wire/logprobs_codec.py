"""The first tokens' logprobs on the Prefill stream (PrebuiltRecord.first_logprobs, and with n > 1
more_first_logprobs for samples 1..n-1) and the prompt logprobs (PrebuiltRecord.prompt_logprobs,
common/engine/prompt_logprobs.py), both ways: one TokenLogprobs message per token or prompt
position, read and checked by the same code for every one (their count against the prompt:
Handoff.check_record).

A prefill replica is trusted with nothing but its own request: what it sends must be as wide as the
request asked (top_logprobs_num candidates in the vocabulary, one value per token_ids_logprob id),
else ValueError (the request fails cleanly, handoff_intake.py).
"""

from __future__ import annotations

import math

from common.engine.logprobs import TokenLogprobs
from common.wire.proto_gen import prefill_pb2


def logprobs_to_wire(lp: TokenLogprobs | None) -> prefill_pb2.TokenLogprobs | None:
    if lp is None:
        return None
    return prefill_pb2.TokenLogprobs(
        logprob=lp.logprob,
        top_ids=[t for t, _ in lp.top],
        top_values=[v for _, v in lp.top],
        ids_logprobs=list(lp.ids),
    )


def more_logprobs_to_wire(lps) -> list[prefill_pb2.TokenLogprobs]:
    """PrebuiltRecord.more_first_logprobs: the logprobs of samples 1..n-1 (empty when not asked)."""
    return [logprobs_to_wire(lp) for lp in lps]


def prompt_logprobs_to_wire(lps) -> list[prefill_pb2.TokenLogprobs]:
    """PrebuiltRecord.prompt_logprobs (empty when not asked)."""
    return [logprobs_to_wire(lp) for lp in lps or ()]


def prompt_logprobs_from_wire(record, params, vocab_size: int | None = None) -> tuple[TokenLogprobs, ...] | None:
    """The record's prompt logprobs (None when the request asked for none)."""
    if not params.prompt_logprobs:
        return None
    return tuple(_from_wire(w, params, vocab_size) for w in record.prompt_logprobs)


def logprobs_from_wire(record, params, vocab_size: int | None = None) -> TokenLogprobs | None:
    """The record's first-token logprobs for a request with `params` (None when it asked for none)."""
    if not params.return_logprob:
        return None
    if not record.HasField("first_logprobs"):
        raise ValueError("the request asked for logprobs, but the prefill record carries none")
    return _from_wire(record.first_logprobs, params, vocab_size)


def more_logprobs_from_wire(record, params, vocab_size: int | None = None) -> tuple[TokenLogprobs, ...]:
    """The record's logprobs of samples 1..n-1 (empty when the request asked for none; how many there
    are against the more first tokens is Handoff.check_record's)."""
    if not params.return_logprob:
        return ()
    return tuple(_from_wire(w, params, vocab_size) for w in record.more_first_logprobs)


def _from_wire(w: prefill_pb2.TokenLogprobs, params, vocab_size: int | None) -> TokenLogprobs:
    """One token's logprobs, as wide as `params` asked, ids in the vocabulary, values <= 0."""
    if len(w.top_ids) != params.top_logprobs_num or len(w.top_values) != params.top_logprobs_num:
        raise ValueError(f"record's top logprobs: {len(w.top_ids)} ids, {params.top_logprobs_num} asked")
    if len(w.ids_logprobs) != len(params.token_ids_logprob):
        raise ValueError(
            f"record's token_ids_logprob: {len(w.ids_logprobs)} values, {len(params.token_ids_logprob)} asked"
        )
    if vocab_size is not None and any(t >= vocab_size for t in w.top_ids):
        raise ValueError("record's top logprob ids are outside the vocabulary")
    values = [w.logprob, *w.top_values, *w.ids_logprobs]
    if any(math.isnan(v) or v > 0 for v in values):
        raise ValueError("record's logprobs must be <= 0")
    return TokenLogprobs(w.logprob, tuple(zip(w.top_ids, w.top_values)), tuple(w.ids_logprobs))
