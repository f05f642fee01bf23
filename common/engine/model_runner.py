"""ModelRunner: one model with its KV pool, ReqToTokenPool, KV slot allocator and attention backend.

Sizes: `max_total_tokens` KV slots if given, else as many as `kv_budget_bytes` holds;
`max_running_requests` request slots of `context_length` positions each.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from common.attention import create_backend, resolve_backend
from common.engine.cuda_graph_runner import CudaGraphRunner
from common.engine.draft_runner import DraftRunner, SpecArgs
from common.engine.kv_pool import KVPool, resolve_kv_dtype, slots_for_budget
from common.engine.req_to_token_pool import ReqToTokenPool
from common.engine.slot_allocator import SlotAllocator
from common.forward import intra_op
from common.forward.forward_batch import ForwardBatch
from common.models import (
    compiled_layers,
    cpu_fused,
    fused_plan,
    host_table,
    linear_tuning,
    low_precision,
    packed_linear,
    weight_arena,
)
from common.models.config import ModelConfig, load_model_config
from common.models.expert_load import ExpertLoad
from common.models.loader import load_model, resolve_dtype
from common.parallel import tp_shard
from common.parallel.tp_group import TPGroup

log = logging.getLogger(__name__)
QUANTIZATIONS = ("none", *low_precision.FORMATS)


@dataclass
class RunnerArgs:
    model_path: str
    device: str = "cpu"
    dtype: str = "auto"
    max_total_tokens: int | None = None
    kv_budget_bytes: int = 256 << 20
    max_running_requests: int = 32
    context_length: int | None = None
    attention_backend: str = "auto"  # triton on CUDA, batched on CPU (common/attention/__init__.py)
    linear_layout: str = "auto"  # CPU fp32: each linear's layout, measured at start-up (common/models/linear_tuning.py)
    greedy_head: str = "auto"  # CPU fp32: greedy tokens through a bf16 pass where measured faster (greedy_head.py)
    quantization: str = "none"  # CPU fp32: "w8" / "bf16" / "bf16-matmul" / "w8a8" linears (models/low_precision.py)
    kv_cache_dtype: str = "auto"  # the KV pool's: kv_pool.resolve_kv_dtype
    spec: SpecArgs = field(default_factory=SpecArgs)  # EAGLE / EAGLE3 speculative decoding (off by default)
    cuda_graph: bool = False  # CUDA + a backend that supports it: decode steps replay captured graphs
    cuda_graph_max_bs: int | None = None  # largest captured batch (default: max_running_requests)
    static_decode_buffers: bool = False  # without capture (CPU): decode through the graphs' static buffers
    torch_compile_max_bs: int = 0  # CPU: decode batches up to this size through torch.compile (0 = off)
    cpu_fused: bool = True  # CPU fp32: norms, SiLU-mul and decode attention as fused C++ ops (cpu_fused.py)
    cuda_fused: bool = (
        True  # CUDA: norms (+ residual add), SiLU-mul, rotary + KV write as Triton kernels (cuda_fused.py)
    )
    kv_allocate: object | None = None  # CPU decode with the shm handoff: KV pools' buffers made by it (kv_pool.py)
    time_decode_plan: bool = False  # decode: warm-up times the fp32 decode plan as whole steps (fused_plan.py)
    tp: TPGroup = field(default_factory=TPGroup.single)  # tensor parallelism: this rank's part of the model
    ep_size: int = 1  # mixtures of experts under TP: 1 (a slice of every expert) or tp.size (whole experts)
    constrained_json_disable_any_whitespace: bool = False  # JSON schemas compile with any_whitespace=False

    @classmethod
    def from_service_config(cls, config) -> RunnerArgs:
        """The runner part of a prefill/decode service config (same flag names on both; the decode
        steps' part from the config's `decode_step_args()`)."""
        return cls(
            config.model_path,
            device=config.device,
            dtype=config.dtype,
            max_total_tokens=config.max_total_tokens,
            max_running_requests=config.max_running_requests,
            context_length=config.context_length,
            attention_backend=config.attention_backend,
            linear_layout=config.linear_layout,
            greedy_head=config.greedy_head,
            quantization=config.quantization,
            kv_cache_dtype=config.kv_cache_dtype,
            cpu_fused=not config.disable_cpu_fused,
            cuda_fused=not config.disable_cuda_fused,
            ep_size=config.ep_size,
            constrained_json_disable_any_whitespace=config.constrained_json_disable_any_whitespace,
            **config.decode_step_args(),  # graphs, compile, shm KV: decode's flags; prefill runs no decode steps
            spec=SpecArgs(
                config.speculative_algorithm,
                config.speculative_draft_model_path,
                config.speculative_num_steps,
                config.speculative_eagle_topk,
                config.speculative_num_draft_tokens,
                config.speculative_token_map,
            ),
        )


class ModelRunner:
    def __init__(self, args: RunnerArgs, config: ModelConfig | None = None, fused_build=cpu_fused.build_extension):
        """`fused_build`: what builds the fused CPU ops (tests hand in a stand-in that fails)."""
        self._fused_build = fused_build
        threads = torch.get_num_threads()  # the computing thread's count: layouts are timed (and compiled) with it
        self._threads = threads
        with intra_op.single_threaded():  # loading starts no OpenMP pool on this thread (intra_op.py)
            self._build(args, config)
        if self.cpu_fused is not None:  # the one-row gemv's streams, timed here (hosts differ): before tuning
            weights = packed_linear.linear_weights(self.model, *self.draft_linear_roots())
            self._time_alone(lambda: cpu_fused.pick_row_streams(self.cpu_fused, weights))
        self.linear_table = None
        if args.quantization != "none":  # low precision: no fp32 layouts to time, no greedy head (an fp32 pass)
            weights = packed_linear.linear_weights(self.model, *self.draft_linear_roots())
            nbytes = self._time_alone(  # bf16 times its layouts
                lambda: low_precision.quantize(weights, args.quantization, self.cpu_fused)
            )
            self.model.greedy_head = None
            if args.quantization == "w8a8" and self.cpu_fused is not None:  # its one-row streams (hosts differ)
                self._time_alone(lambda: cpu_fused.pick_int8_streams(self.cpu_fused, weights))
            how = low_precision.HOW[args.quantization]
            log.info("%s: %d linears as %s (%.0f MB)", args.quantization, len(weights), how, nbytes / 1e6)
        elif self.packs_linears:  # timed on a thread of its own, whose OpenMP pool ends with it
            weights = packed_linear.linear_weights(self.model, *self.draft_linear_roots())
            head = self.model.greedy_head
            self.linear_table = intra_op.on_own_thread(
                lambda: linear_tuning.tune_and_log(weights, args.linear_layout, head, args.greedy_head), threads
            )
            if head is not None and not any(head.plan):
                self.model.greedy_head = None  # never faster here: its bf16 copy's memory back

    def _time_alone(self, timed):
        """timed() (what a start-up pick or warm-up's plan measures), returned: on the computing thread's count, as
        the steps will run, and one service of the host at a time (the layout table's lock): timed while the
        other service of a pair started, a batch-1 pass of the gemv took 60 ms against 30 and the pick
        differed (2-core AMD Zen 4)."""
        with host_table.host_wide_lock():
            return intra_op.on_own_thread(timed, self._threads)

    def _build(self, args: RunnerArgs, config: ModelConfig | None) -> None:
        self.args = args
        self.config = config or load_model_config(args.model_path)
        self.device = torch.device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        cfg = self.config
        self.context_length = min(args.context_length or cfg.context_length, cfg.context_length)
        model = load_model(args.model_path, self.device, self.dtype, cfg)
        self.model = tp_shard.shard_model(model, args.tp, args.ep_size)  # MoE: common/parallel/moe_shard.py
        self.tp = args.tp
        self.expert_load = ExpertLoad.attach(self.model, args.tp, args.ep_size)  # MoE, rank 0: tokens per expert
        kv_heads = len(tp_shard.kv_heads_of(cfg, args.tp.rank, args.tp.size))  # this rank's KV heads
        if args.linear_layout not in linear_tuning.CHOICES:
            raise ValueError(f"--linear-layout must be one of {linear_tuning.CHOICES}, got {args.linear_layout!r}")
        self.packs_linears = packed_linear.available(self.device, self.dtype)
        if args.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {QUANTIZATIONS}, got {args.quantization!r}")
        if args.quantization != "none" and (not self.packs_linears or args.torch_compile_max_bs):
            raise ValueError(f"--quantization {args.quantization} is for CPU float32 without --enable-torch-compile")
        if args.greedy_head not in linear_tuning.GREEDY_CHOICES:
            raise ValueError(f"--greedy-head must be one of {linear_tuning.GREEDY_CHOICES}, got {args.greedy_head!r}")
        if self.packs_linears:
            self.model.pack_for_cpu(greedy_head=args.greedy_head != "off")
        self.attention_backend = resolve_backend(args.attention_backend, self.device)
        if args.torch_compile_max_bs:
            compiled_layers.check_usable(self.device, self.attention_backend, args.tp.size, args.static_decode_buffers)
            max_bs = min(args.torch_compile_max_bs, args.max_running_requests)
            self.model.compiled_layers = compiled_layers.CompiledLayers(self.model.run_layers, max_bs)
        quantized = args.quantization != "none"
        self.kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, self.dtype, self.device, cfg.mla is not None, quantized)
        num_slots = args.max_total_tokens or slots_for_budget(
            args.kv_budget_bytes, cfg.num_layers, kv_heads, cfg.head_dim, self.kv_dtype, cfg.v_dim
        )
        self.kv_pool = KVPool(
            num_slots, cfg.num_layers, kv_heads, cfg.head_dim, self.kv_dtype, self.device, args.kv_allocate, cfg.v_dim
        )
        self.kv_allocator = SlotAllocator(num_slots, name="KV slots")
        # rows also cover the draft positions a speculative request writes past its context
        self.req_to_token_pool = ReqToTokenPool(
            args.max_running_requests, self.context_length + args.spec.extra_slots, self.device
        )
        self.backend = create_backend(self.attention_backend, self.kv_pool, self.req_to_token_pool)
        self.backend.query_dtype = self.dtype
        if self.model.compiled_layers is not None:  # one graph per bucket: decodes of 2+ requests have a mask
            self.backend.mask_decodes_up_to = self.model.compiled_layers.max_bs
        self.draft = DraftRunner(args.spec, self) if args.spec.algorithm else None
        if self.packs_linears:  # one arena of 2 MiB pages, streamed at full bandwidth; placed before the
            roots = (self.model, *self.draft_linear_roots())  # fused ops keep the weights' tensors
            weight_arena.place(packed_linear.linear_weights(*roots), *roots)
        self.cpu_fused = self._attach_cpu_fused(args)
        self.cuda_fused = self._attach_cuda_fused(args)
        if self.attention_backend == "triton" and cfg.moe is not None:  # the experts as a grouped GEMM too
            from common.models.triton_moe import use_triton_experts

            use_triton_experts(self.model, *(() if self.draft is None else (self.draft.head,)))
        capture = args.cuda_graph and self.device.type == "cuda" and getattr(self.backend, "supports_cuda_graph", False)
        # MoE runs the Triton experts with the triton backend (no host sync), MLA's decode the latent kernel
        # (none either); MLA's extends (a verify, a draft extend, a tree's draft steps) loop over host lists,
        # so those stay eager
        extends = cfg.mla is None
        self.decode_graphs = self.verify_graphs = None
        if capture or args.static_decode_buffers:
            max_bs = args.cuda_graph_max_bs or args.max_running_requests
            forward = lambda fb, _: self._eager(fb, (), False)  # noqa: E731
            self.decode_graphs = CudaGraphRunner(forward, self.backend, self.device, max_bs, capture)
            if self.draft is not None:
                self.draft.use_cuda_graphs(max_bs, capture, extends)
            if self.draft is not None and extends:
                tree = args.spec.eagle_topk > 1  # a tree's verify: M nodes and their mask; a chain's: S + 1 tokens
                per_row = args.spec.num_draft_tokens if tree else args.spec.num_steps + 1
                verify = lambda fb, _: self._eager(fb, self.draft.capture, False)  # noqa: E731
                block = per_row if tree else None
                self.verify_graphs = CudaGraphRunner(verify, self.backend, self.device, max_bs, capture,
                                                  tokens_per_row=per_row, tree_block=block)  # fmt: skip

    def _attach_cpu_fused(self, args: RunnerArgs):
        """The fused CPU ops where they apply (built on first use; None, after a log line, where not)."""
        # off by flag; not CPU fp32 or under TP; compiled (Inductor traces the torch ops and fuses them itself)
        if not args.cpu_fused or cpu_fused.usable(self.device, self.dtype, args.tp.size) is not None:
            return None
        if self.model.compiled_layers is not None:
            return None
        ops = cpu_fused.load(self._fused_build)
        cpu_fused.attach(self.model, self.backend, ops)
        if self.draft is not None:  # the EAGLE head's layer and its one-layer pool's backend too
            cpu_fused.attach(self.draft.head, self.draft.backend, ops)
        return ops

    def _attach_cuda_fused(self, args: RunnerArgs):
        """The fused CUDA ops (Triton) where they apply: CUDA, not under TP, not off by flag."""
        if not args.cuda_fused or self.device.type != "cuda" or args.tp.size > 1:
            return None
        from common.models import cuda_fused  # Triton loads only where it runs

        if cuda_fused.usable(self.device, self.dtype, args.tp.size) is not None:
            return None
        from common.models import cuda_gemv

        ops = cuda_fused.FusedOps()
        cuda_fused.attach(self.model, self.backend, ops)
        cuda_gemv.wrap(self.model.model)  # the layers' linears: GEMV or cuBLAS per shape (tuned at warm-up)
        if self.draft is not None:  # the EAGLE head's norms, MLP and linears, and its one-layer pool's backend
            cuda_fused.attach(self.draft.head, self.draft.backend, ops)
            cuda_gemv.wrap(self.draft.head)
        return ops

    def _graph_sets(self) -> list:
        """Every static-buffer step runner with its name: target decode, verify, draft steps and extend."""
        sets = [(self.decode_graphs, "decode"), (self.verify_graphs, "verify")]
        if self.draft is not None:
            sets += [(self.draft.decode_graphs, "draft decode"), (self.draft.extend_graphs, "draft extend")]
            sets += [(g, f"draft tree depth {d}") for d, g in enumerate(self.draft.tree_graphs, 1)]
        return [(g, name) for g, name in sets if g is not None]

    def draft_linear_roots(self) -> tuple:
        return () if self.draft is None else (self.draft.head, self.draft.vocab_lm_head)

    @classmethod
    def for_service(cls, config, tp: TPGroup | None = None) -> ModelRunner:
        """A service's runner (this TP rank's part): its torch threads set, model loaded, warmed up."""
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        args = RunnerArgs.from_service_config(config)
        if tp is not None:
            args.tp = tp
        runner = cls(args)
        runner.warmup()
        return runner

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch, greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one forward; returns (logits [len(logits_indices), V] float32, hidden [T, H]). Decode
        forwards go through the static buffers (and captured graphs) when the runner has them.
        `greedy`: each logits row's argmax token [len(logits_indices)] instead of its logits (on CPU
        fp32 the greedy head may find it without the fp32 lm_head: common/models/greedy_head.py)."""
        if self.decode_graphs is not None and self.decode_graphs.can_run(forward_batch):
            return _replayed(self.decode_graphs, forward_batch, greedy)
        return self._eager(forward_batch, (), greedy)

    def greedy_step(self, token_ids, req_pool_indices, kv_lens, kv_lens_cpu: list[int]) -> torch.Tensor | None:
        """A greedy decode step whose inputs and outputs are the caller's token buffer: each request's pending
        token read from `token_ids` at its row (req_pool_indices), at position kv_lens (its committed KV
        length), and its greedy token written back there. The tokens [R] where the model takes the step in
        one call (on CPU: DecoderLM.greedy_step), else None: the caller runs `forward` as usual."""
        if self.decode_graphs is not None or self.expert_load is not None:
            return None
        step = getattr(self.model, "greedy_step", None)
        return None if step is None else step(token_ids, req_pool_indices, kv_lens, kv_lens_cpu, self.backend)

    @torch.inference_mode()
    def forward_features(
        self, forward_batch: ForwardBatch, capture: tuple[int, ...] | None = None, greedy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like forward, but returns the draft head's input features for every token instead of the
        hidden: the final normed hidden (EAGLE) or the captured layers concatenated (EAGLE3). The
        layers are the draft head's unless `capture` names them (the fitting tool's data)."""
        if capture is None:
            if self.verify_graphs is not None and self.verify_graphs.can_run(forward_batch):
                return _replayed(self.verify_graphs, forward_batch, greedy)
            capture = self.draft.capture if self.draft is not None else ()
        return self._eager(forward_batch, capture, greedy)

    def _eager(self, forward_batch: ForwardBatch, capture: tuple[int, ...], greedy: bool):
        """(logits or greedy tokens of the logits rows, the hidden or the captured layers' features)."""
        if self.expert_load is not None:  # which rows are padding (slot 0): a replayed graph's counts skip them
            self.expert_load.slots = forward_batch.out_cache_loc
        if not capture:
            return self.model.forward_logits(forward_batch, self.backend, greedy)
        hidden, features = self.model(forward_batch, self.backend, capture=capture)
        rows = hidden[forward_batch.logits_indices]
        return (self.model.greedy_tokens(rows) if greedy else self.model.compute_logits(rows)), features

    @torch.inference_mode()
    def warmup(self, prompt_len: int = 16) -> None:
        """One extend and one decode forward on scratch slots (freed after), so the first real request
        does not pay one-time kernel and allocator set-up; captures the CUDA graphs, and with
        --enable-torch-compile compiles and times each compiled bucket. Run before a service reports
        SERVING."""
        with intra_op.single_threaded():
            if self.cuda_fused is not None:  # each few-row linear's kernel, picked before graphs capture it
                from common.models import cuda_gemv

                cuda_gemv.tune(self.model, *(() if self.draft is None else (self.draft.head,)))
            self._warmup(prompt_len)
            for graphs, name in self._graph_sets():
                graphs.capture_all(name)
        compiled = self.model.compiled_layers
        if compiled is not None:  # with the computing thread's count, which Inductor's kernels are built for
            intra_op.on_own_thread(
                lambda: compiled_layers.compile_and_time(compiled, self._warm_decode, self._warm_decode),
                self._threads,
            )
        if self._times_fused_plan():
            lines = self._time_alone(
                lambda: fused_plan.choose(  # as many requests as the KV pool holds at two slots each
                    self.model.fused_layers,
                    self._timed_decode,
                    min(self.args.max_running_requests, self.kv_allocator.size // 2),
                )
            )
            if lines:
                log.info("decode steps' layouts timed as whole steps (fused_plan.py):\n%s", "\n".join(lines))
        if self.expert_load is not None:  # the metrics count served tokens, not warm-up's
            self.expert_load.reset()

    def _times_fused_plan(self) -> bool:
        """Whether warm-up times the fused stack's plan against the layout table's (fused_plan.py): decode's runner
        (`time_decode_plan`), CPU fp32 with the fused stack, layouts timed here (`auto` / `retime`, not forced or
        pinned), no torch.compile."""
        table = self.linear_table
        return (
            self.args.time_decode_plan
            and self.cpu_fused is not None
            and self.model.fused_layers is not None
            and self.model.compiled_layers is None
            and table is not None
            and table.mode in ("auto", "retime")
            and table.pinned_greedy is None
        )

    def _timed_decode(self, batch: int) -> float:
        """Seconds of one decode step of `batch` requests on scratch slots (_warm_decode)."""
        start = time.perf_counter()
        self._warm_decode(batch)
        return time.perf_counter() - start

    def _warmup(self, prompt_len: int) -> None:
        n = max(1, min(prompt_len, self.context_length - 1, self.kv_allocator.size - 1))
        row = self.req_to_token_pool.alloc()
        slots = []
        try:
            slots = self.kv_allocator.alloc(n + 1)
            self.req_to_token_pool.write(row, 0, slots)
            self.forward(ForwardBatch.extend(self.req_to_token_pool.req_to_token, [row], [0], [[0] * n]))
        finally:
            self.kv_allocator.free(slots)
            self.req_to_token_pool.free(row)
        if self.model.compiled_layers is None:  # else warmup() compiles it, on the computing thread's count
            self._warm_decode(1, n)

    def _warm_decode(self, batch: int, n: int = 16) -> None:
        """One decode forward of `batch` requests at KV length n + 1 on scratch slots (freed after). With
        torch compile it also serves ragged batches of that bucket: they run the same graph, since the
        backend gives every decode of 2+ requests a mask (`mask_decodes_up_to`)."""
        n = max(1, min(n, self.context_length - 1, self.kv_allocator.size // batch - 1))
        rows, slots = [], []
        try:
            for _ in range(batch):
                rows.append(self.req_to_token_pool.alloc())
                slots.append(self.kv_allocator.alloc(n + 1))
                self.req_to_token_pool.write(rows[-1], 0, slots[-1])
            self.forward(
                ForwardBatch.decode(
                    self.req_to_token_pool.req_to_token,
                    torch.tensor(rows),
                    [n] * batch,
                    torch.zeros(batch, dtype=torch.int64),
                    req_pool_indices_cpu=rows,
                ),
                greedy=self.model.greedy_head is not None,  # its oneDNN set-up too (the extend ran the lm_head)
            )
        finally:
            for s in slots:
                self.kv_allocator.free(s)
            for r in rows:
                self.req_to_token_pool.free(r)


def _replayed(graphs: CudaGraphRunner, forward_batch: ForwardBatch, greedy: bool):
    """A static-buffer runner's (logits, hidden or features); with `greedy` the logits' argmax."""
    logits, out = graphs.run(forward_batch)
    return (torch.argmax(logits, dim=-1) if greedy else logits), out
