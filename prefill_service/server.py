"""The prefill service: gRPC `disagg.v1.Prefill` over a PrefillEngine.

Lifecycle of one Prefill call:
  1. validate the request (prompt ids, sampling params, fits the context): INVALID_ARGUMENT if not;
  2. queue it on `prefill_queue`; the engine thread admits it when a request slot and KV for its
     prompt are free, then steps the PrefillEngine: one chunked extend forward per step across every
     admitted prompt, short prompts first (engine.py), so a long prompt does not hold back the
     first token of short ones; in the step its prompt completes, its first token is sampled, its
     KV copied out and its slots freed, and the call gets its Handoff;
  3. the call's thread streams: FirstToken at once, then KvChunks bounded by max_chunk_bytes (with
     EAGLE the head's KV follows, marked `draft`), then the PrebuiltRecord (prompt length, first
     token, chunk count, and with EAGLE the draft seed);
  4. a cancelled call is dropped while queued, its slots freed if it was mid-prefill, or it stops
     streaming; every call gets exactly one answer from the engine thread.
The service is stateless between calls. Health: NOT_SERVING until the model is loaded.
With --debug-checks the pools' integrity is checked whenever the engine is empty (every slot free).
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time

import grpc

from common.engine import intra_op
from common.wire import kv_chunks
from common.wire.grpc_server import Server
from common.engine.handoff import HandoffRequest
from common.engine.model_runner import ModelRunner
from common.metrics import PrefillMetrics
from common.wire.proto_gen import prefill_pb2, prefill_pb2_grpc
from common.engine.sampling import SamplingParams
from common.request_rules import validate_prompt
from prefill_service.config import PrefillConfig
from prefill_service.engine import PrefillEngine
from prefill_service.fault_injection import STALL_MAX_S, FaultInjector, FaultPlan

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


class _Call:
    def __init__(self, request: HandoffRequest):
        self.request = request
        self.results: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.queued_at = time.perf_counter()
        self.started_at = self.finished_at = 0.0


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, config: PrefillConfig):
        self.config = config
        self.runner = ModelRunner.for_service(config)
        self.engine = PrefillEngine(self.runner, config.chunked_prefill_size)
        self.prefill_queue: queue.Queue = queue.Queue()
        self.num_running = self.num_waiting = 0  # admitted to the engine / waiting for slots
        self.num_prefilled = 0  # requests prefilled since start
        self.faults = FaultInjector(FaultPlan.parse(config.inject_faults))
        kv = self.runner.kv_allocator
        self.metrics = PrefillMetrics(running=lambda: self.num_running, queued=self.num_queued,
                                      kv_usage=lambda: kv.num_used / kv.size)
        self.metrics_port: int | None = None
        self._thread = threading.Thread(target=intra_op.thread_target(self._engine_loop),  # it computes
                                        name="prefill-engine", daemon=True)
        self.server = Server(config.host, config.port, [SERVICE_NAME])
        prefill_pb2_grpc.add_PrefillServicer_to_server(self, self.server.server)

    def start(self) -> "PrefillService":
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
        self._thread.start()
        self.server.start()
        self.server.set_serving(True)
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        """NOT_SERVING, then calls still streaming after `grace_s` are cancelled (decode retries them)."""
        self.prefill_queue.put(None)
        self.server.stop(grace_s)
        self.metrics.close()
        self._thread.join(timeout=10)
        while True:  # calls still queued get an answer, so no handler thread waits forever
            try:
                call = self.prefill_queue.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call.results.put(RuntimeError("prefill service stopping"))

    @property
    def address(self) -> str:
        return self.server.address

    def num_queued(self) -> int:
        return self.prefill_queue.qsize() + self.num_waiting

    # ---- engine thread ---------------------------------------------------------------------------
    def _engine_loop(self) -> None:
        """Admit queued calls as slots free up, one engine step at a time; answer each call once."""
        waiting: collections.deque[_Call] = collections.deque()
        active: dict[int, _Call] = {}  # id(request) -> its call, admitted to the engine
        stopping = False
        while not stopping:
            if not waiting and not active:  # nothing to do: block for the next call
                first = self.prefill_queue.get()
                if first is None:
                    break
                waiting.append(first)
            stopping = self._drain(waiting)
            for c in list(waiting):  # one look at `cancelled` per call and stage
                if c.cancelled.is_set():
                    waiting.remove(c)
                    c.results.put(RuntimeError("cancelled before prefill"))
            for key, c in list(active.items()):
                if c.cancelled.is_set():
                    self.engine.abort(c.request)
                    del active[key]
                    c.results.put(RuntimeError("cancelled during prefill"))
            self._admit(waiting, active)
            self.num_waiting, self.num_running = len(waiting), len(active)
            if stopping:
                break
            self._step(active)
            if self.config.debug_checks and not active:  # the engine freed every slot: the books balance
                self.runner.kv_allocator.check_integrity(holders=[])
                self.runner.req_to_token_pool.allocator.check_integrity(holders=[])
        for req in self.engine.fail_all():  # stopping: everything still here gets its answer
            active.pop(id(req)).results.put(RuntimeError("prefill service stopping"))
        for c in waiting:
            c.results.put(RuntimeError("prefill service stopping"))

    def _drain(self, waiting) -> bool:
        """Move every queued call to `waiting`; True if the stop sentinel was among them."""
        while True:
            try:
                c = self.prefill_queue.get_nowait()
            except queue.Empty:
                return False
            if c is None:
                return True
            waiting.append(c)

    def _admit(self, waiting, active) -> None:
        while waiting and len(active) < self.config.max_running_requests and self.engine.can_admit(waiting[0].request):
            c = waiting.popleft()
            try:
                self.engine.admit(c.request)
            except ValueError as e:
                c.results.put(e)
                continue
            c.started_at = time.perf_counter()
            active[id(c.request)] = c
        if waiting and not active:  # nothing running, yet the head does not fit: it never will
            waiting.popleft().results.put(RuntimeError("prompt does not fit the free KV slots"))

    def _step(self, active) -> None:
        try:
            done = self.engine.step()
        except Exception as e:  # every admitted call fails (also any the step finished before it broke)
            self.engine.fail_all()
            for c in active.values():
                c.results.put(e)
            active.clear()
            done = []
        now = time.perf_counter()
        for req, handoff in done:
            c = active.pop(id(req))
            c.finished_at = now
            c.results.put(handoff)
            self.num_prefilled += 1
        self.num_running = len(active)
        if self.config.test_step_delay_s:
            time.sleep(self.config.test_step_delay_s)

    # ---- RPCs ------------------------------------------------------------------------------------
    def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext):
        sp = request.sampling_params
        # prefill samples one token: validate against that, whatever the request's decode budget is
        params = SamplingParams(max_new_tokens=1, temperature=sp.temperature, top_k=sp.top_k,
                                top_p=sp.top_p or 1.0, min_p=sp.min_p, seed=sp.seed)
        prompt = list(request.input_ids)
        try:
            validate_prompt(prompt, params, self.runner.config.vocab_size, self.runner.context_length,
                            kv_capacity=self.runner.kv_allocator.size)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.first_output_position >= len(prompt):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first_output_position must be < len(input_ids)")
        call = _Call(HandoffRequest(request.request_id, prompt, params, sp.seed, request.first_output_position))
        context.add_callback(call.cancelled.set)
        self.prefill_queue.put(call)
        result = call.results.get()
        m = self.metrics
        if call.cancelled.is_set() or isinstance(result, Exception):
            m.failures.inc()
            if not call.cancelled.is_set():
                context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {result}")
            return
        m.queue_time.observe(call.started_at - call.queued_at)
        m.compute.observe(call.finished_at - call.started_at)
        yield prefill_pb2.PrefillChunk(first_token=prefill_pb2.FirstToken(token_id=result.first_token))
        sent_first = time.perf_counter()
        max_bytes = request.max_chunk_bytes or self.config.max_chunk_bytes
        count, fault = 0, self.faults.draw()
        if fault:
            m.injected.labels(kind=fault).inc()
        chunks = kv_chunks.split(result.k, result.v, max_bytes)
        if result.draft_k is not None:  # EAGLE: the head's KV follows the target's
            chunks = itertools.chain(chunks, kv_chunks.split(result.draft_k, result.draft_v, max_bytes, draft=True))
        for chunk in chunks:
            if call.cancelled.is_set():
                m.failures.inc()
                return
            if self.config.test_kv_chunk_delay_s:
                time.sleep(self.config.test_kv_chunk_delay_s)
            count += 1
            m.handoff_bytes.inc(chunk.ByteSize())
            yield prefill_pb2.PrefillChunk(kv=chunk)
            if count == 1 and fault:
                m.failures.inc()
                if fault == "fail":
                    context.abort(grpc.StatusCode.INTERNAL, "injected handoff failure")
                call.cancelled.wait(STALL_MAX_S)  # a stall: hold the call open, sending nothing
                return
        yield prefill_pb2.PrefillChunk(record=prefill_pb2.PrebuiltRecord(
            prompt_len=len(prompt), first_token=result.first_token, num_kv_chunks=count,
            draft_seed=kv_chunks.encode_seed(result),
            queue_us=int(1e6 * (call.started_at - call.queued_at)),
            compute_us=int(1e6 * (call.finished_at - call.started_at))))
        m.handoff_transfer.observe(time.perf_counter() - sent_first)
        m.requests.inc()

    def GetLoad(self, request, context):
        kv = self.runner.kv_allocator
        return prefill_pb2.LoadResponse(num_running_reqs=self.num_running, num_waiting_reqs=self.num_queued(),
                                        num_used_tokens=kv.num_used, max_total_tokens=kv.size)
