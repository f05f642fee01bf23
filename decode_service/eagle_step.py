"""One EAGLE chain step, run as work on the forward stream (docs/speculative.md).

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
  4. publish the new committed lengths n + A + 1 through the FutureMap (sets this step's publish_ready fence),
     so the schedule side can build the next step while 5 runs;
  5. draft extend over the verified positions n..n+S with the target's features (head KV rewritten
     with real features; entries past n+A are overwritten next step), the head's output at n+A
     seeds the next step; stash the bonus token and the seed at the rows.
`draft_chain` is step 1, `verify_chain_step` steps 2-5; the worker (worker.py) runs one after the
other and may look at the drafts in between (tests plant drafts there).
Everything stays on the device (static shapes: every request verifies S+1 tokens); the tokens
[B, S+1] and A [B] are copied to the host for the schedule side behind the results-ready fence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.spec_sampling import SpecDraws, draw, verify_chain
from common.forward.forward_batch import ForwardBatch
from common.forward.host_copy import to_device
from decode_service.grammar_state import VerifyMask
from decode_service.worker_batch import WorkerBatch


@dataclass
class ChainDraft:
    """Step 1's output, the verify's input: what the chain proposes for each request."""

    bonus: torch.Tensor  # [B] the pending bonus token (position n)
    proposed: torch.Tensor  # [B, S] the drafts d1..dS
    q: list[torch.Tensor]  # sampled lanes: the head's distribution at each draft step [R, V]
    draws: SpecDraws | None  # the batch's draws on the device


def draft_chain(runner, fm, batch: WorkerBatch, num_steps: int) -> ChainDraft:
    """Step 1: the head extends each request's seed into a chain of num_steps drafts."""
    draft, table, rows = runner.draft, runner.req_to_token_pool.req_to_token, batch.req_pool_indices_cpu
    indices = batch.req_pool_indices
    bonus = fm.gather_tokens(indices)
    token, hidden = fm.gather_draft(indices)
    draws = batch.draws.to(indices.device) if batch.draws is not None else None
    q = []

    def sample_lanes(tokens: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
        if draws is None:
            return tokens
        q.append(draft.target_probs(draws.probs(draft.logits(hidden[draws.lanes]))))
        return tokens.index_copy(0, draws.lanes, draw(q[-1], draws.u_draft[:, k]))

    drafts = [sample_lanes(token, hidden, 0)]
    for k in range(1, num_steps):
        prefix_lens = [n + k - 1 for n in batch.kv_committed_lens_cpu]  # the head's KV so far
        fb = ForwardBatch.decode(table, indices, prefix_lens, drafts[-1], req_pool_indices_cpu=rows)
        hidden = draft.forward(fb, hidden)
        drafts.append(sample_lanes(draft.greedy(hidden), hidden, k))
    return ChainDraft(bonus, torch.stack(drafts, dim=1), q, draws)


def verify_chain_step(runner, fm, batch: WorkerBatch, chain: ChainDraft, matchers=None):
    """Steps 2-5; constrained lanes mask each node by the grammar state along the chain before it
    (`matchers`: the worker's GrammarMatchers, or None). Returns (tokens [B, S+1], accepted drafts
    A [B], logprobs of the rows asking or None)
    on the device: request i commits tokens[i, :A+1]."""
    draft, table = runner.draft, runner.req_to_token_pool.req_to_token
    indices, rows, committed_cpu = batch.req_pool_indices, batch.req_pool_indices_cpu, batch.kv_committed_lens_cpu
    size, num_steps, proposed, draws = len(batch), chain.proposed.shape[1], chain.proposed, chain.draws
    verify_ids = torch.cat([chain.bonus[:, None], proposed], dim=1).flatten()
    nodes = verify_ids.view(size, num_steps + 1)
    masks = VerifyMask.of(matchers, batch, nodes)  # filled on the grammar thread while the verify runs
    fb = ForwardBatch.extend_fixed(table, indices, rows, committed_cpu, verify_ids, num_steps + 1)
    greedy = batch.sampling.argmax_only  # then the target's argmax is all verify needs (the greedy head)
    logits, features = runner.forward_features(fb, greedy=greedy)  # 2. verify
    raw = logits
    procs = batch.sampling.processors(indices.device)
    if greedy:
        target = logits.view(size, num_steps + 1)
    else:
        if procs is not None:  # node j is penalised with its path: the bonus and d1..dj
            chain_anc = torch.ones(num_steps + 1, num_steps + 1, dtype=torch.bool, device=indices.device).tril()
            state = fm.penalties.gather(indices[procs.rows])
            paths = chain_anc.expand(size, -1, -1)
            logits = procs.apply_on_paths(logits.view(size, num_steps + 1, -1), *state, paths, nodes).flatten(0, 1)
        if masks is not None:  # after penalties and bias, before the min_new_tokens hold-back and sampling
            logits = masks.apply(logits)
        window = torch.arange(num_steps + 1, device=indices.device).expand(size, -1)  # node j: output first + j
        first = [n - lane.prompt_len + 1 for n, lane in zip(committed_cpu, batch.lanes)]
        eos = runner.config.eos_token_ids
        held = batch.sampling.hold_back_stops_at(logits.view(size, num_steps + 1, -1), first, window, eos)
        logits = held.flatten(0, 1)
        target = logits.argmax(-1).view(size, num_steps + 1)
    accepted = (proposed == target[:, :num_steps]).to(torch.int64).cumprod(dim=1).sum(dim=1)  # 3.
    lanes = torch.arange(size, device=indices.device)
    if draws is not None:  # sampled lanes: their drafts, then the bonus at their accept point
        p = draws.probs(logits.view(size, num_steps + 1, -1)[draws.lanes].flatten(0, 1), num_steps + 1)
        n_ok, extra = verify_chain(
            p.view(len(draws.lanes), num_steps + 1, -1),
            torch.stack(chain.q, dim=1),
            proposed[draws.lanes],
            draws.u_accept,
            draws.u_bonus,
        )
        picked = torch.cat([proposed[draws.lanes], proposed[draws.lanes, :1]], dim=1)
        picked[torch.arange(len(draws.lanes), device=indices.device), n_ok] = extra
        target = target.index_copy(0, draws.lanes, picked)
        accepted = accepted.index_copy(0, draws.lanes, n_ok)
    if masks is not None:
        masks.advance(target, accepted)
    if procs is not None:  # the committed path (the bonus, d1..dA) joins the output counts
        on_path = torch.arange(num_steps + 1, device=indices.device)[None, :] <= accepted[:, None]
        fm.penalties.add(indices[procs.rows], nodes[procs.rows], on_path[procs.rows])
    # node j's raw logits gave target[:, j]; read them before the draft extend (a replayed graph reuses
    # its logits buffer)
    asking = batch.sampling.logprob_rows(indices.device)
    logprobs = asking.compute(raw.view(size, num_steps + 1, -1), target) if asking is not None else None
    committed = to_device(committed_cpu, indices.device, torch.int64)
    fm.publish_kv_committed_lens(indices, committed + accepted + 1, batch.fence)  # 4.
    extend = ForwardBatch.extend_fixed(table, indices, rows, committed_cpu, target.flatten(), num_steps + 1)
    out = draft.forward(extend, features).view(size, num_steps + 1, -1)  # 5.
    seed_hidden = out[lanes, accepted]
    fm.stash_tokens(indices, target[lanes, accepted])
    fm.stash_draft(indices, draft.greedy(seed_hidden), seed_hidden)
    return target, accepted, logprobs
