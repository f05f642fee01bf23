"""Chunked prefill: run prompts through extend forwards of at most `chunk_size` tokens each.

A prompt longer than the budget is split across forwards, each continuing from the KV already in
the pool. Requests need `prompt`, `prefilled` (tokens run so far) and `req_pool_idx` (whose
ReqToTokenPool row already maps the prompt's KV slots). `on_done(reqs, logits)` is called after
each forward with the requests whose prompt completed in it and their last-position logits. With
`on_features`, forwards return the draft head's features (EAGLE) and `on_features(chunk, features)`
gets them for every token of the chunk, where chunk is a list of (request, start, ids).
"""

from __future__ import annotations

from typing import Callable

from common.engine.forward_batch import ForwardBatch


def run_chunked_prefill(runner, reqs: list, chunk_size: int, on_done: Callable[[list, object], None],
                        on_features: Callable[[list, object], None] | None = None) -> None:
    table = runner.req_to_token_pool.req_to_token
    while pending := [r for r in reqs if r.prefilled < len(r.prompt)]:
        chunk, budget = [], chunk_size
        for r in pending:
            n = min(len(r.prompt) - r.prefilled, budget)
            if n == 0:
                break
            chunk.append((r, r.prefilled, r.prompt[r.prefilled:r.prefilled + n]))
            budget -= n
        batch = ForwardBatch.extend(table, [r.req_pool_idx for r, _, _ in chunk],
                                    [start for _, start, _ in chunk], [ids for _, _, ids in chunk])
        logits, features = (runner.forward_features if on_features else runner.forward)(batch)
        if on_features:
            on_features(chunk, features)
        done = []
        for i, (r, start, ids) in enumerate(chunk):
            r.prefilled = start + len(ids)
            if r.prefilled == len(r.prompt):
                done.append(i)
        if done:
            on_done([chunk[i][0] for i in done], logits[done])
