"""Config parsing and the loader's failure messages on malformed checkpoints."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.models.config import CheckpointError, load_model_config
from common.models.loader import load_model
from common.models.rope import inv_frequencies


def _copy(checkpoint, name, tmp_path) -> str:
    dst = str(tmp_path / name)
    shutil.copytree(checkpoint(name), dst)
    return dst


def _edit_config(path, **changes):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def _edit_tensors(path, fn):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_switches_per_architecture(checkpoint):
    llama, qwen2, qwen3 = (load_model_config(checkpoint(n)) for n in ("llama", "qwen2", "qwen3"))
    assert (llama.qkv_bias, llama.o_bias, llama.qk_norm) == (True, True, False)
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm) == (False, False, True)
    assert qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_heads
    assert llama.rope["rope_type"] == "llama3" and llama.num_kv_heads < llama.num_heads
    assert load_model_config(checkpoint("qwen2-tied")).tie_word_embeddings
    assert len(llama.eos_token_ids) == 2 and llama.bos_token_id is not None  # config + generation_config


def test_old_style_top_level_rope_fields_are_mapped(checkpoint, tmp_path):
    path = _copy(checkpoint, "llama", tmp_path)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    _edit_config(path, rope_parameters=None, rope_theta=500000.0, rope_scaling=scaling)
    cfg = load_model_config(path)
    assert cfg.rope["rope_theta"] == 500000.0 and cfg.rope["factor"] == 8.0


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ],
)
def test_rope_frequencies_match_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=dict(rope), max_position_embeddings=4096)
    if rope["rope_type"] == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)[0]
    else:
        ref = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")[0]
    assert torch.equal(inv_frequencies(rope, 64), ref)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 512},
    ],
    ids=["default", "yarn"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_sin_from_the_cpu_table_are_the_computed_ones(rope, dtype):
    """On CPU cos / sin come from a table of positions, grown past the highest seen: the same bits as
    computing them for the batch's positions (each element the same float32 ops), in any order, and a
    negative position refused."""
    from common.models.rope import RotaryEmbedding

    rotary = RotaryEmbedding(rope, 64, max_positions=2048)
    for positions in (
        torch.tensor([7, 0, 4095]),
        torch.tensor([9000, 3, 5]),
        torch.arange(300),
        torch.tensor([], dtype=torch.long),
    ):
        cos, sin = rotary.cos_sin(positions, dtype)
        want_cos, want_sin = rotary._compute(positions, dtype)
        assert cos.shape == (len(positions), 1, 64) and cos.dtype == dtype
        assert torch.equal(cos[:, 0], want_cos) and torch.equal(sin[:, 0], want_sin)
    assert rotary._tables[dtype][0].shape[0] >= 9001  # grown for 9000
    with pytest.raises(ValueError, match="negative"):
        rotary.cos_sin(torch.tensor([-1]), dtype)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(architectures=["MistralForCausalLM"]), "architectures"),
        (dict(intermediate_size=0), "intermediate_size"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(hidden_size=None), r"lm_head\.weight' has shape \(384, 64\), expected \(384, 4096\)"),  # HF default
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "rope_type"),
    ],
)
def test_bad_config_fields_are_named(checkpoint, tmp_path, change, message):
    path = _copy(checkpoint, "llama", tmp_path)
    _edit_config(path, **change)
    with pytest.raises(CheckpointError, match=message):
        load_model(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
            r"missing tensor.*layers\.1\.self_attn\.k_proj\.weight",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}),
            r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(3, 3\), expected \(128, 64\)",
        ),
        (
            lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}),
            r"unexpected tensor 'model\.layers\.0\.extra\.weight'",
        ),
        (lambda t: t.pop("lm_head.weight"), r"missing tensor.*lm_head\.weight"),
    ],
)
def test_bad_tensors_are_named(checkpoint, tmp_path, edit, message):
    path = _copy(checkpoint, "llama", tmp_path)
    _edit_tensors(path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(path)


def test_sharded_checkpoint_with_a_missing_shard(checkpoint, tmp_path):
    path = _copy(checkpoint, "qwen3-sharded", tmp_path)
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(shards) >= 2 and os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    load_model(path)  # intact: loads
    os.remove(os.path.join(path, shards[-1]))
    with pytest.raises(CheckpointError, match=shards[-1]):
        load_model(path)


def test_no_weights_or_no_config(tmp_path, checkpoint):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(str(tmp_path))
    path = _copy(checkpoint, "qwen2", tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(path)


def test_tied_checkpoint_has_no_lm_head_and_shares_the_embedding(checkpoint):
    path = checkpoint("qwen2-tied")
    assert "lm_head.weight" not in load_file(os.path.join(path, "model.safetensors"))
    model = load_model(path)
    assert model.lm_head_weight is model.model.embed_tokens.weight
