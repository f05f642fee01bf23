"""The decode service's read-only RPCs: model, server and load info, and the tokenizer archive.

A mixin of DecodeService (it reads `runner`, `scheduler`, `config`, `served_model_name`). Every
answer comes from state the scheduler keeps current; none waits on a step, so they answer at once
however many streams are open.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from google.protobuf import struct_pb2
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from decode_service.tokenizer_archive import chunks as archive_chunks
from decode_service.tokenizer_archive import tokenizer_zip


def load_counts(sched) -> tuple[int, int]:
    """(running, waiting): waiting counts the admission queue and requests awaiting their handoff."""
    return sched.load_counts()


class InfoRpcs:
    async def GetModelInfo(self, request, context):
        cfg = self.model_config
        return pb.GetModelInfoResponse(
            model_path=cfg.path,
            tokenizer_path=cfg.path,
            is_generation=True,
            served_model_name=self.served_model_name,
            max_context_length=self.runner.context_length,
            vocab_size=cfg.vocab_size,
            eos_token_ids=list(cfg.eos_token_ids),
            bos_token_id=cfg.bos_token_id or 0,
            max_req_input_len=self.runner.context_length - 1,
            architectures=[cfg.architecture],
            model_type=cfg.architecture,
        )

    async def GetServerInfo(self, request, context):
        args = struct_pb2.Struct()
        args.update(
            {
                "model_path": self.model_config.path,
                "tokenizer_path": self.model_config.path,
                "served_model_name": self.served_model_name,
                "context_length": self.runner.context_length,
                "max_total_tokens": self.runner.kv_allocator.size,
                "tp_size": self.config.tp_size,
                "dp_size": 1,
                "pp_size": 1,
                "max_running_requests": self.config.max_running_requests,
                "disaggregation_mode": "null",
                "is_embedding": False,
                "vocab_size": self.model_config.vocab_size,
                "speculative_algorithm": self.config.speculative_algorithm or "",
                "speculative_num_steps": self.config.speculative_num_steps,
            }
        )
        if self.scheduler.spec:  # mean accept length = 1 + accepted drafts per verify step
            accepted, proposed = self.scheduler.spec_stats
            steps = proposed / self.config.speculative_num_steps
            args.update(
                {
                    "spec_accept_rate": accepted / proposed if proposed else 0.0,
                    "spec_mean_accept_length": 1 + accepted / steps if steps else 0.0,
                }
            )
        return pb.GetServerInfoResponse(
            server_args=args,
            active_requests=len(self.scheduler.reqs),
            uptime_seconds=time.time() - self.started_at,
            sglang_version="disagg-serve",
            max_total_num_tokens=self.runner.kv_allocator.size,
        )

    def load_counts(self) -> tuple[int, int]:
        return load_counts(self.scheduler)

    async def GetLoads(self, request, context):
        kv, used = self.runner.kv_allocator, self.scheduler.books.kv_in_use  # evictable cached prefixes: free
        running, waiting = self.load_counts()
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_total_reqs=running + waiting,
            num_used_tokens=used,
            max_total_num_tokens=kv.size,
            token_usage=used / kv.size,
            max_running_requests=self.config.max_running_requests,
        )
        return pb.GetLoadsResponse(version="disagg-serve", dp_rank_count=1, loads=[load])

    async def GetTokenizer(self, request, context):
        try:  # zipping reads files: off the event loop
            data = await asyncio.get_running_loop().run_in_executor(None, tokenizer_zip, self.model_config.path)
        except FileNotFoundError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        for piece, digest in archive_chunks(data):
            yield common_pb2.GetTokenizerChunk(data=piece, sha256=digest)
