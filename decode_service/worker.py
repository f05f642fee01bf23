"""DecodeWorker: the device side of the decode service, behind one typed seam.

The scheduler (scheduler.py) decides what runs; the worker runs it. The worker owns the ModelRunner,
the forward stream and the FutureMap's device buffers; the scheduler owns requests, the ScheduleBatch
and the slot allocators (which the worker lends it: they hold no model). Everything the scheduler
asks of the device goes through these methods, so a fake worker (tests/fake_worker.py) drives the
real scheduler with no model:
  - `run_batch(WorkerBatch) -> BatchResult`: arm the step's publish fence (EAGLE), submit the
    forward to the stream, return at once; `wait(result)` blocks until its host copies are ready;
  - `resolve_kv_committed_lens_cpu(indices)`: EAGLE's published lengths of the last step (invariant 3);
  - `write_kv_chunk`, `write_prebuilt`, `release_row`: stream work that lands a handoff or clears a
    released row, ordered after every forward that could still read those slots (invariant 7).
On the stream, `forward(batch)` runs a plain decode step or an EAGLE step (draft, `propose`, verify);
`propose` and `propose_tree` return the drafts unchanged unless a test passed hooks that plant drafts
(decode_service/hooks.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from common.engine.grammar import runner_compiler
from common.engine.handoff import Handoff
from common.engine.logprobs import StepLogprobs
from common.engine.model_runner import ModelRunner
from common.engine.streams import make_event, make_stream, wait_event
from common.forward.host_copy import to_device, to_host
from decode_service.decode_step import decode_step
from decode_service.eagle_step import ChainDraft, draft_chain, verify_chain_step
from decode_service.eagle_tree_step import TreeDraft, draft_tree, verify_tree_step
from decode_service.future_map import FutureMap
from decode_service.grammar_state import GrammarMatchers
from decode_service.handoff_writes import ForkSeed, submit_kv_chunk, submit_prebuilt
from decode_service.hooks import DecodeHooks
from decode_service.worker_batch import BatchResult, WorkerBatch, WorkerInfo


class DecodeWorker:
    def __init__(self, runner: ModelRunner, debug: bool = False, hooks: DecodeHooks | None = None):
        self.runner, self.hooks = runner, hooks
        cfg = runner.config
        spec = runner.draft.spec if runner.draft is not None else None
        self.info = WorkerInfo(
            runner.device,
            cfg.vocab_size,
            runner.context_length,
            tuple(cfg.eos_token_ids),
            cfg.num_layers,
            cfg.hidden_size,
            spec,
        )
        self.req_to_token_pool = runner.req_to_token_pool
        self.kv_allocator = runner.kv_allocator
        self.stream = make_stream(runner.device)
        self.future_map = FutureMap(
            runner.req_to_token_pool.size,
            runner.device,
            lambda: make_event(runner.device),
            debug,
            draft_hidden_size=cfg.hidden_size if spec else 0,
            draft_dtype=runner.dtype,
            vocab_size=cfg.vocab_size,
        )
        self.grammar: GrammarMatchers | None = None  # made with the first constrained request

    def grammar_compiler(self):
        """The model's GrammarCompiler (common/engine/grammar.py); GrammarError where grammars are not served."""
        return runner_compiler(self.runner)

    def _grammar(self) -> GrammarMatchers:
        if self.grammar is None:
            self.grammar = GrammarMatchers(self.grammar_compiler, self.info.vocab_size, self.info.device)
        return self.grammar

    # ---- schedule side ---------------------------------------------------------------------------
    def run_batch(self, batch: WorkerBatch) -> BatchResult:
        """Submit one step's forward; returns at once. With EAGLE the step's publish fence is armed
        here, before the submit, so a resolve can never wait on an older, already-set one."""
        if self.info.spec is not None:
            batch = dataclasses.replace(batch, fence=self.future_map.arm_publish(self.stream))
        return self._submit_forward(batch)

    def _submit_forward(self, batch: WorkerBatch, before: Callable[[], object] | None = None) -> BatchResult:
        """The step's forward and host copies on the stream (`before()` first there: tensor parallelism
        sends the step to the other ranks)."""
        result = BatchResult(batch.step, make_event(self.info.device))

        def work():
            if before is not None:
                before()
            tokens, accepted, logprobs = self.forward(batch)
            result.tokens_cpu = to_host(tokens)
            if accepted is not None:
                result.accepted_cpu = to_host(accepted)
            if logprobs is not None:  # beside the tokens, behind the same fence
                result.logprobs_cpu = logprobs.to_host()
            result.results_ready.set_here()

        self.stream.submit(work)
        return result

    def wait(self, result: BatchResult) -> None:
        """Block until `result`'s host copies are ready; raises if the stream failed first."""
        wait_event(result.results_ready, self.stream)

    def resolve_kv_committed_lens_cpu(self, indices: torch.Tensor) -> torch.Tensor:
        return self.future_map.resolve_kv_committed_lens_cpu(indices)

    def write_kv_chunk(
        self,
        kv_slots: torch.Tensor,
        token_start: int,
        layer_start: int,
        k: torch.Tensor,
        v: torch.Tensor,
        draft: bool = False,
        done: Callable[[], None] | None = None,
    ) -> None:
        """One handed-over KV chunk (K and V [layers, tokens, kv_heads, head_dim]) into the target's
        pool (or with `draft` the EAGLE head's); `done()` once the stream has taken it."""
        pool = self.runner.draft.kv_pool if draft and self.runner.draft is not None else self.runner.kv_pool
        submit_kv_chunk(self.stream, pool, kv_slots, token_start, layer_start, k, v, done)

    def write_prebuilt(
        self, req_pool_idx: int, kv_slots: torch.Tensor, handoff: Handoff, fork: ForkSeed | None = None
    ) -> None:
        """Map the row, write KV carried in the record, seed the FutureMap row (invariant 8); `fork`: a
        forked sample's own last prompt slot (handoff_writes.ForkSeed)."""
        submit_prebuilt(self.stream, self.runner, self.future_map, req_pool_idx, kv_slots, handoff, fork)
        if handoff.params.constraint is not None:
            self.stream.submit(lambda: self.seed_grammar(req_pool_idx, handoff))

    def seed_grammar(self, req_pool_idx: int, handoff: Handoff) -> None:
        """Stream side: the row's matcher, advanced by the outputs so far (the first token's last)."""
        outputs = handoff.prompt_ids[handoff.prompt_len - handoff.first_position :] + [handoff.first_token]
        self._grammar().seed(req_pool_idx, handoff.params.constraint, outputs)

    def extend_row(self, req_pool_idx: int, start: int, slots: torch.Tensor) -> None:
        """A row grown on demand (kv_growth.py): positions start.. map to `slots`, as stream work ahead of
        the step that writes them."""
        self.stream.submit(lambda: self.runner.req_to_token_pool.write(req_pool_idx, start, slots))

    def release_row(self, req_pool_idx: int) -> None:
        """A released row's consume-once guard is cleared after the forwards that may still use it."""
        row = to_device([req_pool_idx], self.future_map.device, torch.int64)
        self.stream.submit(lambda: self.future_map.reset_rows(row))
        self.stream.submit(lambda: self.release_grammar(req_pool_idx))

    def release_grammar(self, req_pool_idx: int) -> None:
        """Stream side: the row's matcher dropped (after every step that still carries the row)."""
        if self.grammar is not None:
            self.grammar.release(req_pool_idx)

    def raise_if_failed(self) -> None:
        self.stream.raise_if_failed()

    def synchronize(self, timeout: float | None = None) -> None:
        self.stream.synchronize(timeout)

    def close(self) -> None:
        self.stream.close()
        if self.grammar is not None:
            self.grammar.close()

    # ---- stream side -----------------------------------------------------------------------------
    def forward(self, batch: WorkerBatch) -> tuple[torch.Tensor, torch.Tensor | None, StepLogprobs | None]:
        """(tokens, accepted drafts or None, logprobs of the rows asking or None) on the device, for one step."""
        runner, fm, spec = self.runner, self.future_map, self.info.spec
        if spec is None:
            tokens, logprobs = decode_step(runner, fm, batch, self.grammar)
            return tokens, None, logprobs
        if spec.eagle_topk > 1:
            tree = self.propose_tree(batch, draft_tree(runner, fm, batch, spec))
            return verify_tree_step(runner, fm, batch, tree, self.grammar)
        chain = self.propose(batch, draft_chain(runner, fm, batch, spec.num_steps))
        return verify_chain_step(runner, fm, batch, chain, self.grammar)

    def propose(self, batch: WorkerBatch, chain: ChainDraft) -> ChainDraft:
        """The chain drafts to verify: the draft head's, or what the hooks plant."""
        if self.hooks is None:
            return chain
        planted = self.hooks.propose(batch.lanes, batch.kv_committed_lens_cpu, chain.proposed)
        return dataclasses.replace(chain, proposed=planted)

    def propose_tree(self, batch: WorkerBatch, tree: TreeDraft) -> TreeDraft:
        """The tree to verify: the draft head's, or the node tokens the hooks plant."""
        if self.hooks is None:
            return tree
        planted = self.hooks.propose_tree(
            batch.lanes, batch.kv_committed_lens_cpu, tree.node_tokens, tree.parent, tree.depth
        )
        return dataclasses.replace(tree, node_tokens=planted)
