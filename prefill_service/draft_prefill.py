"""The EAGLE half of a prefill: the draft extend over each prompt and its draft seed.

The head at position p reads the token at p+1 and the target's features for p, so it runs once the
first token is sampled (the token after the last prompt position). It writes the head's one layer of
KV at the prompt's slots (the same indices as the target's), from the first position the prefix
cache did not supply, in chunks of at most `chunk_size`
tokens; its output at the last position is the seed the decode side drafts from: the head's hidden
there and its top-k next tokens with their probabilities.
"""

from __future__ import annotations

import torch

from common.engine.forward_batch import ForwardBatch


def draft_extend(
    runner,
    row: int,
    prompt: list[int],
    cached: int,
    first_token: int,
    features: torch.Tensor,
    chunk_size: int,
    topk: int,
) -> dict:
    """Draft KV and seed for one prefilled prompt from position `cached` on (the head's KV before it
    came from the prefix cache); `features` [len(prompt) - cached, F] from the target."""
    draft, table = runner.draft, runner.req_to_token_pool.req_to_token
    shifted = prompt[1:] + [first_token]
    hidden = None
    for start in range(cached, len(prompt), chunk_size):
        ids = shifted[start : start + chunk_size]
        batch = ForwardBatch.extend(table, [row], [start], [ids], all_logits=True)
        hidden = draft.forward(batch, features[start - cached : start - cached + len(ids)])
    last = hidden[-1:]
    topk_p, topk_ids = draft.topk(last, topk)
    return dict(draft_topk_ids=topk_ids[0].cpu(), draft_topk_p=topk_p[0].cpu(), draft_hidden=last[0].cpu())
