"""Mixture of experts (common/models/moe.py) against HF's own modules: which layers are sparse, the
routers (softmax top-k; sigmoid with the correction bias and group-limited top-k), the expert kernel
against HF's eager experts, and the loader's handling of the published per-expert layout."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.models.config import CheckpointError, load_model_config
from common.models.loader import load_model
from common.models.moe import MoeSpec, Router, moe_spec, run_experts


def _qwen3_moe(**kw):
    from transformers import Qwen3MoeConfig

    base = dict(hidden_size=32, num_hidden_layers=6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    return Qwen3MoeConfig(**{**base, **kw})


def _deepseek(**kw):
    from transformers import DeepseekV3Config

    base = dict(hidden_size=32, num_hidden_layers=4, n_routed_experts=16, n_group=4, topk_group=2)
    return DeepseekV3Config(**{**base, "num_experts_per_tok": 4, "moe_intermediate_size": 16, **kw})


def test_sparse_layers_follow_step_mlp_only_layers_and_first_k_dense():
    spec = moe_spec("Qwen3MoeForCausalLM", _qwen3_moe(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert spec.sparse_layers == (1, 5) and spec.scoring == "softmax"
    spec = moe_spec("DeepseekV3ForCausalLM", _deepseek(first_k_dense_replace=2))
    assert spec.sparse_layers == (2, 3) and spec.scoring == "sigmoid" and (spec.n_group, spec.topk_group) == (4, 2)


def test_bad_expert_fields_are_named():
    with pytest.raises(ValueError, match="n_group"):
        moe_spec("DeepseekV3ForCausalLM", _deepseek(n_group=3))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        moe_spec("Qwen3MoeForCausalLM", _qwen3_moe(num_experts_per_tok=9))


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (ids, weights) in expert order (top-k order is not part of the result)."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_matches_qwen3_moe(norm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hf_cfg = _qwen3_moe(norm_topk_prob=norm)
    ref = Qwen3MoeTopKRouter(hf_cfg)
    ours = Router(32, moe_spec("Qwen3MoeForCausalLM", hf_cfg))
    with torch.no_grad():
        ref.weight.normal_()
        ours.weight.copy_(ref.weight)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    _, ref_w, ref_ids = ref(x)
    ids, w = _by_expert(*ours(x))
    ref_ids, ref_w = _by_expert(ref_w, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w)
    assert not norm or torch.allclose(w.sum(-1), torch.ones(64))


@pytest.mark.parametrize("norm", [True, False])
def test_grouped_sigmoid_router_matches_deepseek_v3(norm):
    """The bias moves the choice but not the weights; only the topk_group best groups may be chosen."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_cfg = _deepseek(norm_topk_prob=norm, routed_scaling_factor=2.5)
    ref = DeepseekV3TopkRouter(hf_cfg)
    spec = moe_spec("DeepseekV3ForCausalLM", hf_cfg)
    ours = Router(32, spec)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, 32, generator=g))
        ref.e_score_correction_bias.copy_(0.5 * torch.randn(16, generator=g))
        ours.weight.copy_(ref.weight)
        ours.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    x = torch.randn(64, 32, generator=g)
    _, ref_w, ref_ids = ref(x)
    ids, w = _by_expert(*ours(x))
    ref_ids, ref_w = _by_expert(ref_w, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w)
    assert len(set((ids // 4).flatten().tolist())) > 2  # rows choose different groups
    assert all(len(set(row)) <= 2 for row in (ids // 4).tolist())  # each row within its 2 groups
    no_bias = Router(32, spec)
    with torch.no_grad():
        no_bias.weight.copy_(ref.weight)
    assert not torch.equal(_by_expert(*no_bias(x))[0], ids), "the bias should change some choices"


def test_expert_kernel_matches_hf_eager_experts():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    hf_cfg = _qwen3_moe()
    hf_cfg._experts_implementation = "eager"
    ref = Qwen3MoeExperts(hf_cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        ref.gate_up_proj.copy_(torch.randn(ref.gate_up_proj.shape, generator=g) / 32**0.5)
        ref.down_proj.copy_(torch.randn(ref.down_proj.shape, generator=g) / 16**0.5)
    x = torch.randn(40, 32, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(40)])
    ids[:5] = torch.tensor([3, 5])  # some experts get many tokens, some none
    weights = torch.rand(40, 2, generator=g)
    out = run_experts(x, ids, weights, ref.gate_up_proj, ref.down_proj)
    torch.testing.assert_close(out, ref(x, ids, weights), atol=1e-6, rtol=1e-5)


def test_published_per_expert_tensors_load_into_the_stacks(checkpoint):
    path = checkpoint("qwen3-moe")
    model = load_model(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    layer = model.model.layers[0].mlp
    assert isinstance(layer.gate, Router) and isinstance(load_model_config(path).moe, MoeSpec)
    for e in (0, 7):
        prefix = f"model.layers.0.mlp.experts.{e}."
        gate, up = layer.experts_gate_up[e].chunk(2)
        assert torch.equal(gate, tensors[prefix + "gate_proj.weight"])
        assert torch.equal(up, tensors[prefix + "up_proj.weight"])
        assert torch.equal(layer.experts_down[e], tensors[prefix + "down_proj.weight"])
    assert not hasattr(model.model.layers[1].mlp, "gate")  # mlp_only_layers=[1]: a dense MLP


def test_a_missing_expert_is_named_and_deepseek_mtp_layer_is_skipped(checkpoint, tmp_path):
    moe = str(tmp_path / "moe")
    shutil.copytree(checkpoint("qwen3-moe"), moe)
    file = os.path.join(moe, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.5\.up_proj"):
        load_model(moe)

    ds = str(tmp_path / "ds")
    shutil.copytree(checkpoint("deepseek-v3"), ds)
    file = os.path.join(ds, "model.safetensors")
    tensors = load_file(file)
    layers = load_model_config(ds).num_layers
    tensors[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(4, 4)  # an MTP layer, as published
    save_file(tensors, file, metadata={"format": "pt"})
    load_model(ds)
    tensors[f"model.layers.{layers + 1}.eh_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        load_model(ds)
