"""A reference for DeepSeek's MTP (NextN) draft, outside the engine: what its draft extend over a prompt
must give, from Hugging Face's own pieces.

The NextN-specific part is written here in plain torch, from the checkpoint's tensors:
    x = eh_proj([rms(embed(token p+1), enorm); rms(target final normed hidden p, hnorm)])
The decoder layer (MLA, DeepSeek's sigmoid-routed MoE with a shared expert) is Hugging Face's
DeepseekV3 layer, not ours: the MTP layer's tensors are loaded into a one-layer
DeepseekV3ForCausalLM (layer 0 sparse, `model.norm` = shared_head.norm, `lm_head` = shared_head.head,
HF's eager experts), run over x with `inputs_embeds`. Its cache holds the latent the draft pool must
hold (keys: the normed c_kv; values: the rotated k_pe). The target's features come from HF's target.
"""

from __future__ import annotations

import json
import os
import tempfile
from functools import lru_cache

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.nn import functional as F

from tests.oracle import hf_model

NEXTN_ONLY = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight")


def mtp_tensors(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The MTP layer's tensors (prefix removed) of a DeepSeek-V3 folder, and its config.json."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    prefix = f"model.layers.{cfg['num_hidden_layers']}."
    out = {}
    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, file), framework="pt") as f:
            out.update({k[len(prefix) :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
    return out, cfg


@lru_cache(maxsize=2)
def hf_mtp(path: str):
    """(a one-layer HF DeepseekV3ForCausalLM holding the MTP layer, the NextN-only tensors)."""
    from transformers import AutoModelForCausalLM

    tensors, cfg = mtp_tensors(path)
    layer = {f"model.layers.0.{k}": v for k, v in tensors.items() if k not in NEXTN_ONLY and k != "embed_tokens.weight"}
    layer.update(
        {
            "model.embed_tokens.weight": tensors["embed_tokens.weight"],
            "model.norm.weight": tensors["shared_head.norm.weight"],
            "lm_head.weight": tensors["shared_head.head.weight"],
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        json.dump({**cfg, "num_hidden_layers": 1, "first_k_dense_replace": 0}, open(f"{tmp}/config.json", "w"))
        save_file(layer, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, experts_implementation="eager")
    return model.eval(), {k: tensors[k] for k in NEXTN_ONLY}


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.inference_mode()
def reference(path: str, ids: list[int], tail: torch.Tensor | None = None):
    """(latent [T, R + rope], draft hidden [T, H], logits [T, V]) of the draft extend over `ids` (the
    prompt, then the first sampled token): position p reads ids[p+1] and the target's hidden at p, or
    for the last k positions the rows of `tail` [k, H] (a draft step reading the draft's own output)."""
    target = hf_model(path)
    captured = {}
    hook = target.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("final", o[0]))
    try:
        target(torch.tensor([ids[:-1]]))
    finally:
        hook.remove()
    mtp, w = hf_mtp(path)
    eps = target.config.rms_norm_eps
    embed = target.model.embed_tokens.weight[torch.tensor(ids[1:])]
    features = captured["final"].clone()
    if tail is not None:
        features[len(features) - len(tail) :] = tail
    x = torch.cat([_rms(embed, w["enorm.weight"], eps), _rms(features, w["hnorm.weight"], eps)], dim=-1)
    x = F.linear(x, w["eh_proj.weight"])
    out = {}
    hook = mtp.model.norm.register_forward_hook(lambda m, i, o: out.__setitem__("hidden", o[0]))
    try:
        res = mtp(inputs_embeds=x[None], use_cache=True)
    finally:
        hook.remove()
    cache = res.past_key_values.layers[0]
    latent = torch.cat([cache.keys.reshape(len(x), -1), cache.values.reshape(len(x), -1)], dim=-1)
    return latent, out["hidden"], res.logits[0].float()


def export_nextn(path: str, out: str) -> str:
    """SGLang's export layout, written here: config.json with architectures DeepseekV3ForCausalLMNextN
    and num_hidden_layers 1, the layer at model.layers.0.*, without embed_tokens and shared_head.head."""
    tensors, cfg = mtp_tensors(path)
    os.makedirs(out, exist_ok=True)
    keep = {
        f"model.layers.0.{k}": v
        for k, v in tensors.items()
        if k not in ("embed_tokens.weight", "shared_head.head.weight")
    }
    save_file(keep, os.path.join(out, "nextn_layer_parameters.safetensors"), metadata={"format": "pt"})
    index = {"weight_map": {k: "nextn_layer_parameters.safetensors" for k in keep}}
    json.dump(index, open(os.path.join(out, "model.safetensors.index.json"), "w"))
    json.dump(
        {**cfg, "num_hidden_layers": 1, "architectures": ["DeepseekV3ForCausalLMNextN"]},
        open(f"{out}/config.json", "w"),
    )
    return out
