"""Decode service configuration: every flag and its default, declared once (sized for a small CPU machine).

The shared groups (common/service_config.py) and decode's own: the prefill client, the scheduler,
decode steps (graphs, compile) and the front door."""

from __future__ import annotations

from dataclasses import dataclass

from common.service_config import FlagGroup, ServiceConfig, flag, parse_config
from common.service_config import build_parser as _build

TOOL_CALL_PARSERS = ["hermes", "llama3_json"]  # decode_service/openai_api/chat.py
PROG = "python -m decode_service"
DESCRIPTION = "The decode service: the client-facing front door (gRPC SglangScheduler)."


@dataclass(kw_only=True)
class PrefillClientFlags(FlagGroup, title="prefill client"):
    """The prefill replicas decode calls, how one is chosen and how long a call may take."""

    prefill_addr: str = flag(
        "127.0.0.1:30001",
        "prefill replicas, comma-separated: HOST:PORT, or dns:///NAME:PORT (every address NAME resolves to, "
        "re-resolved)",
    )
    prefill_resolve_interval_s: float = flag(5.0, "how often dns:/// prefill addresses are resolved again")
    prefill_tls_ca_file: str | None = flag(
        None, "talk TLS to prefill replicas, trusting this CA (PEM); our --tls-cert/key-file are our identity", type=str
    )
    prefill_policy: str = flag(
        "cache_aware",
        "how a prefill replica is chosen: cache_aware (the one holding the prompt's prefix unless loads are far "
        "apart) or least_loaded",
        choices=["cache_aware", "least_loaded"],
    )
    prefill_wait_s: float = flag(3.0, "how long a request admitted while a replica went away waits for one")
    prefill_timeout_s: float = flag(600.0, "deadline of one Prefill call")
    prefill_progress_timeout_s: float = flag(
        5.0, "after its first token, a Prefill call silent this long is cancelled and retried on another replica"
    )

    @property
    def prefill_addrs(self) -> list[str]:
        return [a.strip() for a in self.prefill_addr.split(",") if a.strip()]


@dataclass(kw_only=True)
class SchedulerFlags(FlagGroup, title="scheduler"):
    """Admission and the decode loop."""

    default_max_new_tokens: int = flag(
        128,
        "with --decode-kv-reservation full: used when a request gives none (clamped to the context); "
        "on-demand runs such a request to the end of the context, as OpenAI reads a missing max_tokens",
    )
    decode_kv_reservation: str = flag(
        "on-demand",
        "KV a request holds: on-demand (the prompt's and --decode-kv-grow-tokens more, grown before each step; "
        "running requests are retracted and re-prefilled when the pool runs dry) or full (prompt + "
        "max_new_tokens reserved at admission, whether used or not)",
        choices=["on-demand", "full"],
    )
    disaggregation_decode_enable_radix_cache: bool = flag(
        True,
        "keep finished requests' KV on decode (a radix tree, evicted LRU under pool pressure) so a prompt that "
        "continues one (the next chat turn) takes only its new tokens' KV from prefill (EAGLE / MTP: "
        "the head's KV too; n > 1 samples share it; any --tp-size)",
    )
    decode_kv_grow_tokens: int = flag(
        32,
        "on-demand: KV slots a request gets past its prompt at admission and at each growth, and the room "
        "admission leaves free per request holding KV",
    )
    max_queued_requests: int = flag(
        256, "Generate calls that may wait beyond max_running_requests (more: RESOURCE_EXHAUSTED)"
    )
    disable_overlap_schedule: bool = flag(False, "process each step's results before launching the next")


@dataclass(kw_only=True)
class DecodeStepFlags(FlagGroup, title="decode steps"):
    """How decode steps run: captured CUDA graphs, or torch.compile of small CPU batches."""

    disable_cuda_graph: bool = flag(False, "CUDA: run decode steps eagerly instead of replaying captured graphs")
    cuda_graph_max_bs: int | None = flag(
        None, "largest decode batch captured as a CUDA graph (default: max_running_requests)", type=int
    )
    enable_torch_compile: bool = flag(
        False,
        "CPU: compile decode steps of small batches with torch.compile, each kept where timed faster "
        "(start-up: 20-90 s per row bucket on 2 cores)",
    )
    torch_compile_max_bs: int = flag(1, "with --enable-torch-compile: the largest decode batch compiled (1-8)")
    cpu_nice: int = flag(
        0,
        "CPU host shared with prefill (one OS scheduler, one cgroup): raise this process's nice value by N "
        "(0-19) at start, so arriving prompts' prefill takes the cores first and decode steps in what it "
        "leaves, as a prefill-first scheduler does (the local demo: 19)",
    )


@dataclass(kw_only=True)
class FrontDoorFlags(FlagGroup, title="front door"):
    """What clients see: the model's name and the key they must send."""

    served_model_name: str | None = flag(None, "model id reported to clients (default: folder name)", type=str)
    api_key: str | None = flag(
        None,
        "clients must send gRPC metadata authorization: Bearer <key> (health checks exempt). Prefer --api-key-file "
        "or $DISAGG_API_KEY: a value here shows in ps",
        type=str,
        secret=True,
    )
    api_key_file: str | None = flag(
        None, "file holding the front door's key (one line; refused if empty or other users may read it)", type=str
    )
    openai_port: int | None = flag(
        None, "serve the OpenAI HTTP API (/v1/chat/completions, /v1/completions, /v1/models) on this port", type=int
    )
    openai_host: str | None = flag(None, "address the OpenAI HTTP API binds (default: --host)", type=str)
    tool_call_parser: str | None = flag(
        None, "read the tool calls of tool_choice auto from the answer's text", type=str, choices=TOOL_CALL_PARSERS
    )


@dataclass(kw_only=True)
class DecodeConfig(ServiceConfig, PrefillClientFlags, SchedulerFlags, DecodeStepFlags, FrontDoorFlags):
    port: int = flag(30000, "port to bind (0 = any free port)")
    max_total_tokens: int = flag(16384, "KV slots of the decode pool")
    max_running_requests: int = flag(64, "request slots (requests decoding or awaiting a handoff)")

    def decode_step_args(self) -> dict:
        """The RunnerArgs of decode steps: captured graphs, compiled small batches, KV pools as shm files, the fp32
        decode plan timed as whole steps."""
        from common.kv_transfer.receiver import pool_memory  # here: config loads without protobuf

        return dict(
            cuda_graph=not self.disable_cuda_graph,
            cuda_graph_max_bs=self.cuda_graph_max_bs,
            torch_compile_max_bs=self.torch_compile_max_bs if self.enable_torch_compile else 0,
            kv_allocate=pool_memory(self),  # the KV transport says where our pools live (shm: files)
            time_decode_plan=True,  # the fp32 decode plan timed as whole steps at warm-up (fused_plan.py)
        )


def build_parser():
    return _build(DecodeConfig, PROG, DESCRIPTION)


def parse_args(argv=None) -> DecodeConfig:
    return parse_config(DecodeConfig, PROG, DESCRIPTION, argv)
