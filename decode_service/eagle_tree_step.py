"""One EAGLE tree step (topk > 1), run as work on the forward stream: greedy tree drafting and verify.

For a batch with committed lengths n, per request a pending bonus token b (at position n, not in KV
yet) and the head's seed hidden, with K = topk, S = num_steps, M = num_draft_tokens:
  1. draft: the seed's top-K tokens are depth 1 (the frontier). Each of S - 1 head forwards runs the
     K frontier nodes at once (TREE forward: each sees the committed head KV and its own ancestors'
     scratch entries, written at positions n + (depth-1)*K + branch), expands K children each with
     score = parent score * head probability, and keeps the best K children as the next frontier;
  2. the tree: the root b plus the M - 1 best candidates by score (a parent always scores at least
     its child, so the pick is a tree), ordered parents first; node i sits at block position n + i
     and rope position n + depth(i);
  3. verify: one target TREE forward over the M nodes (each sees the prefix and its ancestors);
  4. accept (greedy): walk from the root through children whose token equals the target argmax at
     their parent; A = depth of the deepest node reached; the bonus is the target argmax there;
  5. publish the new committed lengths n + A + 1 through the FutureMap (sets this step's publish_ready fence);
  6. move the accepted path's target KV from its node slots to positions n+1..n+A, so committed KV
     stays contiguous in req_to_token;
  7. draft extend over positions n..n+S with the path's tokens and target features (as the chain
     does); the head's output at n+A is the next seed; stash the bonus and the seed at the rows.
`draft_tree` is steps 1-2, `verify_tree_step` steps 3-7 (the worker may look at the tree between).
Static shapes throughout (every request drafts and verifies the same tree size); tokens [B, S+1] and
A [B] go to the host behind the results-ready fence, as for a chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.forward.forward_batch import ForwardBatch
from common.forward.host_copy import to_device
from decode_service.grammar_state import VerifyMask
from decode_service.worker_batch import WorkerBatch


def _expand(draft, table, indices, rows, committed_cpu, hidden, num_steps: int, topk: int):
    """Step 1: every candidate (token, score, parent candidate or -1 for the root) in level order."""
    batch, k = len(rows), topk
    probs, ids = draft.topk(hidden, k)  # depth 1: [B, K]
    tokens, scores, parents = [ids], [probs], [torch.full_like(ids, -1)]
    front_idx = torch.arange(k, device=ids.device).expand(batch, k)  # candidate index of each branch
    front_tok, front_score = ids, probs
    front_hidden = hidden.repeat_interleave(k, dim=0)  # [B*K, H]
    width = max(k, (num_steps - 1) * k)
    device = ids.device
    # scratch entries seen; slices or'ed with an identity, not `[:, branches, cols] = True`: on CUDA an
    # indexed assignment of a Python scalar copies it from the host (a sync in the middle of the step)
    eye = torch.eye(k, dtype=torch.bool, device=device)
    ancestry = torch.zeros(batch, k, width, dtype=torch.bool, device=device)
    ancestry[:, :, :k] |= eye
    offset = k  # candidates so far
    for depth in range(1, num_steps):
        fb = ForwardBatch.tree(
            table,
            indices,
            rows,
            committed_cpu,
            front_tok.flatten(),
            torch.full((batch, k), depth - 1, dtype=torch.int64, device=device),
            [(depth - 1) * k + j for j in range(k)],
            ancestry[:, :, : depth * k],
        )
        h = draft.forward(fb, front_hidden)  # [B*K, H]
        p, t = draft.topk(h, k)
        child_scores = (front_score[:, :, None] * p.view(batch, k, k)).view(batch, k * k)
        tokens.append(t.view(batch, k * k))
        scores.append(child_scores)
        parents.append(front_idx.repeat_interleave(k, dim=1))
        if depth == num_steps - 1:
            break
        front_score, pick = child_scores.topk(k, dim=1)  # the next frontier
        branch = pick // k
        front_idx = offset + pick
        front_tok = t.view(batch, k * k).gather(1, pick)
        front_hidden = h.view(batch, k, -1).gather(1, branch[..., None].expand(-1, -1, h.shape[-1])).flatten(0, 1)
        ancestry = ancestry.gather(1, branch[..., None].expand(-1, -1, width)).clone()
        ancestry[:, :, depth * k : (depth + 1) * k] |= eye
        offset += k * k
    return torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1)


def _build_tree(tokens, scores, parents, bonus, num_nodes: int, topk: int):
    """Step 2: node tokens, parent node, depth [B, M] and the ancestor-or-self mask [B, M, M]."""
    batch, device = tokens.shape[0], tokens.device
    sel = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : num_nodes - 1]
    sel = torch.sort(sel, dim=1).values  # level order: parents first
    cand = torch.arange(tokens.shape[1], device=device)  # candidates come in levels of K, then K*K each
    level = torch.where(cand < topk, 0, (cand - topk) // (topk * topk) + 1)
    node_of = torch.zeros_like(scores, dtype=torch.int64).scatter_(
        1, sel, torch.arange(1, num_nodes, device=device).expand(batch, -1)
    )
    cand_parent = parents.gather(1, sel)
    parent = torch.cat(
        [
            torch.zeros(batch, 1, dtype=torch.int64, device=device),
            torch.where(cand_parent < 0, 0, node_of.gather(1, cand_parent.clamp(min=0))),
        ],
        dim=1,
    )
    depth = torch.cat([torch.zeros(batch, 1, dtype=torch.int64, device=device), level[sel] + 1], dim=1)
    node_tokens = torch.cat([bonus[:, None], tokens.gather(1, sel)], dim=1)
    return node_tokens, parent, depth, ancestors(parent, 1 + (tokens.shape[1] - topk) // (topk * topk))


def ancestors(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """The ancestor-or-self mask [B, M, M] of trees given by parent [B, M] (the root is its own
    parent), no deeper than max_depth: one gather and one scatter per level, not per node."""
    batch, m = parent.shape
    anc = torch.eye(m, dtype=torch.bool, device=parent.device).expand(batch, -1, -1).clone()
    up = parent
    for _ in range(max_depth):  # round d marks each node's ancestor d levels up (the root is its own parent)
        anc.scatter_(2, up[..., None], True)
        up = parent.gather(1, up)
    return anc


def reached(node_tokens: torch.Tensor, parent: torch.Tensor, anc: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[B, M]: every node on the root's path to i (i included) carries the target's argmax at its
    parent (greedy accept), as masked tensor ops over the ancestor mask, not a walk per node."""
    match = node_tokens == target.gather(1, parent)
    match[:, 0] = True  # the root (the bonus) is committed
    return ~(anc & ~match[:, None, :]).any(-1)


@dataclass
class TreeDraft:
    """Steps 1-2's output, the verify's input: each request's tree of M nodes (node 0 is the bonus)."""

    node_tokens: torch.Tensor  # [B, M]
    parent: torch.Tensor  # [B, M] parent node (the root's is 0)
    depth: torch.Tensor  # [B, M]
    ancestors: torch.Tensor  # [B, M, M] ancestor-or-self mask


def draft_tree(runner, fm, batch: WorkerBatch, spec) -> TreeDraft:
    """Steps 1-2: expand the head's candidates and keep the best M - 1 as a tree under the bonus."""
    table, rows, indices = runner.req_to_token_pool.req_to_token, batch.req_pool_indices_cpu, batch.req_pool_indices
    bonus = fm.gather_tokens(indices)
    _, hidden = fm.gather_draft(indices)
    cand = _expand(
        runner.draft, table, indices, rows, batch.kv_committed_lens_cpu, hidden, spec.num_steps, spec.eagle_topk
    )
    return TreeDraft(*_build_tree(*cand, bonus, spec.num_draft_tokens, spec.eagle_topk))


def verify_tree_step(runner, fm, batch: WorkerBatch, tree: TreeDraft, matchers=None):
    """Steps 3-7; constrained lanes mask each node by the grammar state along its path (`matchers`:
    the worker's GrammarMatchers, or None). Returns (tokens [B, S+1], accepted drafts A [B], logprobs
    of the rows asking or None)
    on the device: request i commits tokens[i, :A+1]."""
    draft, table = runner.draft, runner.req_to_token_pool.req_to_token
    indices, rows, committed_cpu = batch.req_pool_indices, batch.req_pool_indices_cpu, batch.kv_committed_lens_cpu
    node_tokens, parent, depth, anc = tree.node_tokens, tree.parent, tree.depth, tree.ancestors
    size, m, steps = len(batch), node_tokens.shape[1], runner.draft.spec.num_steps
    device = indices.device
    masks = VerifyMask.of(matchers, batch, node_tokens, parent)  # filled on the grammar thread meanwhile
    fb = ForwardBatch.tree(table, indices, rows, committed_cpu, node_tokens.flatten(), depth, list(range(m)), anc)
    greedy = batch.sampling.argmax_only  # then the target's argmax is all verify needs (the greedy head)
    logits, features = runner.forward_features(fb, greedy=greedy)  # 3.
    raw = logits
    procs = batch.sampling.processors(device)
    if greedy:
        target = logits.view(size, m)
    else:
        if procs is not None:  # each node is penalised with the tokens on its own path
            state = fm.penalties.gather(indices[procs.rows])
            logits = procs.apply_on_paths(logits.view(size, m, -1), *state, anc, node_tokens).flatten(0, 1)
        if masks is not None:  # after penalties and bias, before the hold-back and the argmax
            logits = masks.apply(logits)
        first = [n - lane.prompt_len + 1 for n, lane in zip(committed_cpu, batch.lanes)]  # node: output first + depth
        held = batch.sampling.hold_back_stops_at(logits.view(size, m, -1), first, depth, runner.config.eos_token_ids)
        target = held.argmax(-1)
    lanes_t = torch.arange(size, device=device)
    reach = reached(node_tokens, parent, anc, target)  # 4.
    last = (reach * (depth + 1)).argmax(dim=1)
    accepted = depth[lanes_t, last]
    committed = to_device(committed_cpu, device, torch.int64)
    fm.publish_kv_committed_lens(indices, committed + accepted + 1, batch.fence)  # 5.
    on_path = anc[lanes_t, last]  # [B, M]
    if procs is not None:  # the committed path (the bonus and the accepted nodes) joins the output counts
        fm.penalties.add(indices[procs.rows], node_tokens[procs.rows], on_path[procs.rows])
    levels = torch.arange(steps + 1, device=device)
    on_level = (depth[:, None, :] == levels[None, :, None]) & on_path[:, None, :]
    path = on_level.to(torch.int64).argmax(-1)  # [B, S+1]
    tokens = torch.cat([node_tokens.gather(1, path[:, 1:]), node_tokens[:, :1]], dim=1)
    tokens[lanes_t, accepted] = target[lanes_t, last]
    if masks is not None:
        masks.advance(tokens, accepted)
    asking, logprobs = batch.sampling.logprob_rows(device), None  # path node d's raw logits gave tokens[:, d]
    if asking is not None:  # read before the draft extend (a replayed graph reuses its logits buffer)
        on_path = raw.view(size, m, -1).gather(1, path[..., None].expand(-1, -1, raw.shape[-1]))
        logprobs = asking.compute(on_path, tokens)
    _move_path_kv(runner.kv_pool, table, indices, committed, path, accepted)  # 6.
    feats = features.view(size, m, -1).gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
    extend = ForwardBatch.extend_fixed(table, indices, rows, committed_cpu, tokens.flatten(), steps + 1)
    out = draft.forward(extend, feats.flatten(0, 1)).view(size, steps + 1, -1)  # 7.
    seed_hidden = out[lanes_t, accepted]
    fm.stash_tokens(indices, tokens[lanes_t, accepted])
    fm.stash_draft(indices, draft.greedy(seed_hidden), seed_hidden)
    return tokens, accepted, logprobs


def _move_path_kv(pool, table, indices, committed, path, accepted) -> None:
    """Target KV of path node at depth d (block position n + path[d]) -> position n + d, for d <= A."""
    depths = torch.arange(1, path.shape[1], device=path.device)[None, :]
    src_pos = committed[:, None] + torch.where(depths <= accepted[:, None], path[:, 1:], depths)
    dst_pos = committed[:, None] + depths
    row = indices[:, None].expand_as(dst_pos)
    src, dst = table[row, src_pos].flatten().to(torch.int64), table[row, dst_pos].flatten().to(torch.int64)
    for layer in range(len(pool.k)):
        pool.k[layer][dst] = pool.k[layer][src]
        pool.v[layer][dst] = pool.v[layer][src]
