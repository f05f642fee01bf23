"""CudaGraphRunner (SGLang's name): a fixed-shape forward through static buffers, padded to a
batch-size bucket, captured as one CUDA graph per bucket and replayed (`--disable-cuda-graph`), or
run eagerly through the same buffers on CPU. Every fixed-shape forward of a step has one, not only
the decode step: the target's decode step (logits, hidden); EAGLE's verify (a chain's S + 1 tokens
per request, or a tree's M nodes with their ancestor mask: logits and features); the head's draft
steps (a chain's decode, or a tree's K nodes per request at each depth, one runner per depth since
the block grows by K entries a depth: a hidden in, a hidden out); and the draft extend (S + 1
tokens, the target's features in).

1. Buckets: 1, 2, 4, 8, then every 8 up to `max_bs`; a batch of B runs in the first bucket >= B
   (larger batches run eagerly).
2. Static buffers of the largest bucket: per token input ids, positions, out_cache_loc (and the
   per-token input, e.g. the head's hidden); per request req_pool_indices, seq_lens (visible KV
   length) and, for tree forwards, the [L, E] mask over the block. A step copies its B rows in
   (device to device, no host sync) and resets the padding rows [B, bucket): request row 0 and KV
   slot 0, the padding row and slot that no request owns, at positions 0..L-1 seeing its own L keys
   (a tree row: only its own entry of the block), input zero. A padding row writes its K/V into
   slot 0 and reads slot 0 back: nowhere harmful.
3. On CUDA, warm-up captures each bucket's forward (the attention backend must build its metadata
   from device tensors only: `triton`, for decode, fixed-length extends and trees) and a step replays it;
   the outputs live in the graph's buffers and stay valid until the next replay, which the stream
   orders after every reader of this step. On CPU, or with `capture=False`, the same buffers and
   padding run eagerly: the parity tests go through this path, so the buffer discipline is tested
   without a GPU.
"""

from __future__ import annotations

import gc
import logging

import torch

from common.forward.forward_batch import ForwardBatch, ForwardMode

log = logging.getLogger(__name__)


def batch_buckets(max_bs: int) -> list[int]:
    small = [b for b in (1, 2, 4) if b < max_bs]
    return small + list(range(8, max_bs + 8, 8)) if max_bs > 4 else small + [max_bs]


class CudaGraphRunner:
    """`forward(fb, inputs)` -> a tuple of tensors whose first dim is the batch's tokens; `inputs` is
    the static per-token input ([bucket * L, input_width]) or None; `backend` is the forward's
    attention backend. `tokens_per_row` L: 1 for a decode step, S + 1 for EAGLE's chain verify and
    draft extend (ForwardBatch.extend_fixed: L new tokens after each request's committed KV).
    `tree_block` E: the L tokens are tree nodes written at the last L of E block positions after the
    committed KV (a verify: E = L; a tree draft step at depth d: E = d * K), each seeing the prefix
    and the block positions its [L, E] mask row allows."""

    def __init__(self, forward, backend, device, max_bs: int, capture: bool, input_width=None, dtype=None,
                 tokens_per_row: int = 1, tree_block: int | None = None):  # fmt: skip
        self.forward, self.backend = forward, backend
        self.buckets = batch_buckets(max_bs)
        self.capture = capture
        self.per_row = tokens_per_row
        n, t = self.buckets[-1], self.buckets[-1] * tokens_per_row
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.out_cache_loc = (
            torch.zeros(t, **i64),
            torch.zeros(t, **i64),
            torch.zeros(t, **i64),
        )
        self.req_pool_indices = torch.zeros(n, **i64)
        self.block = tree_block or tokens_per_row  # KV positions past the committed length a row sees
        self.seq_lens = torch.full((n,), self.block, **i64)
        self.logits_indices = torch.arange(t, **i64)
        self.pad_positions = torch.arange(tokens_per_row, **i64).repeat(n)  # a padding row's positions
        self.inputs = None if input_width is None else torch.zeros(t, input_width, dtype=dtype, device=device)
        self.tree_mask = self.pad_tree_mask = None
        if tree_block is not None:  # [n, L, E]; a padding row's token sees only its own entry
            own = torch.eye(tokens_per_row, self.block, dtype=torch.bool, device=device).roll(
                self.block - tokens_per_row, 1
            )
            self.tree_mask = own.repeat(n, 1, 1)
            self.pad_tree_mask = self.tree_mask.clone()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.runs: dict[int, int] = dict.fromkeys(self.buckets, 0)  # steps per bucket (tests, metrics)

    @property
    def mode(self) -> ForwardMode:
        return ForwardMode.DECODE if self.per_row == 1 else ForwardMode.EXTEND

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def can_run(self, fb: ForwardBatch, inputs: torch.Tensor | None = None) -> bool:
        shaped = (
            inputs is None if self.inputs is None else inputs is not None and inputs.shape[1:] == self.inputs.shape[1:]
        )
        fixed = self.per_row == 1 or (
            fb.fixed_extend == self.per_row and fb.logits_indices.numel() == fb.input_ids.numel()
        )
        tree = (
            fb.tree_mask is None
            if self.tree_mask is None
            else (fb.tree_mask is not None and fb.tree_mask.shape[1:] == self.tree_mask.shape[1:])
        )
        return fb.mode == self.mode and tree and fixed and self.bucket(fb.batch_size) is not None and shaped

    def _static_batch(self, bucket: int, committed: list[int], rows: list[int]) -> ForwardBatch:
        """The ForwardBatch over the first `bucket` static rows (host lists padded the same way)."""
        pad, t = bucket - len(committed), bucket * self.per_row
        return ForwardBatch(
            mode=self.mode,
            input_ids=self.input_ids[:t],
            positions=self.positions[:t],
            req_pool_indices=self.req_pool_indices[:bucket],
            seq_lens=self.seq_lens[:bucket],
            out_cache_loc=self.out_cache_loc[:t],
            logits_indices=self.logits_indices[:t],
            prefix_lens_cpu=list(committed) + [0] * pad,
            extend_lens_cpu=[self.per_row] * bucket,
            req_pool_indices_cpu=list(rows) + [0] * pad,
            fixed_extend=0 if self.per_row == 1 else self.per_row,
            tree_mask=None if self.tree_mask is None else self.tree_mask[:bucket],
        )

    def _buffers(self):
        """(static buffer, per token?, padding value or pattern) of every input."""
        pairs = [
            (self.input_ids, True, 0),
            (self.positions, True, self.pad_positions),
            (self.req_pool_indices, False, 0),
        ]
        pairs += [(self.seq_lens, False, self.block), (self.out_cache_loc, True, 0)]
        pairs += [(self.tree_mask, False, self.pad_tree_mask)] if self.tree_mask is not None else []
        return pairs + ([(self.inputs, True, 0)] if self.inputs is not None else [])

    def _load(self, fb: ForwardBatch, inputs: torch.Tensor | None, bucket: int) -> None:
        b = fb.batch_size
        values = [fb.input_ids, fb.positions, fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc]
        values += [fb.tree_mask] if self.tree_mask is not None else []
        for (static, per_token, _), value in zip(self._buffers(), values + [inputs]):
            static[: b * self.per_row if per_token else b].copy_(value, non_blocking=True)
        self._pad(b, bucket)

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) become padding: request row 0, KV slot 0, positions from 0, its own L keys."""
        for static, per_token, fill in self._buffers():
            lo, hi = (start * self.per_row, end * self.per_row) if per_token else (start, end)
            if isinstance(fill, torch.Tensor):
                static[lo:hi].copy_(fill[lo:hi])
            else:
                static[lo:hi].fill_(fill)

    def run(self, fb: ForwardBatch, inputs: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The forward's outputs for the batch's tokens, through the bucket's buffers."""
        b, bucket = fb.batch_size, self.bucket(fb.batch_size)
        self._load(fb, inputs, bucket)
        self.runs[bucket] += 1
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            outputs = self.outputs[bucket]
        else:
            static = self._static_batch(bucket, fb.prefix_lens_cpu, fb.req_pool_indices_cpu)
            outputs = self.forward(static, None if self.inputs is None else self.inputs[: bucket * self.per_row])
        return tuple(out[: b * self.per_row] for out in outputs)

    def capture_all(self, name: str = "decode") -> None:
        """CUDA: capture every bucket (largest first, so smaller ones reuse its memory pool)."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        # No garbage collection while capturing: a finalizer that frees pinned host memory (cudaFreeHost)
        # during a capture invalidates it ("operation not permitted when stream is capturing"; seen once
        # in three GPU test runs, after other tests had left garbage behind).
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_buckets(pool, stream)
        finally:
            if enabled:
                gc.enable()
        log.info("captured %s CUDA graphs for batch sizes %s", name, self.buckets)

    def _capture_buckets(self, pool, stream) -> None:
        for bucket in reversed(self.buckets):
            fb = self._static_batch(bucket, [0] * bucket, [0] * bucket)
            inputs = None if self.inputs is None else self.inputs[: bucket * self.per_row]
            self._pad(0, bucket)  # every row padding: writes only slot 0
            with torch.cuda.stream(stream):
                self.backend.fixed_decode_splits = True  # the split count may not follow the host's max length
                try:
                    for _ in range(2):  # warm the kernels and the allocator outside the graph
                        self.forward(fb, inputs)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self.outputs[bucket] = self.forward(fb, inputs)
                finally:
                    self.backend.fixed_decode_splits = False
            torch.cuda.current_stream().wait_stream(stream)
            self.graphs[bucket] = graph
