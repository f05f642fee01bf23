"""What DecodeScheduler refuses before anything is queued (InvalidRequest, on the caller's thread).

`check_submit` is the one check of a request against this scheduler; what passes is a
`CheckedRequest`, which the front door (admission.py) makes before it compiles the grammar and then
submits (`submit_checked`), and which `submit` makes for in-process callers. The wire's own bounds
(sizes, unsupported fields) are request_validation.py's, before the ids are copied.

The prompt and its budget (common/request_rules.py): in the vocabulary, prompt + max_new_tokens within
the context, and prompt + n x max_new_tokens (+ EAGLE's draft window per sample, and with n > 1 one
slot per sample past the first for its own last prompt position: slot_books.py) within the KV pool;
then what this scheduler cannot serve: n above its request slots (never admitted, it would hold back
everyone behind it), stop strings without a tokenizer, temperature > 0 with an
EAGLE tree. The grammar is the request's at submit (grammar_state.check_request: compiled there, or
taken from the cache where the front door compiled it off its event loop). n > 1 is served with EAGLE
(chain; a tree for greedy requests, as for n = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.engine.sampling import SamplingParams
from common.request_rules import InvalidRequest, check_fits_pool, validate_prompt


@dataclass(frozen=True)
class CheckedRequest:
    """A prompt and its params that passed check_submit (made nowhere else)."""

    prompt_ids: list[int]
    params: SamplingParams


def check_submit(scheduler, prompt_ids: list[int], params: SamplingParams) -> CheckedRequest:
    """The request, checked against this scheduler's vocabulary, context, pool and features."""
    info, spec = scheduler.info, scheduler.spec
    validate_prompt(prompt_ids, params, info.vocab_size, info.context_length)
    slots = scheduler.worker.req_to_token_pool.size
    if params.n > slots:  # admission would wait for n free request slots forever, blocking everyone behind
        raise InvalidRequest(
            f"n ({params.n}) exceeds the {slots} request slots of this decode service (--max-running-requests "
            f"{slots}): its samples could never run at once"
        )
    room = scheduler.worker.kv_allocator.size
    extra = scheduler.books.extra
    check_fits_pool(len(prompt_ids), params.max_new_tokens, room, extra)
    last = params.n - 1 if spec else 0  # EAGLE: samples 1..n-1's own last position
    if len(prompt_ids) + params.n * (params.max_new_tokens + extra) + last > room:  # the prompt's slots once
        drafts = f" (+ {extra} draft slots per sample, + {last} for the samples' own last prompt position)"
        raise InvalidRequest(
            f"prompt ({len(prompt_ids)} tokens) + n ({params.n}) x max_new_tokens ({params.max_new_tokens})"
            f"{drafts if spec else ''} exceeds the {room} KV slots one request can reserve here "
            f"(--max-total-tokens {room})"
        )
    if params.stop_strings and scheduler.stop_strings is None:
        raise InvalidRequest("stop strings need the tokenizer, and this decode service has none")
    if spec and spec.eagle_topk > 1 and not params.greedy:
        raise InvalidRequest("temperature > 0 needs chain drafting (--speculative-eagle-topk 1), not a tree")
    return CheckedRequest(list(prompt_ids), params)
