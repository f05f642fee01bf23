"""One EAGLE chain step, run as work on the forward stream (DESIGN section 7).

For a batch with committed lengths n (host copy known to the schedule side: resolved from the last
step's publish, or the handoff for a prebuilt request) and, per request, a pending bonus token b
(at position n, not in KV yet) and a draft seed (first draft token d1, the head's hidden for n):
  1. draft: num_steps - 1 head forwards extend the chain d1..dS (head KV at positions n..n+S-2);
  2. verify: one target forward over [b, d1..dS] at positions n..n+S (target KV written there);
  3. accept (greedy): A = how many leading drafts equal the target argmax before them; the bonus is
     the target argmax after the last accepted; accept_len = A + 1 tokens are committed. Lanes with
     temperature > 0 (`draws`, a SpecDraws) instead draw their drafts from the head's filtered
     distribution in 1 and take A and the bonus from the speculative sampling rule
     (common/engine/spec_sampling.py), so their output follows the target's distribution;
  4. publish new_seq_lens = n + A + 1 through the FutureMap (sets this step's publish_ready fence),
     so the schedule side can build the next step while 5 runs;
  5. draft extend over the verified positions n..n+S with the target's features (head KV rewritten
     with real features; entries past n+A are overwritten next step), the head's output at n+A
     seeds the next step; stash the bonus token and the seed at the rows.
Everything stays on the device (static shapes: every request verifies S+1 tokens); the tokens
[B, S+1] and A [B] are copied to the host for the schedule side behind the results-ready fence.
"""

from __future__ import annotations

import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.host_copy import to_device
from common.engine.spec_sampling import draw, verify_chain
from decode_service.eagle_tree_step import eagle_tree_step


def speculative_step(runner, fm, indices, rows, seq_lens_cpu, spec, fence, hooks=None, lanes=None, draws=None):
    """The EAGLE step for these settings: a tree (topk > 1, greedy) or a chain."""
    if spec.eagle_topk > 1:
        return eagle_tree_step(runner, fm, indices, rows, seq_lens_cpu, spec, fence, hooks, lanes)
    return eagle_step(runner, fm, indices, rows, seq_lens_cpu, spec.num_steps, fence, hooks, lanes, draws)


def eagle_step(runner, fm, indices: torch.Tensor, rows: list[int], seq_lens_cpu: list[int], num_steps: int,
               fence, hooks=None, lanes: list | None = None, draws=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [B, S+1], accepted drafts A [B]) on the device: request i commits tokens[i, :A+1]."""
    draft, table, batch = runner.draft, runner.req_to_token_pool.req_to_token, len(rows)
    bonus = fm.gather_tokens(indices)
    token, hidden = fm.gather_draft(indices)
    draws = draws.to(indices.device) if draws is not None else None
    q = []                                                          # sampled lanes: the head's q_k [R, V]

    def sample_lanes(tokens: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
        if draws is None:
            return tokens
        q.append(draft.target_probs(draws.probs(draft.logits(hidden[draws.lanes]))))
        return tokens.index_copy(0, draws.lanes, draw(q[-1], draws.u_draft[:, k]))

    drafts = [sample_lanes(token, hidden, 0)]
    for k in range(1, num_steps):                                   # 1. the chain
        fb = ForwardBatch.decode(table, indices, [n + k - 1 for n in seq_lens_cpu], drafts[-1],
                                 req_pool_indices_cpu=rows)
        hidden = draft.forward(fb, hidden)
        drafts.append(sample_lanes(draft.greedy(hidden), hidden, k))
    proposed = torch.stack(drafts, dim=1)                           # [B, S]
    if hooks is not None and hooks.propose is not None:              # tests: plant drafts
        proposed = hooks.propose(lanes, seq_lens_cpu, proposed)
    verify_ids = torch.cat([bonus[:, None], proposed], dim=1).flatten()
    fb = ForwardBatch.extend_fixed(table, indices, rows, seq_lens_cpu, verify_ids, num_steps + 1)
    logits, features = runner.forward_features(fb)                  # 2. verify
    target = logits.argmax(-1).view(batch, num_steps + 1)
    accepted = (proposed == target[:, :num_steps]).to(torch.int64).cumprod(dim=1).sum(dim=1)  # 3.
    lanes = torch.arange(batch, device=indices.device)
    if draws is not None:  # sampled lanes: their drafts, then the bonus at their accept point
        p = draws.probs(logits.view(batch, num_steps + 1, -1)[draws.lanes].flatten(0, 1), num_steps + 1)
        n_ok, extra = verify_chain(p.view(len(draws.lanes), num_steps + 1, -1), torch.stack(q, dim=1),
                                   proposed[draws.lanes], draws.u_accept, draws.u_bonus)
        picked = torch.cat([proposed[draws.lanes], proposed[draws.lanes, :1]], dim=1)
        picked[torch.arange(len(draws.lanes), device=indices.device), n_ok] = extra
        target = target.index_copy(0, draws.lanes, picked)
        accepted = accepted.index_copy(0, draws.lanes, n_ok)
    committed = to_device(seq_lens_cpu, indices.device, torch.int64)
    fm.publish_seq_lens(indices, committed + accepted + 1, fence)   # 4.
    extend = ForwardBatch.extend_fixed(table, indices, rows, seq_lens_cpu, target.flatten(), num_steps + 1)
    out = draft.forward(extend, features).view(batch, num_steps + 1, -1)  # 5.
    seed_hidden = out[lanes, accepted]
    fm.stash_tokens(indices, target[lanes, accepted])
    fm.stash_draft(indices, draft.greedy(seed_hidden), seed_hidden)
    return target, accepted
