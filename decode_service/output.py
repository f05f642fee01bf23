"""RequestOutput and Finish: what leaves the decode scheduler for one request, typed (vLLM's
EngineCoreOutput, SGLang's finish reason with its `matched_stop`).

The scheduler hands each request's `on_output` one RequestOutput whenever that request has news:
the ids it gained this step (or the first token, or nothing), and, with its last record only, a
Finish saying why it ended and what the front door reports with it (the error detail, the prompt
tokens the prefill side took from its prefix cache, EAGLE's accepted and proposed drafts). Nothing
about a request is kept aside for a later lookup: everything the consumer needs is in the record.
Built on the scheduler thread, read on any other; neither record is changed after it is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.engine.logprobs import TokenLogprobs
from common.request_rules import ErrorKind, FinishReason


@dataclass(frozen=True, slots=True)
class Finish:
    reason: FinishReason  # common/request_rules.py
    matched_stop: int | None = None  # "stop": the EOS or stop_token_ids id that ended it
    cached_tokens: int = 0  # leading prompt tokens whose KV the prefill side found in its prefix cache
    spec_accepted: int = 0  # EAGLE: drafts accepted over the request's life
    spec_drafted: int = 0  # EAGLE: drafts proposed (0 without EAGLE)
    error: str | None = None  # "error": what went wrong
    error_kind: ErrorKind | None = None  # "error": whose fault (BROKEN: retry later; REFUSED: the request's)
    matched_stop_str: str | None = None  # "stop" by a stop string: that string (matched_stop is None then)

    @classmethod
    def of(cls, req, reason: FinishReason) -> Finish:
        """A DecodeReq's Finish for `reason`."""
        by_id = reason == FinishReason.STOP and bool(req.output_ids) and req.matched_stop_str is None
        return cls(
            reason,
            req.output_ids[-1] if by_id else None,
            req.cached_tokens,
            req.spec_accepted,
            req.spec_drafted,
            req.error if reason == FinishReason.ERROR else None,
            req.error_kind if reason == FinishReason.ERROR else None,
            req.matched_stop_str if reason == FinishReason.STOP else None,
        )


@dataclass(frozen=True, slots=True)
class RequestOutput:
    rid: str
    new_token_ids: list[int]  # may be empty (a finish with no new token)
    finish: Finish | None = None  # set on the request's last record only
    logprobs: list[TokenLogprobs] | None = None  # one per new id, when the request asked for logprobs
    index: int = 0  # n > 1: the sample these ids belong to
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # each sample's first record, when it asked

    @property
    def finished(self) -> bool:
        return self.finish is not None


# on_output(RequestOutput); called on the scheduler thread, so it must be quick and must not block.
OutputCallback = Callable[[RequestOutput], None]
