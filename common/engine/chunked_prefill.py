"""Chunked prefill: run prompts through extend forwards of at most `chunk_size` tokens each.

A prompt longer than the budget is split across forwards, each continuing from the KV already in
the pool. Requests need `prompt`, `prefilled` (tokens run so far) and `req_pool_idx` (whose
ReqToTokenPool row already maps the prompt's KV slots).

Budget policy (`plan_chunk`): short prompts never wait behind a long one. The oldest unfinished
prompt is guaranteed a quarter of the budget (so it cannot starve); the rest goes to prompts by
fewest remaining tokens, then back to the oldest.

`prefill_step` runs one forward and returns the requests whose prompt completed in it with their
last-position logits; with `on_features`, forwards return the draft head's features (EAGLE) and
`on_features(chunk, features)` gets them for every token of the chunk, where chunk is a list of
(request, start, ids). `run_chunked_prefill` steps until every prompt is done.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.forward.forward_batch import ForwardBatch
from common.forward.host_copy import to_device


def plan_chunk(reqs: list, chunk_size: int) -> list[tuple[object, int]]:
    """(request, tokens) of the next forward; `reqs` oldest first."""
    pending = [r for r in reqs if r.prefilled < len(r.prompt)]
    if not pending:
        return []
    left = {id(r): len(r.prompt) - r.prefilled for r in pending}
    oldest, budget = pending[0], chunk_size
    take = {id(oldest): min(left[id(oldest)], max(1, budget // 4))}
    budget -= take[id(oldest)]
    for r in sorted(pending[1:], key=lambda r: left[id(r)]):
        if budget == 0:
            break
        take[id(r)] = min(left[id(r)], budget)
        budget -= take[id(r)]
    take[id(oldest)] += min(left[id(oldest)] - take[id(oldest)], budget)
    return [(r, take[id(r)]) for r in pending if take.get(id(r), 0) > 0]


def prefill_step(
    runner,
    reqs: list,
    chunk_size: int,
    on_features: Callable[[list, object], None] | None = None,
    capture: tuple[int, ...] | None = None,
    greedy: bool = False,
    prompt_rows: Callable[[list], object] | None = None,
) -> tuple[list, object]:
    """One extend forward under the budget; (requests completed in it, their last-position logits,
    or with `greedy` those logits' argmax tokens: ModelRunner.forward's greedy). `prompt_rows(chunk)`:
    the PromptRows of the chunk's requests that ask for prompt logprobs, or None (no extra logits;
    common/engine/prompt_logprobs.py); it gets its rows' raw logits (never with `greedy`)."""
    plan = plan_chunk(reqs, chunk_size)
    if not plan:
        return [], None
    chunk = [(r, r.prefilled, r.prompt[r.prefilled : r.prefilled + n]) for r, n in plan]
    batch = ForwardBatch.extend(
        runner.req_to_token_pool.req_to_token,
        [r.req_pool_idx for r, _, _ in chunk],
        [start for _, start, _ in chunk],
        [ids for _, _, ids in chunk],
    )
    extra = prompt_rows(chunk) if prompt_rows is not None else None
    if extra is not None:  # after the usual last rows: logits[: len(chunk)] stay what they were
        assert not greedy, "prompt logprobs need the raw logits"
        batch.logits_indices = torch.cat([batch.logits_indices, to_device(extra.rows, batch.logits_indices.device)])
    if on_features:
        logits, features = runner.forward_features(batch, capture, greedy=greedy)
    else:
        logits, features = runner.forward(batch, greedy=greedy)
    if extra is not None:
        extra.take(logits[len(chunk) :])
        logits = logits[: len(chunk)]
    if on_features:
        on_features(chunk, features)
    done = []
    for i, (r, start, ids) in enumerate(chunk):
        r.prefilled = start + len(ids)
        if r.prefilled == len(r.prompt):
            done.append(i)
    return [chunk[i][0] for i in done], (logits[done] if done else None)


def run_chunked_prefill(
    runner,
    reqs: list,
    chunk_size: int,
    on_done: Callable[[list, object], None],
    on_features: Callable[[list, object], None] | None = None,
    capture: tuple[int, ...] | None = None,
) -> None:
    """Prefill every prompt of `reqs`; `on_done(reqs, logits)` after each forward that completed some."""
    while any(r.prefilled < len(r.prompt) for r in reqs):
        done, logits = prefill_step(runner, reqs, chunk_size, on_features, capture)
        if done:
            on_done(done, logits)
