"""DecodeScheduler: admission, prebuilt batches and the overlap decode loop, with no model in it.

The scheduler decides; a worker (worker.py, or a fake one in tests) runs forwards and owns the
device. One step, as in SGLang: `process_input_requests` (drain the inbox) -> `pop_preallocated`
(admission) -> `get_new_prebuilt_batch` -> `run_batch` (hand a WorkerBatch to the worker) ->
`process_batch_result` (of this step, or with overlap the previous one).

Life of a request (queues named as in the code):
  1. submit(): validated (prompt + max_new_tokens within the context, else ValueError before
     anything is queued), then posted to the `inbox`; the loop moves it to `waiting` (admission).
  2. admission: in order, reserve a request slot and KV slots, all or none: on demand the prompt's and a
     growth's worth (kv_growth.py), with the full reservation prompt + max_new_tokens; one that does not
     fit waits, everyone behind it too (one that never could is refused at submit). Reserved requests
     await their handoff (state AWAITING_HANDOFF) and `prefill_fn(HandoffRequest)` is called.
  3. the prefill side delivers to the inbox (first token, KV chunks written into the reserved slots
     as they arrive, then the handoff); the loop checks the handoff and queues it on `prebuilt`.
     A broken handoff (fail_handoff or a malformed record) frees the reservation exactly once; one
     refused from decode's cached prefix on frees it and queues the request first again, to ask for
     the whole prompt (`refetch_whole`).
     Whatever a prefill replica sent is checked where it enters (handoff_intake.py): anything wrong
     with it, or any exception while handling it, is that request's error, never the scheduler's.
  4. prebuilt batch (no forward): stream work writes the handed-over K/V into the reserved slots,
     maps the req_to_token row and seeds the FutureMap row (req_pool_idx) with the first token (and
     with EAGLE the draft seed and committed length; `worker.write_prebuilt`); the first token is
     streamed; kv_committed_lens = prompt length; the batch merges into `running_batch`.
  5. overlap loop: build step N+1 (drop finished requests, merge prebuilt; on demand grow each request
     to what the step may write, retracting requests when the pool runs dry: kv_growth.py), hand it to the worker
     as a frozen WorkerBatch (a plain step, or with EAGLE a chain or tree step), bump
     kv_committed_lens, and only then process step N's results: append tokens, stream, finish (EOS
     unless ignore_eos, stop_token_ids, max_new_tokens) and release. A request whose step N computes
     its max_new_tokens-th token is left out of N+1 (known when N+1 is built: a lane of wasted work, and
     at one request a step that a new arrival would wait behind); one finished at N otherwise (EOS, a
     stop) still rides in N+1; its result is skipped, never released twice. With EAGLE a step commits accept_len
     tokens per request and kv_committed_lens are not bumped: the next build resolves them from the
     step's publish (`worker.resolve_kv_committed_lens_cpu`, FutureMap invariant 3).
  6. release: free KV slots and the request slot exactly once (with n > 1 the prompt's slots go with
     the last of its samples: slot_books.py). Every device write the scheduler
     asks for (KV, req_to_token, FutureMap) is worker stream work, so slot reuse is ordered after
     in-flight reads (invariant 7).
  7. abort(): waiting, awaiting its handoff, prebuilt or running; finish_reason "abort". The scheduler
     is the one door: the front door only calls abort(), and a request that ends while its prefill
     call runs has that call cancelled here (`cancel_prefill`), never by anyone else.
A request is `finished` once it has a finish_reason (the client has heard its end) and RELEASED once
its slots are freed; with a transfer engine an aborted request may be finished yet still hold them.
Results leave through each request's `on_output` as RequestOutput records (output.py): the new ids
of a step, and with the last one a Finish carrying everything the front door reports about the end.
`overlap=False` runs the same steps, processing each step's results right after its launch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from common.engine.handoff import HandoffRequest
from common.engine.sampling import SamplingParams
from common.engine.streams import StreamFailed
from common.request_rules import ErrorKind, FinishReason, finish_reason
from decode_service.first_token import first_outputs
from decode_service.grammar_state import check_request
from decode_service.handoff_intake import HandoffIntake, bad_reply
from decode_service.inbox import Abort, Inbox, Submit
from decode_service.kv_growth import ON_DEMAND, KvGrowth, prefill_request
from decode_service.output import Finish, OutputCallback, RequestOutput
from decode_service.req import DecodeReq, ReqState
from decode_service.sample_group import SampleGroups, end_unforked
from decode_service.schedule_batch import ScheduleBatch
from decode_service.scheduler_types import InvariantError, LaunchedStep, SpecStats
from decode_service.slot_books import SlotBooks
from decode_service.stop_strings import StopStrings
from decode_service.submit_checks import CheckedRequest, check_submit

logger = logging.getLogger(__name__)


class DecodeScheduler:
    def __init__(
        self,
        worker,
        prefill_fn: Callable[[HandoffRequest], None],
        inbox: Inbox | None = None,
        overlap: bool = True,
        debug: bool = False,
        metrics=None,
        abort_waits_for_prefill: bool = False,
        tokenizer_path: str | None = None,
        cancel_prefill: Callable[[str], None] | None = None,
        kv_reservation: str = ON_DEMAND,
        kv_grow_tokens: int = 32,
        prefix_cache: bool = False,
    ):
        """`worker`: a DecodeWorker (or a fake with its methods); `prefill_fn` starts a request's
        prefill once its slots are reserved; `inbox` is where the prefill side delivers (made here if
        not given); `metrics`: DecodeMetrics, or None in-process. With `abort_waits_for_prefill` (a
        transfer engine writes into reserved slots) an aborted request that awaits its handoff keeps
        its reservation until the prefill side's last word on it (handoff or failure) arrives.
        `cancel_prefill(rid)`: ends the prefill call the scheduler started for `rid` (the PrefillClient's
        cancel); the scheduler is the one door that ends a request, and it cancels only what it started.
        `kv_reservation` / `kv_grow_tokens`: full or on-demand KV (kv_growth.py); `prefix_cache`: keep
        finished requests' KV for prompts that continue them (prefix_cache.py)."""
        self.worker = worker
        self.prefill_fn = prefill_fn
        self.cancel_prefill = cancel_prefill
        self.inbox = inbox if inbox is not None else Inbox()
        self.overlap = overlap
        self.debug = debug
        self.metrics = metrics
        self.abort_waits_for_prefill = abort_waits_for_prefill
        self.stop_strings = StopStrings(tokenizer_path) if tokenizer_path else None  # `stop` needs the tokenizer
        self.info = worker.info
        self.spec = worker.info.spec
        self.spec_stats = SpecStats()
        # The one table of requests, by rid, from Submit to release; where each stands is its `state`.
        # Beside it only what carries order: `waiting` (admission, first come first served), `prebuilt` (in
        # handoff order), `running_batch` (lanes, device tensors); check_integrity: queues agree with states.
        self.reqs: dict[str, DecodeReq] = {}
        self.waiting: deque[DecodeReq] = deque()
        self.prebuilt: list[DecodeReq] = []
        # Its parts (each file says its job): the slot books (reserve, free, holders; n > 1's shared prompt
        # slots), the intake of prefill replies, the samples of n > 1 requests.
        extra = self.spec.extra_slots if self.spec else 0
        self.books = SlotBooks(worker, extra, eagle=self.spec is not None, prefix_cache=prefix_cache)
        if self.books.cache is not None:
            self.books.cache.metrics = metrics
        self.intake = HandoffIntake(self.reqs, worker, abort_waits_for_prefill, ends=self)
        self.books.hold_while_in_flight = abort_waits_for_prefill and overlap  # a transfer engine writes late
        self.samples = SampleGroups(self.books, worker, self.reqs, self.spec is not None, self._abort)
        hooks = getattr(worker, "hooks", None)
        self.growth = KvGrowth(self.books, worker, kv_reservation, kv_grow_tokens, hooks, metrics)
        self.running_batch = ScheduleBatch.empty(self.info.device)
        self._no_prebuilt = ScheduleBatch.empty(self.info.device)  # never changed: a merge makes new batches
        self.last_launched: LaunchedStep | None = None
        self.step_count = 0
        self.fatal_error: Exception | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._step_lock = threading.RLock()  # other threads observe state only between steps

    # ---- API (any thread) -----------------------------------------------------------------------
    def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        on_output: OutputCallback | None = None,
        trace: tuple | None = None,
    ) -> None:
        """Queue a request; `on_output` gets its RequestOutputs, `trace` (span context, submission ns) rides along."""
        self.submit_checked(rid, self.check(prompt_ids, params), on_output, trace)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> CheckedRequest:
        """InvalidRequest unless this scheduler can serve the request (submit_checks.py)."""
        return check_submit(self, prompt_ids, params)

    def submit_checked(
        self, rid: str, request: CheckedRequest, on_output: OutputCallback | None = None, trace: tuple | None = None
    ) -> None:
        """Queue a checked request; its grammar compiles here unless the caller compiled it already."""
        params, grammar = request.params, check_request(self.worker, request.params)  # InvalidRequest: nothing queued
        req = DecodeReq(
            rid, request.prompt_ids, params, params.resolved_seed(), on_output, trace=trace, grammar=grammar
        )
        self.inbox.post(Submit(req))

    def abort(self, rid: str) -> None:
        self.inbox.post(Abort(rid))

    # ---- the loop -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="decode-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop; requests still alive finish with "abort" and are freed; close the worker."""
        self._stop.set()
        self.inbox.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        loop_gone = self._thread is None or not self._thread.is_alive()
        if self.fatal_error is None and loop_gone:
            with self._step_lock:
                self.process_input_requests()
                for req in [r for r in self.reqs.values() if not r.finished]:
                    self._abort(req)
                for req in self.reqs_in(ReqState.AWAITING_HANDOFF):  # aborted, its slots still held
                    self.release(req)
        self.worker.close()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                with self._step_lock:
                    busy = self.step()
                if not busy:
                    if self.debug and self.idle:
                        self.check_integrity()  # debug mode: the books must balance whenever idle
                    self.inbox.wake.wait(timeout=0.05)
                    self.inbox.wake.clear()
        except Exception as e:  # a broken forward or invariant: fail every live request loudly
            self.fatal_error = e
            for req in list(self.reqs.values()):
                req.finish_reason = FinishReason.ERROR
                req.error = f"scheduler failed: {e!r}"
                self.emit(req, [], FinishReason.ERROR)

    @property
    def alive(self) -> bool:
        return self.fatal_error is None and (self._thread is None or self._thread.is_alive())

    @property
    def idle(self) -> bool:
        with self._step_lock:
            busy = self.reqs or len(self.running_batch) or self.last_launched is not None
            return self.inbox.empty() and not busy

    def reqs_in(self, state: ReqState) -> list[DecodeReq]:
        """The table's requests in `state`, in submission order."""
        return [r for r in list(self.reqs.values()) if r.state == state]

    def load_counts(self) -> tuple[int, int]:
        """(running lanes, live requests not decoding yet), read from any thread without the step lock
        (`list()` copies the table's values in one call)."""
        return len(self.running_batch), sum(r.state != ReqState.RUNNING for r in list(self.reqs.values()))

    def step(self) -> bool:
        """One iteration; returns False when there was nothing to do."""
        self.process_input_requests()
        self.pop_preallocated()
        running = self.running_batch.filter_unfinished(self._ending())
        if self.spec and len(running):  # EAGLE: lengths come from the last step's publish (invariant 3)
            running.set_kv_committed_lens(self.worker.resolve_kv_committed_lens_cpu(running.req_pool_indices))
        batch = running.merge(self.get_new_prebuilt_batch())
        if len(batch) and self.growth.on_demand:  # KV for what the step may write; may retract (kv_growth.py)
            lengths = batch.kv_committed_lens_cpu.tolist()
            self.growth.before_launch(self.step_count + 1, batch.reqs, lengths, self.retract, self._fail_growth)
            batch = batch.filter_unfinished()
        launched = self.run_batch(batch) if len(batch) else None
        if launched is not None and not self.spec:
            batch.bump()
        self.running_batch = batch
        done = launched
        if self.overlap:  # results lag one step: process the previous launch's
            done = self.last_launched
            self.last_launched = launched
            self.books.in_flight = self.step_count if launched is not None else 0  # slot_books: frees wait for it
        if done is not None:
            self.process_batch_result(done)
            self.books.settled(done.result.step)
        return launched is not None or done is not None

    def _ending(self) -> frozenset[int]:
        """With overlap (no EAGLE: one token per step), the requests whose step in flight computes their
        last token by max_new_tokens: the next step leaves them out (their results are still processed)."""
        if not self.overlap or self.spec or self.last_launched is None:
            return frozenset()
        return frozenset(id(r) for r in self.last_launched.reqs if len(r.output_ids) + 1 >= r.params.max_new_tokens)

    # ---- stages -----------------------------------------------------------------------------------
    def process_input_requests(self) -> None:
        """Apply every inbox message, in the order posted."""
        for msg in self.inbox.drain():
            if isinstance(msg, Submit):
                self._on_submit(msg)
            elif isinstance(msg, Abort):
                self._on_abort(msg)
            elif self.intake.takes(msg):  # a prefill reply: whatever goes wrong with it fails its request alone
                self.intake.take(msg)
            else:
                raise InvariantError(f"unknown inbox message {msg!r}")

    def pop_preallocated(self) -> None:
        """Admission, in order: reserve a request slot and KV for each waiting request that fits,
        then start its prefill; the first that does not fit waits, and everyone behind it."""
        if not self.waiting:
            return
        holders = sum(r.kv_slots is not None for r in self.reqs.values())  # only while someone waits
        while self.waiting:
            req = self.waiting[0]
            keep_free = self.growth.keep_free(holders)  # on demand: room for the holders' next growth
            if not self.books.reserve(req, self.growth.admission_outputs(req), keep_free):  # slot_books.py
                return
            self.waiting.popleft()
            holders += 1
            if self.metrics is not None and not req.retractions and not req.whole_prompt:  # its first admission
                self.metrics.queue_time.observe(time.monotonic() - req.submitted_at)
            req.state = ReqState.AWAITING_HANDOFF
            self.prefill_fn(prefill_request(req))

    def retract(self, req: DecodeReq) -> None:
        """Free a running request's KV and request slot now (kv_growth.py) and queue it first for
        admission again; a lane of it in a step still in flight is processed as usual."""
        req.retractions += 1
        self._requeue_first(req)

    def refetch_whole(self, req: DecodeReq, detail: str) -> None:
        """A prefill replica refused `req`'s handoff from its cached prefix on (handoff_intake.py; nothing
        of it was written): free its reservation and the prefix's lock, and queue it first for admission
        again, without decode's cache, so that it asks for the whole prompt's KV."""
        logger.warning("%s; asking for the whole prompt's KV", detail)
        if self.metrics is not None:
            self.metrics.decode_cache_refetches.inc()
        req.whole_prompt = True
        self._requeue_first(req)

    def _requeue_first(self, req: DecodeReq) -> None:
        """Free `req`'s reservation (slot books) and queue it first for admission again."""
        self.books.free(req)
        req.kv_slots, req.req_pool_idx, req.group = None, 0, None
        req.state = ReqState.WAITING
        self.waiting.appendleft(req)

    def _fail_growth(self, req: DecodeReq, detail: str) -> None:
        self.finish(req, FinishReason.ERROR, detail)

    def get_new_prebuilt_batch(self) -> ScheduleBatch:
        """Write handed-over KV, map rows, seed FutureMap rows; stream first tokens. No forward."""
        if not self.prebuilt:  # most steps: no tensors made (each torch op costs 10-25 us after a step's forward)
            return self._no_prebuilt
        reqs = self.prebuilt
        self.prebuilt = []
        live, committed = [], []
        landed = []
        for req in reqs:
            handoff = req.handoff
            req.handoff = None
            try:  # checks what it writes before submitting anything (handoff_writes.check_prebuilt)
                self.worker.write_prebuilt(req.req_pool_idx, req.kv_slots, handoff)
            except (InvariantError, StreamFailed):
                raise
            except Exception as e:  # that request's error: nothing of it was submitted
                self.finish(req, FinishReason.ERROR, bad_reply(req.rid, e))
                continue
            if not req.retractions:  # the front door reports it with the finish
                req.cached_tokens = max(handoff.cached_tokens, req.prefix_len)  # either cache (prefix_cache.py)
                if self.metrics is not None:
                    self.metrics.decode_cache_hit_tokens.inc(req.prefix_len)
            landed.append((req, handoff))
            if req.group is not None:  # n > 1: samples 1..n-1 fork from it (sample_group.py)
                landed.extend(self.samples.fork(req, handoff))
        for req, handoff in landed:
            new, logprobs, prompt_logprobs = first_outputs(req, handoff, self.finish_reason)
            reason = self.finish_reason(req)
            self.emit(req, new, reason, logprobs, prompt_logprobs)
            if reason is None:
                req.state = ReqState.RUNNING
                live.append(req)
                committed.append(handoff.prompt_len)
            else:
                self.finish(req, reason, emit=False)
        return ScheduleBatch.prebuilt(live, committed, self.info.device)

    def run_batch(self, batch: ScheduleBatch) -> LaunchedStep:
        """Freeze the step's inputs into a WorkerBatch and hand it to the worker (returns at once)."""
        self.step_count += 1
        spec_steps = self.spec.num_steps if self.spec else 0
        worker_batch = batch.get_worker_batch(self.step_count, spec_steps, self.info.vocab_size)
        result = self.worker.run_batch(worker_batch)
        return LaunchedStep(list(batch.reqs), result, batch.kv_committed_lens, batch.kv_committed_lens._version)

    def process_batch_result(self, launched: LaunchedStep) -> None:
        """Step N's results: wait until they are ready, then append/stream/finish."""
        result = launched.result
        self.worker.wait(result)  # raises if the forward failed (its fence never comes)
        if launched.kv_committed_lens._version != launched.kv_committed_lens_version:
            raise InvariantError(
                f"step {result.step}: kv_committed_lens was modified in place while its forward could read it"
            )
        tokens = result.tokens_cpu.tolist()
        accepted = result.accepted_cpu.tolist() if result.accepted_cpu is not None else [0] * len(tokens)
        lp = result.logprobs_cpu
        lp_row = lp.lookup() if lp is not None else {}  # lane -> row of the step's logprobs
        for lane, (req, row, n) in enumerate(zip(launched.reqs, tokens, accepted)):
            if req.finished:
                continue  # finished at an earlier step (or aborted); this lane was wasted work
            if self.spec:
                self._count_drafts(req, n)
            new, reason, logprobs = [], None, [] if lane in lp_row else None
            for j, token in enumerate(row[: n + 1] if self.spec else [row]):  # EAGLE commits A + 1 tokens
                req.output_ids.append(token)
                new.append(token)
                if logprobs is not None:
                    logprobs.append(lp.at(lp_row[lane], j, req.params))
                reason = self.finish_reason(req)
                if reason is not None:
                    break  # tokens past a finish are dropped
            self.emit(req, new, reason, logprobs)
            if reason is not None:
                self.finish(req, reason, emit=False)

    def _count_drafts(self, req: DecodeReq, accepted: int) -> None:
        req.spec_accepted += accepted
        req.spec_drafted += self.spec.num_steps
        self.spec_stats.accepted += accepted
        self.spec_stats.drafted += self.spec.num_steps

    # ---- inbox handlers -----------------------------------------------------------------------------
    def _on_submit(self, msg: Submit) -> None:
        if msg.req.rid in self.reqs:
            self.emit(msg.req, [], FinishReason.ABORT)  # duplicate id: refuse without touching the first
            return
        self.reqs[msg.req.rid] = msg.req
        self.waiting.append(msg.req)

    def _on_abort(self, msg: Abort) -> None:
        if self.samples.abort(msg.rid):  # n > 1, forked: every live sample
            return
        req = self.reqs.get(msg.rid)
        if req is not None and not req.finished:
            self._abort(req)

    def queue_prebuilt(self, req: DecodeReq) -> None:
        """`req`'s handoff is in and checked (handoff_intake.py): the next prebuilt batch lands it."""
        req.state = ReqState.PREBUILT
        self.prebuilt.append(req)

    # ---- finishing ----------------------------------------------------------------------------------
    def _abort(self, req: DecodeReq) -> None:
        if req.state == ReqState.AWAITING_HANDOFF and self.abort_waits_for_prefill:
            req.finish_reason = FinishReason.ABORT  # the client hears it now; the slots wait for the prefill's end
            self.emit(req, [], FinishReason.ABORT)
            self._end_prefill(req)
            return
        elif req.state == ReqState.PREBUILT:
            self.prebuilt.remove(req)
            req.handoff = None
        self.finish(req, FinishReason.ABORT)

    def finish_reason(self, req: DecodeReq) -> str | None:
        reason = finish_reason(req.params, req.output_ids, self.info.eos_token_ids)  # a grammar's end too
        if req.params.stop_strings and reason in (None, FinishReason.LENGTH):  # a stop string outranks the length
            req.matched_stop_str = self.stop_strings.match(req)
            reason = FinishReason.STOP if req.matched_stop_str is not None else reason
        return reason

    def finish(
        self,
        req: DecodeReq,
        reason: str,
        detail: str | None = None,
        kind: ErrorKind = ErrorKind.BROKEN,
        emit: bool = True,
    ) -> None:
        req.finish_reason = reason
        req.error, req.error_kind = detail, kind  # travel in the Finish (an "error" finish's)
        if emit:
            self.emit(req, [], reason)
        if req.state == ReqState.AWAITING_HANDOFF:
            self._end_prefill(req)
        self.release(req)

    def _end_prefill(self, req: DecodeReq) -> None:
        """`req` ended while its prefill call may still run: cancel it (a no-op once the call has ended)."""
        if self.cancel_prefill is not None:
            self.cancel_prefill(req.rid)

    def release(self, req: DecodeReq) -> None:
        if req.state == ReqState.RELEASED:
            raise InvariantError(f"request {req.rid} released twice")
        if req.state == ReqState.WAITING:  # queued (a retracted one may finish on its in-flight lane)
            self.waiting.remove(req)
        if req.kv_slots is not None:
            self.books.free(req)  # with n > 1 the prompt's slots go with the group's last sample
            req.kv_slots = None
            req.req_pool_idx = 0
        req.state = ReqState.RELEASED
        self.reqs.pop(req.rid, None)

    def emit(self, req: DecodeReq, tokens: list[int], reason: str | None, logprobs=None, prompt_lp=None) -> None:
        """Hand `req`'s consumer a RequestOutput: `tokens` gained now (with their logprobs when it asked),
        and a Finish when `reason` is set."""
        if req.on_output is None:
            return
        try:
            finish = Finish.of(req, reason) if reason else None
            req.on_output(RequestOutput(req.rid, tokens, finish, logprobs, req.index, prompt_lp))
            if finish is not None:  # n > 1 ended before its samples forked: theirs end with it
                end_unforked(req, reason)
        except Exception:  # a broken consumer must not take the scheduler down: drop the request
            logger.exception("output callback of %s failed; aborting it", req.rid)
            req.on_output = None
            if reason is None:
                self.abort(req.rid)

    # ---- checks -------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Pools balance, every used slot is held by exactly one live request, and the queues agree
        with the table (between steps)."""
        with self._step_lock:
            for queue, state in ((self.waiting, ReqState.WAITING), (self.prebuilt, ReqState.PREBUILT)):
                if sorted(r.rid for r in queue) != sorted(r.rid for r in self.reqs_in(state)):
                    raise InvariantError(f"the {state.value} queue disagrees with the request table")
            kv_holders, pool_holders = self.books.holders(self.reqs.values())
            self.worker.kv_allocator.check_integrity(holders=kv_holders)
            self.worker.req_to_token_pool.allocator.check_integrity(holders=pool_holders)
