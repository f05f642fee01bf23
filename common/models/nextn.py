"""DeepSeek's multi-token-prediction (MTP / NextN) layer, served as an EAGLE-style draft.

DeepSeek-V3 checkpoints carry it after the last decoder layer, at `model.layers.{num_hidden_layers}.*`
(`num_nextn_predict_layers` = 1; Hugging Face ignores it); SGLang's export script writes it alone into
a draft folder (`architectures: ["DeepseekV3ForCausalLMNextN"]`, `num_hidden_layers` 1, the layer at
`model.layers.0.*`, no `embed_tokens` or `shared_head.head`). Either folder serves here. At position p
the layer reads the token at p+1 and a hidden state for p (the target's final normed hidden, or its
own previous output while drafting):
    x = eh_proj([enorm(embed(token)); hnorm(hidden)])     eh_proj: Linear(2H -> H, no bias)
    y = shared_head.norm(layer(x))                        one full decoder layer: MLA + MoE for V3
y is the draft's hidden for p+1; its logits are lm_head(y). The token embedding and the lm_head are the
target's (the checkpoint's `embed_tokens` / `shared_head.head` copies are the same tensors, and the
export script drops them), so a token map narrows the lm_head as for EAGLE.
The layer keeps one layer of KV in the draft pool (for MLA: the latent, as the target's pool).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from common.models import moe
from common.models.config import CheckpointError, ModelConfig
from common.models.decoder import DecoderLayer, RMSNorm, split_fused
from common.models.loader import load_tensors

TARGET_ARCH = "DeepseekV3ForCausalLM"  # the target checkpoint itself: the layer at model.layers.{L}
EXPORTED_ARCH = "DeepseekV3ForCausalLMNextN"  # SGLang's exported draft folder: the layer at model.layers.0
ARCHITECTURES = (TARGET_ARCH, EXPORTED_ARCH)
# the checkpoint's copies of the target's tensors: read from the target instead
SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def nextn_layer_config(hf: dict, path: str, target: ModelConfig) -> tuple[ModelConfig, str]:
    """(the draft layer's ModelConfig, the checkpoint prefix of its tensors) from the draft folder's
    config.json `hf`, checked against the target (a DeepSeek-V3 of the same shapes)."""
    arch = (hf.get("architectures") or [None])[0]
    if target.architecture != TARGET_ARCH or target.mla is None:
        raise CheckpointError(f"draft {arch}: a NextN (MTP) layer drafts for a {TARGET_ARCH} target only")
    for name, ours in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if hf.get(name) != ours:
            raise CheckpointError(f"draft config.json: field '{name}' is {hf.get(name)}, the target's is {ours}")
    if arch == TARGET_ARCH:
        if (hf.get("num_nextn_predict_layers") or 0) < 1:
            raise CheckpointError(
                f"{path}/config.json: field 'num_nextn_predict_layers' is {hf.get('num_nextn_predict_layers')}; "
                "this checkpoint has no MTP layer to draft with"
            )
        index = hf.get("num_hidden_layers")
    else:
        index = 0
    spec = target.moe
    # DeepSeek's MTP layer sits past every layer, so it is sparse whenever the target has sparse layers
    sparse = spec is not None and len(spec.sparse_layers) > 0
    layer = dataclasses.replace(
        target,
        path=path,
        architecture=arch,
        num_layers=1,
        tie_word_embeddings=False,
        moe=dataclasses.replace(spec, sparse_layers=(0,) if sparse else ()) if spec is not None else None,
    )
    return layer, f"model.layers.{index}."


class NextNHead(nn.Module):
    """enorm, hnorm, eh_proj, one decoder layer, shared_head.norm (HF / SGLang parameter names)."""

    def __init__(self, layer_cfg: ModelConfig):
        super().__init__()
        h, eps = layer_cfg.hidden_size, layer_cfg.rms_norm_eps
        self.layer_cfg = layer_cfg
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(layer_cfg, 0)  # index 0: the draft pool's one layer
        self.shared_head_norm = RMSNorm(h, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos, sin, forward_batch, backend) -> torch.Tensor:
        """embeds [T, H] of the tokens at p+1, hidden [T, H] for p -> the draft's (normed) hidden for p+1."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.shared_head_norm(self.layer(x, cos, sin, forward_batch, backend))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint name (the layer's prefix removed) -> tensor to load (experts and fused projections
        as views, as the target's)."""
        out = moe.checkpoint_names(split_fused(self.layer, self.layer_cfg))
        out.update(
            {
                "enorm.weight": self.enorm.weight.data,
                "hnorm.weight": self.hnorm.weight.data,
                "eh_proj.weight": self.eh_proj.weight.data,
                "shared_head.norm.weight": self.shared_head_norm.weight.data,
            }
        )
        return out


def load_nextn_head(path: str, layer_cfg: ModelConfig, prefix: str, device, dtype) -> NextNHead:
    """Build the layer and load `prefix`* tensors of the folder (every other tensor is the target's)."""
    with torch.device("meta"):
        head = NextNHead(layer_cfg)
    head = head.to(dtype).to_empty(device=device)

    def rename(name: str) -> str:
        return name[len(prefix) :] if name.startswith(prefix) else "\0" + name

    def skip(key: str) -> bool:
        return key.startswith("\0") or key in SHARED

    load_tensors(path, head.checkpoint_tensors(), EXPORTED_ARCH, label="NextN draft ", skip=skip, rename=rename)
    return head.eval().requires_grad_(False)
