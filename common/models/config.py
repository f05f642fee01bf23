"""ModelConfig: the facts about a Hugging Face checkpoint folder that our engine needs.

Read through transformers' AutoConfig (so old checkpoints' top-level rope_theta / rope_scaling
are mapped into `rope_parameters`), then flattened into one frozen dataclass with the switches
that distinguish Llama, Qwen2 and Qwen3. Two more families add a part of their own: Qwen3-MoE
and DeepSeek-V3 a mixture of experts (`moe`, common/models/moe.py), DeepSeek-V3 multi-head latent
attention (`mla`, common/models/mla.py), whose KV cache is one latent "head" per token and layer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LATENT_ROPE_TYPES = SUPPORTED_ROPE_TYPES + ("yarn",)  # DeepSeek-V3: YaRN is tested there only


class CheckpointError(ValueError):
    """A checkpoint folder that we cannot serve: unknown architecture, bad field, bad tensor."""


@dataclass(frozen=True)
class ModelConfig:
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict = field(default_factory=dict)  # rope_type, rope_theta and the type's own keys
    checkpoint_dtype: torch.dtype = torch.float32
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    moe: object | None = None  # a moe.MoeSpec: which layers route to experts, and how
    mla: object | None = None  # an mla.MlaSpec; then num_kv_heads = 1 and head_dim is the latent's width
    cache_v_dim: int | None = None  # the KV pool's V width when it is not head_dim (MLA: 0, no V of its own)

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        """The width of one V head in the KV pool (MLA keeps none: its value is part of the latent)."""
        return self.head_dim if self.cache_v_dim is None else self.cache_v_dim

    @property
    def rope_dim(self) -> int:
        """The rotated width per head: head_dim, or MLA's qk_rope_head_dim."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _generation_eos_ids(path: str) -> tuple[int, ...]:
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.exists(gen_path):
        return ()
    with open(gen_path) as f:
        return _eos_ids(json.load(f).get("eos_token_id"))


def _require(hf, name: str):
    value = getattr(hf, name, None)
    if value is None:
        raise CheckpointError(f"config.json: missing required field '{name}'")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
        raise CheckpointError(f"config.json: field '{name}' must be positive, got {value}")
    return value


def load_model_config(path: str) -> ModelConfig:
    """Read `path/config.json` (and generation_config.json for extra EOS ids)."""
    from transformers import AutoConfig

    path = os.path.abspath(path)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path}: no config.json (is this a Hugging Face checkpoint folder?)")
    try:
        hf = AutoConfig.from_pretrained(path)
    except Exception as e:  # unknown model_type, malformed json, ...
        raise CheckpointError(f"{path}/config.json: cannot be read by transformers: {e}") from e

    archs = getattr(hf, "architectures", None) or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"config.json: field 'architectures' is {archs}; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    arch = archs[0]
    from common.models.fp8 import fp8_spec

    fp8_spec(getattr(hf, "quantization_config", None))  # fp8 blocks only: refuse other methods early
    if getattr(hf, "use_sliding_window", False):
        raise CheckpointError("config.json: field 'use_sliding_window' is true; sliding window is not supported")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: field 'hidden_act' is {hf.hidden_act!r}; only 'silu' is supported")

    hidden = _require(hf, "hidden_size")
    heads = _require(hf, "num_attention_heads")
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    family = _family_fields(arch, hf)
    if heads % kv_heads and "mla" not in family:
        raise CheckpointError(
            f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim = getattr(hf, "head_dim", None) or hidden // heads

    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope.setdefault("rope_type", "default")
    rope_types = LATENT_ROPE_TYPES if "mla" in family else SUPPORTED_ROPE_TYPES
    if rope["rope_type"] not in rope_types:
        raise CheckpointError(
            f"config.json: rope_parameters.rope_type={rope['rope_type']!r}; supported here: {list(rope_types)}"
        )
    if rope["rope_type"] == "yarn" and "original_max_position_embeddings" not in rope:
        raise CheckpointError("config.json: yarn needs 'rope_parameters.original_max_position_embeddings'")
    if "rope_theta" not in rope:
        raise CheckpointError("config.json: missing required field 'rope_parameters.rope_theta'")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("config.json: field 'partial_rotary_factor' != 1 is not supported")

    if arch == "Qwen2ForCausalLM":
        qkv_bias, o_bias = True, False
    else:  # Llama, Qwen3, Qwen3-MoE; DeepSeek-V3's bias switch (q_a, kv_a, o_proj) too
        qkv_bias = o_bias = bool(getattr(hf, "attention_bias", False))

    dtype = getattr(hf, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)

    fields = dict(
        path=path,
        architecture=arch,
        vocab_size=_require(hf, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_require(hf, "intermediate_size"),
        num_layers=_require(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
        max_position_embeddings=_require(hf, "max_position_embeddings"),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        rope=rope,
        checkpoint_dtype=dtype,
        eos_token_ids=tuple(dict.fromkeys(_eos_ids(hf.eos_token_id) + _generation_eos_ids(path))),
        bos_token_id=getattr(hf, "bos_token_id", None),
    )
    return ModelConfig(**{**fields, **family})


def _family_fields(arch: str, hf) -> dict:
    """The mixture-of-experts and latent-attention parts (and the latent KV head) of a config."""
    from common.models.mla import mla_spec
    from common.models.moe import moe_spec

    try:
        fields = {"moe": moe_spec(arch, hf)} if arch in ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM") else {}
        if arch == "DeepseekV3ForCausalLM":
            mla = mla_spec(hf)
            latent = mla.kv_lora_rank + mla.qk_rope_head_dim
            fields.update(mla=mla, num_kv_heads=1, head_dim=latent, cache_v_dim=0)
    except (AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"config.json: {e}") from e
    return fields
