"""DecodeScheduler: admission, prebuilt batches and the overlap decode loop.

Life of a request (queues named as in the code):
  1. submit(): validated (prompt + max_new_tokens within the context, else ValueError before
     anything is queued), then put on `inbox`; the loop moves it to `waiting` (admission queue).
  2. admission: in order, reserve a request slot and KV slots for prompt + max_new_tokens; a request
     that does not fit waits, and so does everyone behind it; nothing is half-admitted. Reserved
     requests go to `awaiting_handoff` and `prefill_fn(HandoffRequest)` is called.
  3. deliver_handoff(): the handoff lands on `inbox`; the loop checks it and queues it on `prebuilt`.
     A broken handoff (fail_handoff or a malformed record) frees the reservation exactly once.
  4. prebuilt batch (no forward): stream work writes the handed-over K/V into the reserved slots,
     maps the req_to_token row and seeds the FutureMap row (req_pool_idx) with the first token (and
     with EAGLE the draft seed and seq_lens; handoff_writes.py); the
     first token is streamed; seq_lens = prompt length; the batch merges into the running batch.
  5. overlap loop: build step N+1 (drop finished requests, merge prebuilt), launch its forward on the
     forward stream (decode_step.py; with EAGLE eagle_step.py, chain or tree), bump seq_lens, and
     only then process step N's results: append tokens, stream, finish (EOS unless ignore_eos,
     stop_token_ids, max_new_tokens) and release. A request finished at N still rides in N+1; its
     result is skipped, never released twice. With EAGLE a step commits accept_len tokens per request
     and seq_lens are not bumped: the next build resolves them from the step's publish (FutureMap).
  6. release: free KV slots and the request slot exactly once. Every schedule-side device write
     (KV, req_to_token, FutureMap) is stream work, so slot reuse is ordered after in-flight reads.
  7. abort(): in `waiting`, `awaiting_handoff`, `prebuilt` or running; finish_reason "abort".
`disable_overlap` runs the same steps, processing each step's results right after its launch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Callable

import torch

from common.engine.handoff import Handoff, HandoffRequest
from common.engine.host_copy import to_device, to_host
from common.engine.model_runner import ModelRunner
from common.engine.sampling import SamplingParams
from common.engine.streams import make_event, make_stream, wait_event
from common.engine.spec_sampling import SpecDraws
from common.request_rules import InvalidRequest, finish_reason, validate_prompt
from decode_service.decode_step import decode_step
from decode_service.eagle_step import speculative_step
from decode_service.finish_notes import FinishNotes
from decode_service.future_map import FutureMap
from decode_service.handoff_writes import submit_kv_chunk, submit_prebuilt
from decode_service.inbox import (Abort, FirstTokenArrived, HandoffArrived, HandoffFailed, InboxMessage,
                                  KvChunkArrived, Submit)
from decode_service.req import DecodeReq, OutputCallback, ReqState
from decode_service.schedule_batch import ScheduleBatch
from decode_service.step import InvariantError, SchedulerHooks, StepResult

logger = logging.getLogger(__name__)


class DecodeScheduler:
    def __init__(self, runner: ModelRunner, prefill_fn: Callable[[HandoffRequest], None],
                 disable_overlap: bool = False, debug: bool = False, hooks: SchedulerHooks | None = None):
        self.runner = runner
        self.prefill_fn = prefill_fn
        self.overlap = not disable_overlap
        self.debug = debug
        self.hooks = hooks or SchedulerHooks()
        self.device = runner.device
        self.eos_ids = runner.config.eos_token_ids
        self.stream = make_stream(self.device)
        self.spec = runner.draft.spec if runner.draft is not None else None
        self.future_map = FutureMap(runner.req_to_token_pool.size, self.device, lambda: make_event(self.device), debug,
                                    draft_hidden_size=runner.config.hidden_size if self.spec else 0,
                                    draft_dtype=runner.dtype)
        self.spec_stats = [0, 0]  # EAGLE: drafts accepted, drafts proposed (all requests since start)
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: deque[DecodeReq] = deque()
        self.awaiting_handoff: dict[str, DecodeReq] = {}
        self.prebuilt: list[DecodeReq] = []
        self.running = ScheduleBatch.empty(self.device)
        self.last_result: StepResult | None = None
        self.reqs: dict[str, DecodeReq] = {}
        self.step_count = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fatal_error: Exception | None = None
        self.notes = FinishNotes()  # errors and EAGLE stats of finished requests, for the front door
        self.metrics = None  # DecodeMetrics, set by the service
        self._step_lock = threading.RLock()  # other threads observe state only between steps

    # ---- API (any thread) -----------------------------------------------------------------------
    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams,
               on_output: OutputCallback | None = None) -> None:
        validate_prompt(prompt_ids, params, self.runner.config.vocab_size, self.runner.context_length)
        if self.spec and self.spec.eagle_topk > 1 and not params.greedy:
            raise InvalidRequest("temperature > 0 needs chain drafting (--speculative-eagle-topk 1), not a tree")
        self._post(Submit(DecodeReq(rid, list(prompt_ids), params, params.resolved_seed(), on_output)))

    def deliver_handoff(self, handoff: Handoff) -> None:
        self._post(HandoffArrived(handoff))

    def deliver_first_token(self, rid: str, token: int, position: int = 0) -> None:
        """A token sampled by prefill (output index `position`), streamed before the handoff completes."""
        self._post(FirstTokenArrived(rid, token, position))

    def deliver_kv(self, rid: str, token_start: int, layer_start: int, k: list, v: list, draft: bool = False) -> None:
        """One KV chunk (target, or the EAGLE head's): written into the reserved slots as it arrives."""
        self._post(KvChunkArrived(rid, token_start, layer_start, k, v, draft))

    def fail_handoff(self, rid: str, error: str) -> None:
        self._post(HandoffFailed(rid, error))

    def abort(self, rid: str) -> None:
        self._post(Abort(rid))

    def _post(self, item: InboxMessage) -> None:
        self.inbox.put(item)
        self._wake.set()

    # ---- the loop -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="decode-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop; requests still alive finish with "abort" and are freed; close the stream."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        loop_gone = self._thread is None or not self._thread.is_alive()
        if self.fatal_error is None and loop_gone:
            with self._step_lock:
                self._recv()
                for req in [r for r in self.reqs.values() if not r.finished]:
                    self._on_abort(req.rid)
        self.stream.close()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                with self._step_lock:
                    busy = self.step()
                if not busy:
                    if self.debug and self.idle:
                        self.check_integrity()  # debug mode: the books must balance whenever idle
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
        except Exception as e:  # a broken forward or invariant: fail every live request loudly
            self.fatal_error = e
            for req in list(self.reqs.values()):
                req.finish_reason, req.error = "error", f"scheduler failed: {e!r}"
                self._emit(req, [], "error")

    @property
    def alive(self) -> bool:
        return self.fatal_error is None and (self._thread is None or self._thread.is_alive())

    @property
    def idle(self) -> bool:
        with self._step_lock:
            return (self.inbox.empty() and not self.waiting and not self.awaiting_handoff and not self.prebuilt
                and not len(self.running) and self.last_result is None)

    def step(self) -> bool:
        """One iteration; returns False when there was nothing to do."""
        self._recv()
        self._admit()
        if self.spec and len(self.running):  # EAGLE: lengths come from the last step's publish (invariant 3)
            self.running.set_seq_lens(self.future_map.resolve_seq_lens_cpu(self.running.req_pool_indices))
        batch = self.running.filter_unfinished().merge(self._prebuilt_batch())
        result = self._launch(batch) if len(batch) else None
        if result is not None:
            if not self.spec:
                batch.bump()
            if self.hooks.after_launch:
                self.hooks.after_launch(result.step)
        self.running = batch
        done = result if not self.overlap else self.last_result
        if self.overlap:
            self.last_result = result
        if done is not None:
            self._process(done)
        return result is not None or done is not None

    # ---- stages -----------------------------------------------------------------------------------
    def _recv(self) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, Submit):
                if msg.req.rid in self.reqs:
                    self._emit(msg.req, [], "abort")  # duplicate id: refuse without touching the first
                    continue
                self.reqs[msg.req.rid] = msg.req
                self.waiting.append(msg.req)
            elif isinstance(msg, HandoffArrived):
                self._on_handoff(msg.handoff)
            elif isinstance(msg, HandoffFailed):
                req = self.awaiting_handoff.pop(msg.rid, None)
                if req is not None:
                    self._finish(req, "error", msg.error)
            elif isinstance(msg, Abort):
                self._on_abort(msg.rid)
            elif isinstance(msg, FirstTokenArrived):
                self._on_first_token(msg)
            elif isinstance(msg, KvChunkArrived):
                req = self.awaiting_handoff.get(msg.rid)
                if req is not None:
                    pool = self.runner.draft.kv_pool if msg.draft and self.spec else self.runner.kv_pool
                    submit_kv_chunk(self.stream, pool, req.kv_slots, msg.token_start, msg.layer_start, msg.k, msg.v)
            else:
                raise InvariantError(f"unknown inbox message {msg!r}")

    def _on_first_token(self, msg: FirstTokenArrived) -> None:
        req = self.awaiting_handoff.get(msg.rid)
        if req is None or msg.position != len(req.output_ids):
            return  # gone, or a retry's resend of a token already streamed
        if req.output_ids and finish_reason(req.params, req.output_ids, self.eos_ids) is not None:
            return  # never stream a token past a finish
        req.output_ids.append(msg.token)
        self._emit(req, [msg.token], None)

    def _admit(self) -> None:
        pool, kv = self.runner.req_to_token_pool, self.runner.kv_allocator
        while self.waiting:
            req = self.waiting[0]
            need = req.reserve_len + (self.spec.extra_slots if self.spec else 0)  # + draft positions
            if pool.allocator.num_free == 0 or not kv.can_alloc(need):
                return  # wait in order
            self.waiting.popleft()
            req.req_pool_idx, req.kv_slots = pool.alloc(), kv.alloc(need)
            if self.metrics is not None:
                self.metrics.queue_time.observe(time.monotonic() - req.submitted_at)
            req.state = ReqState.AWAITING_HANDOFF
            self.awaiting_handoff[req.rid] = req
            self.prefill_fn(HandoffRequest(req.rid, req.prompt_ids, req.params, req.seed))

    def _on_handoff(self, handoff: Handoff) -> None:
        req = self.awaiting_handoff.pop(handoff.rid, None)
        if req is None:
            return  # aborted or failed meanwhile: its reservation is already freed
        try:
            if handoff.k is not None:  # KV in the record (in-process); else it came as chunks
                handoff.check(self.runner.config.num_layers)
            if self.spec:
                handoff.check_draft(self.runner.config.hidden_size)
            sent = req.output_ids[:handoff.first_position]
            if handoff.prompt_ids != req.prompt_ids + sent or len(sent) != handoff.first_position:
                raise ValueError(f"handoff {handoff.rid}: prefilled ids differ from prompt + tokens sent")
            if len(req.output_ids) > handoff.first_position + 1 or \
                    req.output_ids[handoff.first_position:] not in ([], [handoff.first_token]):
                raise ValueError(f"handoff {handoff.rid}: first token differs from the one streamed")
        except ValueError as e:
            self._finish(req, "error", str(e))
            return
        req.handoff, req.state = handoff, ReqState.PREBUILT
        self.prebuilt.append(req)

    def _prebuilt_batch(self) -> ScheduleBatch:
        """Write handed-over KV, map rows, seed FutureMap rows; stream first tokens. No forward."""
        reqs, self.prebuilt = self.prebuilt, []
        live, kv_lens = [], []
        for req in reqs:
            handoff, req.handoff = req.handoff, None
            submit_prebuilt(self.stream, self.runner, self.future_map, req.req_pool_idx, req.kv_slots, handoff)
            new = []  # tokens streamed early (or resent on a retry) may already finish the request
            if len(req.output_ids) == handoff.first_position and \
                    (not req.output_ids or finish_reason(req.params, req.output_ids, self.eos_ids) is None):
                new = [handoff.first_token]
                req.output_ids.append(handoff.first_token)
            reason = finish_reason(req.params, req.output_ids, self.eos_ids)
            self._emit(req, new, reason)
            if reason is None:
                req.state = ReqState.RUNNING
                live.append(req)
                kv_lens.append(handoff.prompt_len)
            else:
                self._finish(req, reason, emit=False)
        return ScheduleBatch.prebuilt(live, kv_lens, self.device)

    def _launch(self, batch: ScheduleBatch) -> StepResult:
        self.step_count += 1
        step = self.step_count
        result = StepResult(step, list(batch.reqs), make_event(self.device), batch.seq_lens, batch.seq_lens._version)
        indices, seq_lens, seq_lens_cpu = batch.req_pool_indices, batch.seq_lens, batch.seq_lens_cpu.tolist()
        rows = batch.req_pool_indices_cpu.tolist()
        sampling = batch.sampling
        positions = [] if sampling.all_greedy else [  # output index sampled (only random draws need it)
            s - r.prompt_len + 1 for s, r in zip(seq_lens_cpu, batch.reqs)]
        runner, fm, hooks = self.runner, self.future_map, self.hooks

        spec = self.spec
        fence = fm.arm_publish(self.stream) if spec else None  # armed at submit (invariant 3)
        lanes = [(r.rid, r.prompt_len) for r in batch.reqs] if spec else None  # for the propose hook
        draws = None if not spec or sampling.all_greedy else SpecDraws.build(  # lanes with temperature > 0
            sampling.params, sampling.seeds, [s - r.prompt_len for s, r in zip(seq_lens_cpu, batch.reqs)],
            spec.num_steps, runner.config.vocab_size)

        def forward():
            if hooks.before_forward:
                hooks.before_forward(step)
            if spec:
                tokens, accepted = speculative_step(runner, fm, indices, rows, seq_lens_cpu, spec, fence, hooks, lanes,
                                                    draws)
                result.accepted_cpu = to_host(accepted)
            else:
                tokens = decode_step(runner, fm, indices, rows, seq_lens_cpu, seq_lens, sampling, positions)
            result.tokens_cpu = to_host(tokens)
            result.results_ready.set_here()
        self.stream.submit(forward)
        return result

    def _process(self, result: StepResult) -> None:
        """Step N's results: wait on its results-ready fence, then append/stream/finish."""
        wait_event(result.results_ready, self.stream)  # raises if the forward failed (its fence never comes)
        if result.seq_lens._version != result.seq_lens_version:
            raise InvariantError(f"step {result.step}: seq_lens was modified in place while its forward could read it")
        tokens = result.tokens_cpu.tolist()
        accepted = result.accepted_cpu.tolist() if result.accepted_cpu is not None else [0] * len(tokens)
        for req, row, n in zip(result.reqs, tokens, accepted):
            if req.finished:
                continue  # finished at an earlier step (or aborted); this lane was wasted work
            if self.spec:
                req.spec_accepted += n
                req.spec_drafted += self.spec.num_steps
                self.spec_stats[0] += n
                self.spec_stats[1] += self.spec.num_steps
            new, reason = [], None
            for token in (row[:n + 1] if self.spec else [row]):  # EAGLE commits accept_len = A + 1 tokens
                req.output_ids.append(token)
                new.append(token)
                reason = finish_reason(req.params, req.output_ids, self.eos_ids)
                if reason is not None:
                    break  # tokens past a finish are dropped
            if reason is not None and self.spec:  # read by the front door with the finish
                self.notes.put_spec(req.rid, req.spec_accepted, req.spec_drafted)
            self._emit(req, new, reason)
            if reason is not None:
                self._finish(req, reason, emit=False)

    # ---- finishing ----------------------------------------------------------------------------------
    def _on_abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return
        if req.state == ReqState.WAITING:
            self.waiting.remove(req)
        elif req.state == ReqState.AWAITING_HANDOFF:
            self.awaiting_handoff.pop(rid, None)
        elif req.state == ReqState.PREBUILT:
            self.prebuilt.remove(req)
            req.handoff = None
        self._finish(req, "abort")

    def _finish(self, req: DecodeReq, reason: str, detail: str | None = None, emit: bool = True) -> None:
        req.finish_reason = reason
        req.error = detail
        if detail is not None:  # read (and popped) by the front door to explain the failure
            self.notes.put_error(req.rid, detail)
        if emit:
            self._emit(req, [], reason)
        self._release(req)

    def _release(self, req: DecodeReq) -> None:
        if req.state == ReqState.FINISHED:
            raise InvariantError(f"request {req.rid} released twice")
        if req.kv_slots is not None:
            self.runner.kv_allocator.free(req.kv_slots)
            self.runner.req_to_token_pool.free(req.req_pool_idx)
            row = to_device([req.req_pool_idx], self.future_map.device, torch.int64)
            self.stream.submit(lambda: self.future_map.reset_rows(row))
            req.kv_slots, req.req_pool_idx = None, 0
        req.state = ReqState.FINISHED
        self.reqs.pop(req.rid, None)

    def _emit(self, req: DecodeReq, tokens: list[int], reason: str | None) -> None:
        if req.on_output is None:
            return
        try:
            req.on_output(req.rid, tokens, reason)
        except Exception:  # a broken consumer must not take the scheduler down: drop the request
            logger.exception("output callback of %s failed; aborting it", req.rid)
            req.on_output = None
            if reason is None:
                self.abort(req.rid)

    # ---- checks -------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Pools balance and every used slot is held by exactly one live request (between steps)."""
        with self._step_lock:
            self._check_integrity()

    def _check_integrity(self) -> None:
        live = [r for r in self.reqs.values() if r.kv_slots is not None]
        self.runner.kv_allocator.check_integrity(holders=[r.kv_slots for r in live])
        self.runner.req_to_token_pool.allocator.check_integrity(holders=[[r.req_pool_idx] for r in live])

