"""SampleGroups: n > 1 (OpenAI's n), one prompt and n samples that share its KV (an object the decode
scheduler holds; the slots' side of a group, reserve and free, is slot_books.py's).

Life of an n > 1 request, beside the scheduler's steps (scheduler.py):
  1. admission reserves, all or nothing: the prompt's KV slots once (the group's, read-only once
     written), and for each of the n samples a request slot and max_new_tokens KV slots of its own
     (with EAGLE also its draft window, and for samples 1..n-1 one more: their own last prompt
     position, below). The request itself is sample 0 (its kv_slots: the prompt's, then its own), and
     its prefill call writes the prompt's KV once;
  2. the prefill side samples the n first tokens from the prompt's last logits, sample i with
     `sample_seed(seed, i)`, and sends them in the record (`Handoff.more_first_tokens`); nothing is
     streamed early for n > 1. With EAGLE the head at the last prompt position L - 1 reads the first
     token, so the record also brings samples 1..n-1's own draft seeds and head KV there
     (`Handoff.more_draft_*`, prefill_service/draft_prefill.py);
  3. at the prebuilt batch sample 0 lands as any request; samples 1..n-1 fork from it: each maps its
     row to the shared prompt slots and its own, and seeds its FutureMap row, penalties and grammar
     matcher with its own first token (the record's KV is not written again). With EAGLE a sample's
     row names the shared slots for positions 0..L-2 only (`SampleGroup.shared_len`) and its own
     slot for L - 1, which gets the prompt's target KV (copied from sample 0's slot there) and the
     sample's own head KV, and its FutureMap row its own draft seed (handoff_writes.write_fork_last).
     From then on each sample is a request of its own (rid `<rid>/<i>`, `index` i) in the running batch;
  4. release frees a sample's own slots (its kv_slots past `shared_len`) and request slot once; the
     last sample of the group to go frees the shared ones (SlotBooks.free). An abort names the request:
     every sample still live ends with it. A request freed before it forked (abort, failed handoff)
     frees the reservations of samples 1..n-1, and they hear its end (`end_unforked`): all n answers come.
So sample i of an n > 1 request decodes exactly as an n = 1 request with seed sample_seed(seed, i),
with or without EAGLE.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from common.engine.sampling import sample_seed
from decode_service.handoff_writes import ForkSeed
from decode_service.output import Finish, RequestOutput
from decode_service.req import DecodeReq, ReqState
from decode_service.slot_books import SlotBooks

logger = logging.getLogger(__name__)


class SampleGroups:
    def __init__(self, books: SlotBooks, worker, reqs: dict, eagle: bool, abort: Callable[[DecodeReq], None]):
        """`books`: the scheduler's slot books (their `groups`); `worker`: writes the forks' rows; `reqs`: the
        scheduler's request table, where forks are entered; `abort(req)`: the scheduler's abort of one request."""
        self.books, self.worker, self.reqs, self.eagle, self._abort = books, worker, reqs, eagle, abort

    def fork(self, req: DecodeReq, handoff) -> list[tuple[DecodeReq, object]]:
        """Samples 1..n-1 of `req` (sample 0, just written from `handoff`) with their own Handoffs, each
        row mapped and seeded by the worker; they hold the reservations made at admission."""
        group = req.group
        forks = []
        for i, ((idx, own), token) in enumerate(zip(group.reserved, handoff.more_first_tokens), start=1):
            seed = sample_seed(req.seed, i)
            lp = handoff.more_first_logprobs[i - 1] if handoff.more_first_logprobs else None
            fork = DecodeReq(
                f"{req.rid}/{i}", req.prompt_ids, req.params, seed, req.on_output, trace=req.trace, grammar=req.grammar
            )
            fork.index, fork.group, fork.req_pool_idx = i, group, idx
            fork.kv_slots = torch.cat([group.prompt_slots[: group.shared_len], own])
            fork.cached_tokens = req.cached_tokens  # either cache, as sample 0's
            fork.state = ReqState.PREBUILT
            mine = dataclasses.replace(
                handoff, rid=fork.rid, seed=seed, first_token=token, first_logprobs=lp, k=None, v=None
            )
            seed_of_fork = None
            if self.eagle:
                mine, seed_of_fork = _own_draft(mine, handoff, i - 1, int(group.prompt_slots[-1]))
            self.worker.write_prebuilt(idx, fork.kv_slots, mine, seed_of_fork)  # the prompt's KV is written already
            self.reqs[fork.rid] = fork
            group.samples.append(fork)
            forks.append((fork, mine))
        group.reserved = []
        return forks

    def abort(self, rid: str) -> bool:
        """An abort of an n > 1 request that has forked: every live sample ends (those retracted too,
        which left the group but keep their `<rid>/<i>` in the table). False if `rid` is not one."""
        group = self.books.groups.get(rid)
        if group is not None and group.reserved:  # not forked: sample 0's abort frees the reservations
            return False
        forks = [r for key, r in list(self.reqs.items()) if key.startswith(rid + "/")]
        if group is None and not forks:
            return False
        first = self.reqs.get(rid)
        for sample in ([first] if first is not None else []) + forks:
            if not sample.finished:
                self._abort(sample)
        return True


def end_unforked(req: DecodeReq, reason: str) -> None:
    """n > 1 ended before its samples forked (queued, in prefill, a failed handoff): samples 1..n-1
    never ran, and each hears the same end, so the caller's n answers are all there."""
    forked = req.group is not None and not req.group.reserved  # a group forms at admission, forks at handoff
    if req.params.n == 1 or forked or req.retractions or req.index != 0 or req.on_output is None:
        return
    finish = Finish.of(req, reason)
    for i in range(1, req.params.n):
        try:
            req.on_output(RequestOutput(f"{req.rid}/{i}", [], finish, None, i))
        except Exception:  # a broken consumer: as in the scheduler's emit, nothing more for it
            logger.exception("output callback of %s failed", req.rid)
            return


def _own_draft(mine, handoff, row: int, last_slot: int) -> tuple[object, ForkSeed]:
    """A forked sample's Handoff with EAGLE (its own draft seed: row `row` of the record's
    `more_draft_*`) and its ForkSeed (its head KV at the last prompt position, its target KV there
    copied from `last_slot`); the prompt's draft KV is written already."""
    own = dataclasses.replace(
        mine,
        draft_k=None,
        draft_v=None,
        draft_topk_ids=handoff.more_draft_topk_ids[row],
        draft_topk_p=handoff.more_draft_topk_p[row],
        draft_hidden=handoff.more_draft_hidden[row],
        more_draft_topk_ids=None,
        more_draft_topk_p=None,
        more_draft_hidden=None,
        more_draft_k=None,
        more_draft_v=None,
    )
    return own, ForkSeed(last_slot, handoff.more_draft_k[row], handoff.more_draft_v[row])
