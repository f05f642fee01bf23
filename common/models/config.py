"""ModelConfig: the facts about a Hugging Face checkpoint folder that our engine needs.

Read through transformers' AutoConfig (so old checkpoints' top-level rope_theta / rope_scaling
are mapped into `rope_parameters`), then flattened into one frozen dataclass with the switches
that distinguish Llama, Qwen2 and Qwen3.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


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
    if getattr(hf, "use_sliding_window", False):
        raise CheckpointError("config.json: field 'use_sliding_window' is true; sliding window is not supported")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: field 'hidden_act' is {hf.hidden_act!r}; only 'silu' is supported")

    hidden = _require(hf, "hidden_size")
    heads = _require(hf, "num_attention_heads")
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise CheckpointError(
            f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim = getattr(hf, "head_dim", None) or hidden // heads

    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope.setdefault("rope_type", "default")
    if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"config.json: rope_parameters.rope_type={rope['rope_type']!r}; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if "rope_theta" not in rope:
        raise CheckpointError("config.json: missing required field 'rope_parameters.rope_theta'")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("config.json: field 'partial_rotary_factor' != 1 is not supported")

    if arch == "LlamaForCausalLM":
        qkv_bias = o_bias = bool(getattr(hf, "attention_bias", False))
    elif arch == "Qwen2ForCausalLM":
        qkv_bias, o_bias = True, False
    else:  # Qwen3
        qkv_bias = o_bias = bool(getattr(hf, "attention_bias", False))

    dtype = getattr(hf, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)

    return ModelConfig(
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
        qk_norm=arch == "Qwen3ForCausalLM",
        rope=rope,
        checkpoint_dtype=dtype,
        eos_token_ids=tuple(dict.fromkeys(_eos_ids(hf.eos_token_id) + _generation_eos_ids(path))),
        bos_token_id=getattr(hf, "bos_token_id", None),
    )
