"""A dense decoder stack's decode step as one call of the fused CPU ops (common/kernels/cpu_step.cpp):
`FusedLayers`, which `cpu_fused.attach` gives a decoder whose every layer is `fusable`, and the weights it
hands the ops for each layout (`HELD`, `SCALES`, one `FAMILIES` per stack)."""

from __future__ import annotations

import torch

from common.models.cpu_fused import FusedOps

# what decode_layers takes for a linear in each layout it runs: the weight the gemv streams, or the panels
# the panel GEMM reads (None where the linear has no such copy: then the step runs the torch modules)
HELD = {
    "rowblock": lambda lw: lw.weight,
    "panels": lambda lw: lw.panels,
    "w8": lambda lw: lw.low,
    "bf16": lambda lw: lw.low,
    "w8-panels": lambda lw: lw.low_panels,
    "bf16-panels": lambda lw: lw.low_panels,
    "bf16-matmul": lambda lw: lw.low_panels,  # its bf16 pairs
    "w8a8": lambda lw: lw.low_panels,  # its int8 quads
}
# the int8 scales decode_layers takes with a linear in each int8 layout: per output row, or w8a8's per column
# and block of k laid out as its quads (pack_int8_scales)
SCALES = {
    "w8": lambda lw: lw.low_scale,
    "w8-panels": lambda lw: lw.low_scale,
    "w8a8": lambda lw: lw.low_panel_scales,
}
# one stack runs one family of layouts: fp32's, or one low-precision format's (common/models/low_precision.py)
FAMILIES = ({"rowblock", "panels"}, {"w8", "w8-panels"}, {"bf16", "bf16-panels"}, {"bf16-matmul"}, {"w8a8"})


class FusedLayers:
    """A dense decoder stack's decode step as one `decode_layers` call (DecoderLM.fused_layers): for
    decode batches the backend runs fused, of at most GEMV_ROWS rows, while every linear of every
    layer is at that row count in the rowblock layout (the gemv) or the panels one (the panel GEMM),
    or every one in one low-precision format's layouts (the host's table may pick another layout: then the torch
    modules run). With `head` (the final RMSNorm and the lm_head's LinearWeight) a decode step may take the
    final norm, the lm_head and the greedy argmax in the same call too (`logits`: `decode_logits`), where the
    lm_head's layout at that row count is one the ops run. The weight list of each mix of layouts is built on
    first use: the weights stay where they are once the runner is built (weight_arena.place runs before the ops
    are attached)."""

    def __init__(self, layers: list[torch.nn.Module], ops: FusedOps, head: tuple | None = None):
        from common.models.low_precision import X_BLOCK

        self.block = X_BLOCK  # the int8 matmul's block of k (w8a8)
        a = layers[0].self_attn
        self.layers, self.ops, self.attn = layers, ops, a
        self._hold = ops.decode_weights
        self.head_dim, self.eps = a.head_dim, layers[0].input_layernorm.eps
        self.norm, self.lm_head = head if head is not None else (None, None)
        self._low = None  # the lm_head in bf16, for the greedy head's candidates (DecodeWeights.set_greedy)
        self._greedy = None  # the model's greedy head, where the step `takes_head` accepted last finds its tokens by it
        self.linears = [
            lin.weight
            for layer in layers
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        ]
        self._weights: dict[tuple, object] = {}  # per mix of layouts (one per linear, then the head's or None)
        self._serving: tuple | None = None  # the layouts of the step `serves` accepted last
        # _layouts per row bucket, while no plan or layout copy changed (packed_linear.layout_version): read
        # afresh, the 121 linears' plans cost ~0.1 ms of a batch-1 step, its objects cold after the weights
        self._version, self._by_bucket = -1, {}

    def weights(self, layouts: tuple, greedy=None):
        """decode_layers' weights (a DecodeWeights: the list below, held by the ops once, not converted from
        Python on every call) with each linear in `layouts` (one per linear, in self.linears' order, then the
        lm_head's or None: held with the final norm's weight by DecodeWeights.set_head):
        per layer input_norm, post_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, gate_up_w, gate_up_b,
        down_w, down_b (None where the layer has none), and the four linears' int8 scales (SCALES; None but in
        w8 and w8a8). A linear's weight: rowblock its fp32 weight, panels its panels, w8 / bf16 its stored
        weight, w8-panels / bf16-panels the panels of that, bf16-matmul its bf16 pairs, w8a8 its int8 quads
        (low_precision.py). With `greedy` (the model's GreedyHead, where the lm_head is the float32 gemv) the
        greedy tokens come by its candidates in the same call (DecodeWeights.set_greedy; cpu_candidates.cpp)."""
        key = (layouts, greedy is not None)
        if key not in self._weights:
            out, it = [], iter(layouts)
            for layer in self.layers:
                a, m = layer.self_attn, layer.mlp
                lins = [lin.weight for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
                qkv, o, gate_up, down = lins
                mine = [next(it) for _ in lins]
                q_norm, k_norm = (getattr(a, n, None) for n in ("q_norm", "k_norm"))
                w = [HELD[layout](lw) for lw, layout in zip(lins, mine)]
                out += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, w[0], qkv.bias]
                out += [None if n is None else n.weight for n in (q_norm, k_norm)]
                out += [w[1], o.bias, w[2], gate_up.bias, w[3], down.bias]
                out += [SCALES.get(layout, lambda lw: None)(lw) for lw, layout in zip(lins, mine)]
            held = self._hold([None if w is None else w.detach() for w in out])
            head = next(it)
            if head is not None:
                lm = self.lm_head
                scale = SCALES.get(head, lambda lw: None)(lm)
                held.set_head(self.norm.weight.detach(), HELD[head](lm), scale, lm.out_features)
                if greedy is not None and head == "rowblock":  # the float32 gemv: candidates rescored by it
                    if self._low is None:
                        self._low = lm.weight.detach().to(torch.bfloat16)
                    held.set_greedy(self._low, greedy.k, greedy.weight_err, greedy.low_norm)
            self._weights[key] = held
        return self._weights[key]

    def _layouts(self, i: int) -> tuple | None:
        """Every linear's layout in row bucket `i`, where decode_layers computes them all (the gemv or the
        panel GEMM in fp32, or one low-precision format's layouts), then the lm_head's where the ops run it
        (else None); None where decode_layers does not run the layers."""
        layouts = tuple(lw.plan[i] for lw in self.linears)
        if any(set(layouts) <= family for family in FAMILIES) and all(
            HELD[layout](lw) is not None for lw, layout in zip(self.linears, layouts)
        ):
            lm = self.lm_head
            head = None if lm is None else lm.plan[i]
            return layouts + (head if head in HELD and HELD[head](lm) is not None else None,)
        return None

    def serves(self, x: torch.Tensor, cos: torch.Tensor, backend) -> bool:
        """Whether this call computes the step; the layouts it found are kept for the call that follows
        (DecoderLM.run_layers asks, then calls: they are read once per step)."""
        if not getattr(backend, "fused_decode_now", False) or cos.shape[-1] != self.head_dim:
            return False
        return self._serves_rows(x.shape[0])

    def _serves_rows(self, rows: int) -> bool:
        """Whether every linear's layout at `rows` rows is one decode_layers runs (kept in `_serving`)."""
        from common.models.packed_linear import GEMV_ROWS, bucket_index, layout_version

        self._greedy = None  # until takes_head says
        if rows > GEMV_ROWS:
            return False
        if layout_version() != self._version:  # set-up, tuning or a test changed a plan or a copy
            self._version, self._by_bucket = layout_version(), {}
            self._weights.clear()  # the lists of copies no longer read
        i = bucket_index(rows)
        if i not in self._by_bucket:
            self._by_bucket[i] = self._layouts(i)
        self._serving = self._by_bucket[i]
        return self._serving is not None

    def takes_head(self, rows: int, greedy: bool, head=None) -> bool:
        """Whether the step `serves` accepted last (at `rows` rows) can take the lm_head too (`logits`): where
        the lm_head's layout is one the ops run and, for a greedy step where the model's greedy head (`head`)
        serves these rows, where the call finds the greedy tokens by the head's candidates (one region)."""
        self._greedy = None
        if self._serving is None or self._serving[-1] is None:
            return False
        if not greedy or head is None or not head.used_for(rows):
            return True
        self._greedy = head
        return self.weights(self._serving, head).greedy_by_candidates(rows)

    def __call__(self, x, cos, sin, forward_batch, backend) -> torch.Tensor:
        return self.ops.decode_layers(*self._args(x, cos, sin, forward_batch, backend))

    def logits(self, x, cos, sin, forward_batch, backend, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The step through the final norm and the lm_head, where `takes_head`: (with `greedy` each row's
        argmax [R], else the float32 logits [R, V]; the normed hidden [R, H])."""
        normed, logits, tokens = self.ops.decode_logits(*self._args(x, cos, sin, forward_batch, backend), greedy)
        return (tokens if greedy else logits), normed

    def greedy_step(self, token_ids, rows, kv_lens, kv_lens_cpu: list[int], embed, rotary, backend, greedy_head=None):
        """A greedy decode step in one call (`greedy_step`, common/kernels/cpu_token_step.cpp) where the step and
        its head are served at these rows: each request's pending token read from `token_ids` at its row (`rows`),
        at position kv_lens (its committed KV length), its argmax written back there; the tokens [R], or None
        where the call does not serve the step (the caller runs the forward as usual)."""
        tables = rotary.table(embed.dtype)
        if (
            embed.dtype != torch.float32
            or tables is None
            or tables[0].shape[-1] != self.head_dim
            or max(kv_lens_cpu) >= tables[0].shape[0]  # the forward grows the table first
            or not backend.fused_takes_pool()
            or not (self._serves_rows(len(kv_lens_cpu)) and self.takes_head(len(kv_lens_cpu), True, greedy_head))
        ):
            return None
        a, pool = self.attn, backend.kv_pool
        table = backend.req_to_token_pool.req_to_token
        weights = self.weights(self._serving, self._greedy)
        return self.ops.greedy_step(
            token_ids, rows, table, kv_lens, embed, *tables, weights, pool.k_all, pool.v_all, self.eps,
            a.num_heads, a.num_kv_heads, a.scale, self.block,
        )  # fmt: skip

    def _args(self, x, cos, sin, forward_batch, backend) -> tuple:
        """decode_layers' arguments (decode_logits' but `greedy`) for the step `serves` accepted last."""
        pool = backend.kv_pool
        _, _, out_loc, slots, seq_lens, heads, kv_heads, scale = backend.fused_pool_args(self.attn, forward_batch)
        weights = self.weights(self._serving, self._greedy)
        return (
            x,
            weights,
            pool.k,
            pool.v,
            self.eps,
            cos,
            sin,
            out_loc,
            slots,
            seq_lens,
            heads,
            kv_heads,
            scale,
            self.block,
        )


def fusable(layer: torch.nn.Module) -> bool:
    """A layer `decode_layers` computes: a plain DecoderLayer with both RMSNorms, grouped-query
    attention and the dense MLP, packed linears, one RMSNorm epsilon throughout, no tensor parallelism."""
    from common.models.decoder import MLP, Attention, DecoderLayer, RMSNorm
    from common.models.packed_linear import PackedLinear

    a, m = layer.self_attn, layer.mlp
    if type(layer) is not DecoderLayer or type(a) is not Attention or type(m) is not MLP or a.tp or m.tp:
        return False  # EAGLE3's layer and MoE / latent attention layers: their own forwards
    if not isinstance(layer.input_layernorm, RMSNorm) or not isinstance(layer.post_attention_layernorm, RMSNorm):
        return False  # EAGLE's head layer: no input norm
    if not all(isinstance(lin, PackedLinear) for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)):
        return False
    norms = [
        layer.input_layernorm,
        layer.post_attention_layernorm,
        *(getattr(a, n, None) for n in ("q_norm", "k_norm")),
    ]
    return len({n.eps for n in norms if n is not None}) == 1
