"""The EAGLE half of a prefill: the draft extend over each prompt and its draft seed.

The head at position p reads the token at p+1 and the target's features for p, so it runs once the
first token is sampled (the token after the last prompt position). It writes the head's one layer of
KV at the prompt's slots (the same indices as the target's), from the first position the prefix
cache did not supply, in chunks of at most `chunk_size`
tokens; its output at the last position is the seed the decode side drafts from: the head's hidden
there and its top-k next tokens with their probabilities.

With n > 1 (`sample_drafts`) the head's input at the last prompt position differs per sample (it reads
that sample's first token), so samples 1..n-1 get their own seed and head KV there: one head forward
over their distinct first tokens, all at the last position, each seeing the prompt and itself.
"""

from __future__ import annotations

import torch

from common.forward.forward_batch import ForwardBatch
from common.forward.host_copy import to_device


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


def sample_drafts(
    runner,
    row: int,
    prompt_len: int,
    first_token: int,
    more_tokens: tuple[int, ...],
    feature: torch.Tensor,
    scratch: torch.Tensor,
    seed: dict,
    topk: int,
) -> dict:
    """n > 1: the seeds and head KV of samples 1..n-1 at the last prompt position L - 1, stacked (the
    Handoff's `more_draft_*` fields; empty for n = 1). `feature` [1, F] is the target's at L - 1,
    `seed` sample 0's (draft_extend's), `scratch` n - 1 KV slots the request reserved for this.

    One tree forward (common/forward/forward_batch.py) over the distinct first tokens other than sample
    0's: each sits at position L - 1, sees the prompt's first L - 1 positions and itself, and writes
    its head KV at a scratch slot mapped past the prompt in the request's row; the slot at L - 1 keeps
    sample 0's (the prefix cache keeps it). A sample whose first token is sample 0's gets sample 0's
    seed and KV (the same inputs). They travel in the record, not as KV chunks: a few KiB per sample
    (one layer, one position), needed only when the record arrives (the samples fork at the prebuilt
    batch), and bound for slots of the decode side's choosing that no transport's destination (the
    prompt's slot runs) names."""
    if not more_tokens:
        return {}
    draft, pool = runner.draft, runner.req_to_token_pool
    loc = to_device(pool.req_to_token[row, prompt_len - 1 : prompt_len].to(torch.int64), draft.kv_pool.device)
    k0, v0 = draft.kv_pool.gather(loc)
    ids, p, hidden = [seed["draft_topk_ids"]], [seed["draft_topk_p"]], [seed["draft_hidden"]]
    ks, vs = [k0[0][0].cpu()], [v0[0][0].cpu()]
    others = sorted(set(more_tokens) - {first_token})
    room = max(1, pool.req_to_token.shape[1] - prompt_len)  # scratch positions L.. the row can name
    for start in range(0, len(others), room):
        group = others[start : start + room]
        g, slots = len(group), scratch[start : start + len(group)]
        pool.write(row, prompt_len, slots)
        mask = torch.zeros(1, g, g + 1, dtype=torch.bool)
        mask[0, torch.arange(g), torch.arange(1, g + 1)] = True  # block position 0 is sample 0's L - 1
        batch = ForwardBatch.tree(
            pool.req_to_token,
            torch.tensor([row]),
            [row],
            [prompt_len - 1],
            torch.tensor(group),
            torch.zeros(1, g, dtype=torch.int64),
            list(range(1, g + 1)),
            mask,
        )
        out = draft.forward(batch, feature.expand(g, -1))
        topk_p, topk_ids = draft.topk(out, topk)
        k, v = draft.kv_pool.gather(to_device(slots, draft.kv_pool.device))
        ids += list(topk_ids.cpu())
        p += list(topk_p.cpu())
        hidden += list(out.cpu())
        ks += list(k[0].cpu())
        vs += list(v[0].cpu())
    at = {t: i + 1 for i, t in enumerate(others)} | {first_token: 0}
    pick = [at[t] for t in more_tokens]
    return {
        f"more_draft_{name}": torch.stack([rows[i] for i in pick])
        for name, rows in (("topk_ids", ids), ("topk_p", p), ("hidden", hidden), ("k", ks), ("v", vs))
    }
