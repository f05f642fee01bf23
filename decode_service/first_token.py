"""The first output token(s) a prebuilt request streams when its handoff record arrives.

The prefill side sends the first token twice: early, as soon as it is sampled (streamed at once,
handoff_intake.py), and in the record. A request that asks for logprobs holds the early one back
(`DecodeReq.held_first`) until the record brings its logprobs (computed on prefill). A retry's record
continues after the tokens already sent; a held token that a retry resent as prompt is streamed here
before the record's own first token, with a NaN logprob (its prefill attempt broke before the record).
The first output of every sample carries the request's prompt logprobs, when it asked.
"""

from __future__ import annotations

from common.engine.handoff import Handoff
from common.engine.logprobs import TokenLogprobs


def first_outputs(req, handoff: Handoff, finish_reason) -> tuple[list[int], list[TokenLogprobs] | None, tuple | None]:
    """(ids to stream now, their logprobs or None, the prompt logprobs or None); appends the record's
    first token to req.output_ids unless it is already there. `finish_reason(req)`: why req ends, or None."""
    held = [req.output_ids[-1]] if req.held_first else []
    req.held_first = False
    new = []
    if len(req.output_ids) == handoff.first_position and (not req.output_ids or finish_reason(req) is None):
        new = [handoff.first_token]  # tokens streamed early (or resent) may already finish the request
        req.output_ids.append(handoff.first_token)
    elif held and len(req.output_ids) == handoff.first_position + 1:
        held = []  # the held token is the record's first token
        new = [handoff.first_token]
    if not req.params.return_logprob:
        return held + new, None, None
    missing = TokenLogprobs(float("nan"))
    firsts = [missing] * len(held) + [handoff.first_logprobs or missing] * len(new)
    return held + new, firsts, handoff.prompt_logprobs
