"""Decode hooks: the one object through which tests plant the drafts a decode replica verifies, and
retract requests as if the KV pool had run dry.

Production passes none: `DecodeService(config)` leaves `hooks` None, and the worker skips them with one
`is None` test. A test hands in an object instead, `DecodeService(config, hooks=...)` (or a
`DecodeWorker(runner, hooks=...)` in process), subclassing DecodeHooks and overriding what it needs:

    propose(lanes, committed_lens, drafts)                      EAGLE chain: the [B, S] drafts to verify
    propose_tree(lanes, committed_lens, tokens, parent, depth)  EAGLE tree: the node tokens to verify
    retract(step, reqs)                                         on-demand KV: requests to retract before
                                                                step `step` launches (kv_growth.py)

`lanes` are the batch rows' (request id, prompt length), `committed_lens` their committed KV lengths
(host ints). Under tensor parallelism every rank runs its own drafts, so the hooks travel to the
follower ranks too (pickled through the spawn pipe: a hooks class a TP test uses lives at the top of
an importable module and holds plain data); each rank plants from the same batch, so all plant alike.
Planted drafts change what is verified, never what is committed: the committed tokens stay the
target's own, which is what makes deep acceptance under a grammar or a penalty testable.
This module imports nothing: the worker and the TP follower import it.
"""

from __future__ import annotations


class DecodeHooks:
    """No-op base: each method returns the drafts it is given; override the ones a test needs."""

    def propose(self, lanes, committed_lens, drafts):
        """EAGLE chain: the drafts [B, S] to verify in place of `drafts` (the draft head's)."""
        return drafts

    def propose_tree(self, lanes, committed_lens, tokens, parent, depth):
        """EAGLE tree: the node tokens to verify in place of `tokens` (same shape; parents fixed)."""
        return tokens

    def retract(self, step, reqs):
        """On-demand KV: which of `reqs` (the DecodeReqs of step `step`, on rank 0's scheduler) to retract
        before the step launches, as if the pool had run dry."""
        return []
