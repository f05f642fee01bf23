"""DecodeGraphs: a decode forward through static buffers, padded to a batch-size bucket, captured as
one CUDA graph per bucket and replayed (SGLang's CudaGraphRunner; `--disable-cuda-graph`). The target
has one (its decode step: logits, hidden), and an EAGLE head another (each chain draft step after the
first: a hidden in, a hidden out). Not through it yet: the tree's draft steps, the verify and the
draft extend (several tokens per request), which run eagerly.

1. Buckets: 1, 2, 4, 8, then every 8 up to `max_bs`; a batch of B runs in the first bucket >= B
   (larger batches run eagerly).
2. Static buffers of the largest bucket: input ids, positions, req_pool_indices, seq_lens (visible
   KV length), out_cache_loc, logits indices. A step copies its B rows in (device to device, no
   host sync) and resets the padding rows [B, bucket): request row 0 and KV slot 0, the padding row
   and slot that no request owns, at position 0 with one visible key. A padding row writes its
   K/V into slot 0 and reads slot 0 back: nowhere harmful. A forward with a per-row input (the
   draft head's hidden) has a static buffer for it too, zero in padding rows.
3. On CUDA, warm-up captures each bucket's forward (the attention backend must build its metadata
   from device tensors only: `triton`) and a step replays it; the outputs (logits, hidden) live in
   the graph's buffers and stay valid until the next replay, which the stream orders after every
   reader of this step. On CPU, or with `capture=False`, the same buffers and padding run eagerly:
   the parity tests go through this path, so the buffer discipline is tested without a GPU.
"""

from __future__ import annotations

import logging

import torch

from common.engine.forward_batch import ForwardBatch, ForwardMode

log = logging.getLogger(__name__)


def batch_buckets(max_bs: int) -> list[int]:
    small = [b for b in (1, 2, 4) if b < max_bs]
    return small + list(range(8, max_bs + 8, 8)) if max_bs > 4 else small + [max_bs]


class DecodeGraphs:
    """`forward(fb, inputs)` -> a tuple of tensors whose first dim is the batch; `inputs` is the
    static per-row input ([bucket, input_width]) or None; `backend` is the forward's attention backend."""

    def __init__(self, forward, backend, device, max_bs: int, capture: bool, input_width=None, dtype=None):
        self.forward, self.backend = forward, backend
        self.buckets = batch_buckets(max_bs)
        self.capture = capture
        n = self.buckets[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids, self.positions = torch.zeros(n, **i64), torch.zeros(n, **i64)
        self.req_pool_indices, self.out_cache_loc = torch.zeros(n, **i64), torch.zeros(n, **i64)
        self.seq_lens = torch.ones(n, **i64)
        self.logits_indices = torch.arange(n, **i64)
        self.inputs = None if input_width is None else torch.zeros(n, input_width, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.runs: dict[int, int] = dict.fromkeys(self.buckets, 0)  # steps per bucket (tests, metrics)

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def can_run(self, fb: ForwardBatch, inputs: torch.Tensor | None = None) -> bool:
        shaped = (
            inputs is None if self.inputs is None else inputs is not None and inputs.shape[1:] == self.inputs.shape[1:]
        )
        return (
            fb.mode == ForwardMode.DECODE and fb.tree_mask is None and self.bucket(fb.batch_size) is not None and shaped
        )

    def _static_batch(self, bucket: int, committed: list[int], rows: list[int]) -> ForwardBatch:
        """The ForwardBatch over the first `bucket` static rows (host lists padded the same way)."""
        pad = bucket - len(committed)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            req_pool_indices=self.req_pool_indices[:bucket],
            seq_lens=self.seq_lens[:bucket],
            out_cache_loc=self.out_cache_loc[:bucket],
            logits_indices=self.logits_indices[:bucket],
            prefix_lens_cpu=list(committed) + [0] * pad,
            extend_lens_cpu=[1] * bucket,
            req_pool_indices_cpu=list(rows) + [0] * pad,
        )

    def _buffers(self):
        """(static buffer, padding value) of every per-row input."""
        pairs = [(self.input_ids, 0), (self.positions, 0), (self.req_pool_indices, 0), (self.seq_lens, 1)]
        pairs.append((self.out_cache_loc, 0))
        return pairs + ([(self.inputs, 0)] if self.inputs is not None else [])

    def _load(self, fb: ForwardBatch, inputs: torch.Tensor | None, bucket: int) -> None:
        b = fb.batch_size
        values = [fb.input_ids, fb.positions, fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc, inputs]
        for (static, _), value in zip(self._buffers(), values):
            static[:b].copy_(value, non_blocking=True)
        self._pad(b, bucket)

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) become padding: request row 0, KV slot 0, position 0, one visible key."""
        for static, fill in self._buffers():
            static[start:end].fill_(fill)

    def run(self, fb: ForwardBatch, inputs: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The forward's outputs for the batch's B rows, through the bucket's buffers."""
        b, bucket = fb.batch_size, self.bucket(fb.batch_size)
        self._load(fb, inputs, bucket)
        self.runs[bucket] += 1
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            outputs = self.outputs[bucket]
        else:
            static = self._static_batch(bucket, fb.prefix_lens_cpu, fb.req_pool_indices_cpu)
            outputs = self.forward(static, None if self.inputs is None else self.inputs[:bucket])
        return tuple(out[:b] for out in outputs)

    def capture_all(self, name: str = "decode") -> None:
        """CUDA: capture every bucket (largest first, so smaller ones reuse its memory pool)."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            fb = self._static_batch(bucket, [0] * bucket, [0] * bucket)
            inputs = None if self.inputs is None else self.inputs[:bucket]
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
        log.info("captured %s CUDA graphs for batch sizes %s", name, self.buckets)
