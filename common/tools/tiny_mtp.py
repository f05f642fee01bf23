"""Write a DeepSeek-V3 MTP (NextN) layer into a tiny checkpoint, where the published checkpoints keep it.

The layer goes at `model.layers.{num_hidden_layers}.*` (Hugging Face ignores it, the target loader
skips it): the decoder layer's tensors in the published names (MLA, the MoE's per-expert tensors and
router bias), `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and copies of the target's
`embed_tokens` and `lm_head` (`shared_head.head`), as DeepSeek ships them. Random weights from a seeded
generator, drawn as `tiny_checkpoint.randomize` draws the target's; the target's tensors are untouched.

    python -m common.tools.tiny_checkpoint --arch deepseek_v3 --mtp --out DIR
"""

from __future__ import annotations

import copy
import json
import os
import tempfile

import torch
from safetensors.torch import load_file, save_file

MTP_FILE = "model-mtp.safetensors"


def mtp_tensors(model, seed: int) -> dict[str, torch.Tensor]:
    """The MTP layer of the HF DeepSeek-V3 `model` (random, seeded), in the published names."""
    from transformers import AutoModelForCausalLM

    from common.tools.tiny_checkpoint import randomize

    cfg = copy.deepcopy(model.config)
    n, h = cfg.num_hidden_layers, cfg.hidden_size
    cfg.num_hidden_layers = n + 1
    torch.manual_seed(seed)
    wider = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)  # its layer n is an MTP-shaped layer
    layer = wider.model.layers[n]
    layer.config = cfg
    randomize(layer, seed, 1.0)
    prefix = f"model.layers.{n}."
    with tempfile.TemporaryDirectory() as tmp:  # HF writes the published per-expert names
        wider.save_pretrained(tmp)
        saved = load_file(os.path.join(tmp, "model.safetensors"))
    out = {k: v for k, v in saved.items() if k.startswith(prefix)}
    gen = torch.Generator().manual_seed(seed + 1)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        out[f"{prefix}{name}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    out[f"{prefix}eh_proj.weight"] = torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5
    out[f"{prefix}embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    out[f"{prefix}shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return {k: v.contiguous() for k, v in out.items()}


def write_mtp(out_dir: str, tensors: dict[str, torch.Tensor]) -> None:
    """Add `tensors` to the checkpoint folder: into its one safetensors file, or as a shard the index
    names; config.json says `num_nextn_predict_layers: 1`."""
    index = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        save_file(tensors, os.path.join(out_dir, MTP_FILE), metadata={"format": "pt"})
        with open(index) as f:
            data = json.load(f)
        data["weight_map"].update({k: MTP_FILE for k in tensors})
        with open(index, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
    else:
        single = os.path.join(out_dir, "model.safetensors")
        merged = {**load_file(single), **tensors}
        save_file(merged, single, metadata={"format": "pt"})
    config = os.path.join(out_dir, "config.json")
    with open(config) as f:
        data = json.load(f)
    data["num_nextn_predict_layers"] = 1
    with open(config, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
