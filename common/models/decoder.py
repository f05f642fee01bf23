"""DecoderLM: one decoder for LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM, and with
their own parts Qwen3MoeForCausalLM and DeepseekV3ForCausalLM (`attention_for`, `mlp_for`).

Switches come from ModelConfig: q/k/v bias and o_proj bias (separately), q/k RMSNorm per head
(Qwen3), explicit head_dim, grouped-query attention, tied embeddings, rope scaling. Parameter names
are the Hugging Face ones, so the loader maps checkpoint tensors one to one.

Tokens of all requests are packed into one [T, hidden] tensor; attention goes through the backend
(which stores K/V in the paged pool and reads it back through req_to_token).

q/k/v and gate/up run as one matmul each (`qkv_proj`, `gate_up_proj`): fewer, larger GEMMs per
layer. The checkpoint keeps HF's separate tensors; `checkpoint_tensors()` maps each HF name to
its slice of the fused parameter, so the loader still checks and copies tensors one to one.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from common.forward.forward_batch import ForwardBatch, ForwardMode
from common.models import cpu_fused, moe
from common.models.config import ModelConfig
from common.models.direct_call import DirectCall
from common.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(DirectCall):
    fused = None  # the fused ops, one kernel per row: CPU fp32 (common/models/cpu_fused.py), CUDA (cuda_fused.py)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and self.fused.takes(x) and x.dtype == self.weight.dtype:
            return self.fused.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op (each op costs a few microseconds on CPU)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def linear_add(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x); a PackedLinear adds it itself (for GEMMs in the oneDNN epilogue: one op fewer)."""
    add = getattr(linear, "forward_add", None)
    return add(x, residual) if add is not None else residual + linear(x)


def row_parallel(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, tp) -> torch.Tensor:
    """linear(x) (+ residual); under tensor parallelism (common/parallel/tp_shard.py) the partial
    outputs of every rank are summed before the residual is added."""
    if tp is None:
        return linear(x) if residual is None else linear_add(linear, x, residual)
    out = tp.all_reduce(linear(x))
    return out if residual is None else residual + out


class Attention(DirectCall):
    tp = None  # a TPGroup once the layer is split across ranks

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.qkv_sizes), bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, forward_batch: ForwardBatch, backend, residual=None) -> torch.Tensor:
        """o_proj(attention(x)), plus `residual` when given."""
        t, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        fused = getattr(backend, "fused_decode_now", False) or getattr(backend, "fused_extend_now", False)
        if self.tp is None and fused and cos.shape[-1] == d:
            out = backend.fused_decode(qkv, cos, sin, self, forward_batch)  # norm, rotary, KV write, attention
            return row_parallel(self.o_proj, out, residual, self.tp)
        qk_size = self.qkv_sizes[0] + self.qkv_sizes[1]
        v = qkv[:, qk_size:].view(t, kv_heads, d)
        if hasattr(self, "q_norm"):
            q, k = (
                qkv[:, : self.qkv_sizes[0]].view(t, heads, d),
                qkv[:, self.qkv_sizes[0] : qk_size].view(t, kv_heads, d),
            )
            q, k = apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin)
        else:  # q and k heads side by side: one rotary for both
            qk = apply_rotary(qkv[:, :qk_size].view(t, heads + kv_heads, d), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        out = backend.forward(q, k, v, self.layer, forward_batch, self.scale).reshape(t, heads * d)
        return row_parallel(self.o_proj, out, residual, self.tp)


class MLP(DirectCall):
    tp = None
    fused = None  # silu(gate) * up in one op: CPU fp32 (common/models/cpu_fused.py), CUDA (cuda_fused.py)

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x, residual=None):
        """down(silu(gate) * up), plus `residual` when given."""
        gate_up = self.gate_up_proj(x)
        if self.fused is not None and self.fused.takes(gate_up):
            h = self.fused.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.silu(gate) * up
        return row_parallel(self.down_proj, h, residual, self.tp)


def attention_for(cfg: ModelConfig, layer: int) -> nn.Module:
    """Grouped-query attention, or DeepSeek's latent attention (common/models/mla.py)."""
    if cfg.mla is None:
        return Attention(cfg, layer)
    from common.models.mla import MLAttention

    return MLAttention(cfg, layer)


def mlp_for(cfg: ModelConfig, layer: int) -> nn.Module:
    """The dense MLP, or on a sparse layer of an MoE model the experts (common/models/moe.py), with
    DeepSeek's shared experts as a dense MLP of their width."""
    spec = cfg.moe
    if spec is None or layer not in spec.sparse_layers:
        return MLP(cfg)
    shared = MLP(cfg, spec.intermediate_size * spec.n_shared_experts) if spec.n_shared_experts else None
    return moe.SparseMoE(cfg.hidden_size, spec, shared)


class DecoderLayer(DirectCall):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = attention_for(cfg, layer)
        self.mlp = mlp_for(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, forward_batch, backend):
        x = self.self_attn(self.input_layernorm(x), cos, sin, forward_batch, backend, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class Backbone(nn.Module):
    """HF's `model.*` submodule: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    tp = None  # a TPGroup once split: the embedding and lm_head hold a vocabulary shard
    greedy_head = None  # CPU fp32: greedy tokens through a bf16 pass (common/models/greedy_head.py)
    compiled_layers = None  # CPU, opt-in: small decode batches through torch.compile (compiled_layers.py)
    fused_layers = None  # CPU fp32, dense: a decode step's layers as one call (cpu_step.FusedLayers); CUDA: the
    # layers with each residual add folded into the next norm (cuda_fused.FusedStack)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rope_dim, cfg.max_position_embeddings)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, forward_batch: ForwardBatch, backend, capture: tuple[int, ...] = ()):
        """Run all tokens of the batch; returns final normed hidden states [T, hidden]. With `capture`
        (layer ids), returns (normed hidden, the outputs of those layers concatenated [T, len * hidden])."""
        x, cos, sin = self._inputs(forward_batch, backend)
        if not capture:
            return self.model.norm(self._layers(x, cos, sin, forward_batch, backend))
        captured = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, forward_batch, backend)
            if i in capture:
                captured[i] = x
        return self.model.norm(x), torch.cat([captured[i] for i in capture], dim=-1)

    def forward_logits(self, forward_batch: ForwardBatch, backend, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, then its logits rows (forward_batch.logits_indices) through the lm_head: (with `greedy`
        their greedy tokens [R], else their float32 logits [R, V]; the normed hidden [T, H]). A decode step
        whose stack and lm_head the fused ops serve runs the final norm, the lm_head and the argmax in the
        layers' call (FusedLayers.logits): after a batch-1 step's weights streamed past, each of them as a call of
        its own cost 20-75 us (2-core AMD Zen 4)."""
        x, cos, sin = self._inputs(forward_batch, backend)
        fused = self.fused_layers
        if (
            fused is not None
            and forward_batch.mode is ForwardMode.DECODE  # every row gets logits
            and hasattr(fused, "logits")  # CPU's FusedLayers (CUDA's FusedStack runs the layers only)
            and fused.serves(x, cos, backend)
            and fused.takes_head(x.shape[0], greedy, self.greedy_head)  # the greedy head: in the call or not at all
        ):
            return fused.logits(x, cos, sin, forward_batch, backend, greedy)
        hidden = self.model.norm(self._layers(x, cos, sin, forward_batch, backend))
        rows = hidden[forward_batch.logits_indices]
        return (self.greedy_tokens(rows) if greedy else self.compute_logits(rows)), hidden

    def greedy_step(self, token_ids, rows, kv_lens, kv_lens_cpu: list[int], backend) -> torch.Tensor | None:
        """A greedy decode step that reads each request's pending token from `token_ids` at its row and writes
        its argmax back there, in one call (FusedLayers.greedy_step) where forward_logits would run the step
        through the fused layers and head: the tokens [R], else None."""
        fused = self.fused_layers
        if fused is None or not hasattr(fused, "greedy_step"):
            return None
        embed = self.model.embed_tokens.weight
        return fused.greedy_step(token_ids, rows, kv_lens, kv_lens_cpu, embed, self.rotary, backend, self.greedy_head)

    def _inputs(self, forward_batch: ForwardBatch, backend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's metadata given to the backend; its tokens' embeddings and rotary cos / sin."""
        backend.init_forward_metadata(forward_batch)
        x = self.model.embed_tokens(forward_batch.input_ids)
        return (x, *self.rotary.cos_sin(forward_batch.positions, x.dtype))

    def _layers(self, x, cos, sin, forward_batch: ForwardBatch, backend) -> torch.Tensor:
        compiled = self.compiled_layers
        run = compiled if compiled is not None and compiled.used_for(forward_batch) else self.run_layers
        return run(x, cos, sin, forward_batch, backend)

    def run_layers(self, x, cos, sin, forward_batch: ForwardBatch, backend) -> torch.Tensor:
        fused = self.fused_layers
        if fused is not None and fused.serves(x, cos, backend):
            return fused(x, cos, sin, forward_batch, backend)
        for layer in self.model.layers:
            x = layer(x, cos, sin, forward_batch, backend)
        return x

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """HF tensor name -> the parameter (or slice of a fused parameter) it loads into."""
        return moe.checkpoint_names(split_fused(self, self.config))

    def pack_for_cpu(self, greedy_head: bool = True) -> None:
        """After loading: every linear and the lm_head in the CPU fp32 layouts (common/models/packed_linear.py),
        and the greedy head where the host has bf16 GEMMs (unless `greedy_head` is False, or under TP)."""
        from common.models import greedy_head as gh
        from common.models.packed_linear import LinearWeight, pack_linears

        self._lm_head_cpu = LinearWeight(self.lm_head_weight)  # lm_head itself stays plain (tied: the embedding)
        pack_linears(self.model)
        if greedy_head and self.tp is None and gh.available():
            self.greedy_head = gh.GreedyHead.build(self._lm_head_cpu)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of the logits of the given rows of hidden states [R] (int64)."""
        if self.greedy_head is not None and self.greedy_head.used_for(hidden.shape[0]):
            return self.greedy_head.tokens(hidden)
        return cpu_fused.argmax(self.compute_logits(hidden))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 for the given rows of hidden states."""
        cpu = getattr(self, "_lm_head_cpu", None)
        logits = cpu(hidden) if cpu is not None else F.linear(hidden, self.lm_head_weight)
        if self.tp is not None:  # each rank's vocabulary columns, gathered; the shards' padding cut
            logits = self.tp.all_gather_last(logits)[..., : self.config.vocab_size]
        return logits.float()


def give_fused_ops(model: nn.Module, ops) -> tuple[int, list[nn.Module]]:
    """Every RMSNorm and MLP under `model` gets `ops` (a device's fused ops, or None to take them away):
    (how many did, the decoder's layers, empty for a model without `model.layers`)."""
    n = 0
    for module in model.modules():
        if isinstance(module, (RMSNorm, MLP)):
            module.fused = ops
            n += 1
    return n, list(getattr(getattr(model, "model", None), "layers", ()))


def split_fused(module: nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Parameter names of `module` in HF's layout: each fused qkv_proj / gate_up_proj parameter is
    named as its q/k/v (gate/up) parts, each a view of its rows of the fused tensor."""
    fused_parts = {
        "qkv_proj": (("q_proj", "k_proj", "v_proj"), [cfg.q_size, cfg.kv_size, cfg.kv_size]),
        "gate_up_proj": (("gate_proj", "up_proj"), None),  # two halves (MoE's shared experts: their own width)
    }
    out = {}
    for name, param in module.named_parameters():
        fused = next((f for f in fused_parts if f".{f}." in f".{name}"), None)
        if fused is None:
            out[name] = param.data
            continue
        parts, sizes = fused_parts[fused]
        sizes = sizes or [param.shape[0] // 2] * 2
        for part, view in zip(parts, param.data.split(sizes, dim=0)):
            out[name.replace(fused, part)] = view
    return out
