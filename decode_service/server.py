"""The decode service: the client-facing front door, gRPC `sglang.grpc.scheduler.SglangScheduler`.

Lifecycle of one Generate call:
  1. validate (request_validation): INVALID_ARGUMENT for bad input, UNAVAILABLE when the scheduler
     is down or no prefill replica is serving; all before the first message;
  2. submit to the DecodeScheduler under a unique internal id: it queues for admission, reserves
     the request slot + KV, and calls Prefill through the PrefillClient;
  3. stream: the first token as soon as prefill sends it, KV chunks written into the reserved slots
     as they arrive, then decode tokens; streaming calls get a chunk of new ids per step, then one
     Complete; non-streaming calls get one Complete with every id;
  4. an Abort RPC or the call's cancellation aborts the request (slot and KV freed exactly once);
     a broken handoff fails the call with UNAVAILABLE (INTERNAL if the scheduler broke).
HealthCheck answers from cached state (scheduler alive, model loaded, a prefill peer serving).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.wire.grpc_server import Server
from common.engine.model_runner import ModelRunner
from decode_service.config import DecodeConfig
from decode_service.prefill_client import PrefillClient
from decode_service.request_validation import InvalidRequest, parse_generate
from decode_service.scheduler import DecodeScheduler
from decode_service.tokenizer_archive import chunks as archive_chunks
from decode_service.tokenizer_archive import tokenizer_zip

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SglangScheduler"].full_name


class DecodeService(pb_grpc.SglangSchedulerServicer):
    def __init__(self, config: DecodeConfig):
        self.config = config
        self.runner = ModelRunner.for_service(config)
        self.model_config = self.runner.config
        self.served_model_name = config.served_model_name or os.path.basename(os.path.abspath(config.model_path))
        self.prefill = PrefillClient(config.prefill_addrs, self.model_config, wait_ready_s=config.prefill_wait_s,
                                     call_timeout_s=config.prefill_timeout_s,
                                     draft_config=self.runner.draft.config.layer if self.runner.draft else None)
        self.scheduler = DecodeScheduler(self.runner, self.prefill, disable_overlap=config.disable_overlap_schedule,
                                         debug=config.debug_checks)
        self.prefill.scheduler = self.scheduler
        self._ids = itertools.count()
        self._live: dict[str, set[str]] = {}   # client request_id -> internal ids
        self._lock = threading.Lock()
        self._prefill_serving = False
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch_health, name="health-watch", daemon=True)
        self.started_at = time.time()
        self.server = Server(config.host, config.port, [SERVICE_NAME])
        pb_grpc.add_SglangSchedulerServicer_to_server(self, self.server.server)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "DecodeService":
        self.scheduler.start()
        self._watcher.start()
        self.server.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.server.stop()
        self.scheduler.stop()
        self.prefill.close()

    @property
    def address(self) -> str:
        return self.server.address

    def healthy(self) -> bool:
        return self.scheduler.alive and self._prefill_serving

    def _watch_health(self) -> None:
        while not self._stop.is_set():
            self._prefill_serving = self.prefill.any_serving()
            self.server.set_serving(self.healthy())
            self._stop.wait(0.5)

    # ---- Generate --------------------------------------------------------------------------------
    def Generate(self, request, context):
        try:
            ids, params = parse_generate(request, self.model_config.vocab_size, self.runner.context_length,
                                         self.config.default_max_new_tokens)
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not self.scheduler.alive:
            context.abort(grpc.StatusCode.UNAVAILABLE, "decode scheduler is not running")
        rid = f"{request.request_id or 'req'}#{next(self._ids)}"
        outputs: queue.Queue = queue.Queue()
        try:
            self.scheduler.submit(rid, ids, params, lambda _rid, toks, reason: outputs.put((toks, reason)))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # registered after submit, so an abort can never overtake the request it aborts
        self._track(request.request_id, rid, add=True)
        if not context.add_callback(lambda: self._abort_internal(rid)):
            self._abort_internal(rid)  # the call already ended
        try:
            yield from self._responses(request, rid, ids, outputs, context)
        finally:
            self._track(request.request_id, rid, add=False)

    def _responses(self, request, rid, ids, outputs, context):
        all_ids: list[int] = []
        while True:
            try:
                tokens, reason = outputs.get(timeout=1.0)
            except queue.Empty:  # never wait forever on a scheduler that died
                if not self.scheduler.alive:
                    context.abort(grpc.StatusCode.INTERNAL, f"decode scheduler failed: {self.scheduler.fatal_error!r}")
                continue
            all_ids.extend(tokens)
            if reason == "error":
                detail = f"request failed: {self._error_detail(rid)}"
                code = grpc.StatusCode.INTERNAL if not self.scheduler.alive else grpc.StatusCode.UNAVAILABLE
                context.abort(code, detail)
            if tokens and request.stream:
                yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.GenerateStreamChunk(
                    token_ids=tokens, prompt_tokens=len(ids), completion_tokens=len(all_ids)))
            if reason is not None:
                accepted, drafted = self.scheduler.notes.pop_spec(rid)
                complete = pb.GenerateComplete(output_ids=all_ids, finish_reason=reason, prompt_tokens=len(ids),
                                               completion_tokens=len(all_ids), spec_accepted_tokens=accepted,
                                               spec_draft_tokens=drafted)
                if reason == "stop" and all_ids:
                    complete.matched_token_id = all_ids[-1]
                yield pb.GenerateResponse(request_id=request.request_id, complete=complete)
                return

    def _error_detail(self, rid: str) -> str:
        return self.scheduler.notes.pop_error(rid) or repr(self.scheduler.fatal_error)

    def _track(self, client_id: str, rid: str, add: bool) -> None:
        with self._lock:
            live = self._live.setdefault(client_id, set())
            (live.add if add else live.discard)(rid)
            if not live:
                self._live.pop(client_id, None)

    def _abort_internal(self, rid: str) -> None:
        self.scheduler.abort(rid)
        self.prefill.cancel(rid)

    # ---- control RPCs ----------------------------------------------------------------------------
    def Abort(self, request, context):
        with self._lock:
            rids = list(self._live.get(request.request_id, ()))
        for rid in rids:
            self._abort_internal(rid)
        return pb.AbortResponse(success=bool(rids), message="aborted" if rids else "unknown or finished request")

    def HealthCheck(self, request, context):
        healthy = self.healthy()
        message = "ok" if healthy else ("scheduler down" if not self.scheduler.alive else "no prefill replica serving")
        return pb.HealthCheckResponse(healthy=healthy, message=message)

    def GetModelInfo(self, request, context):
        cfg = self.model_config
        return pb.GetModelInfoResponse(
            model_path=cfg.path, tokenizer_path=cfg.path, is_generation=True, served_model_name=self.served_model_name,
            max_context_length=self.runner.context_length, vocab_size=cfg.vocab_size,
            eos_token_ids=list(cfg.eos_token_ids), bos_token_id=cfg.bos_token_id or 0,
            max_req_input_len=self.runner.context_length - 1, architectures=[cfg.architecture],
            model_type=cfg.architecture)

    def GetServerInfo(self, request, context):
        from google.protobuf import struct_pb2

        args = struct_pb2.Struct()
        args.update({"model_path": self.model_config.path, "tokenizer_path": self.model_config.path,
                     "served_model_name": self.served_model_name, "context_length": self.runner.context_length,
                     "max_total_tokens": self.runner.kv_allocator.size, "tp_size": 1, "dp_size": 1, "pp_size": 1,
                     "max_running_requests": self.config.max_running_requests, "disaggregation_mode": "null",
                     "is_embedding": False, "vocab_size": self.model_config.vocab_size,
                     "speculative_algorithm": self.config.speculative_algorithm or "",
                     "speculative_num_steps": self.config.speculative_num_steps})
        if self.scheduler.spec:  # mean accept length = 1 + accepted drafts per verify step
            accepted, proposed = self.scheduler.spec_stats
            steps = proposed / self.config.speculative_num_steps
            args.update({"spec_accept_rate": accepted / proposed if proposed else 0.0,
                         "spec_mean_accept_length": 1 + accepted / steps if steps else 0.0})
        return pb.GetServerInfoResponse(server_args=args, active_requests=len(self.scheduler.reqs),
                                        uptime_seconds=time.time() - self.started_at, sglang_version="disagg-serve",
                                        max_total_num_tokens=self.runner.kv_allocator.size)

    def GetLoads(self, request, context):
        sched, kv = self.scheduler, self.runner.kv_allocator
        running = len(sched.running)
        waiting = len(sched.waiting) + len(sched.awaiting_handoff) + len(sched.prebuilt)
        load = pb.SchedulerLoad(dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting,
                                num_total_reqs=running + waiting, num_used_tokens=kv.num_used,
                                max_total_num_tokens=kv.size, token_usage=kv.num_used / kv.size,
                                max_running_requests=self.config.max_running_requests)
        return pb.GetLoadsResponse(version="disagg-serve", dp_rank_count=1, loads=[load])

    def GetTokenizer(self, request, context):
        try:
            data = tokenizer_zip(self.model_config.path)
        except FileNotFoundError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        for piece, digest in archive_chunks(data):
            yield common_pb2.GetTokenizerChunk(data=piece, sha256=digest)
