"""EAGLE and EAGLE3 draft heads, in the public checkpoint layouts.

EAGLE (`LlamaForCausalLMEagle`): at position p the head reads the token at p+1 and a hidden state
for p (the target's final normed hidden, or the head's own previous output while drafting):
    x = fc([embed(token); hidden])                  fc: Linear(2H -> H, bias)
    y = layer(x)                                    one decoder layer, no input_layernorm
y is the head's hidden for p+1, and its logits come from the target's lm_head (shared, tied or not).

EAGLE3 (`LlamaForCausalLMEagle3`): the hidden for a target position is fc over three captured target
layers ([H, 3H], no bias; `eagle_config.eagle_aux_hidden_state_layer_ids`, else layers 1, L//2-1, L-4:
the output of each of those layers); while drafting, the head's own previous output (H) is used as
is. The one layer (`midlayer.*` or `layers.0.*`) attends over [input_layernorm(embed);
hidden_norm(hidden)] (q/k/v take 2H inputs), its residual is the hidden; `norm` then its own
`lm_head` over `draft_vocab_size` ids, mapped to target ids by `d2t` (target = draft + d2t[draft]).
The head's token embedding is the target's.

Both keep one layer of draft KV in their own KV pool, sharing slot indices with the target.

DeepSeek's MTP (NextN) layer drafts the same way as EAGLE (`--speculative-algorithm NEXTN` is an alias
of EAGLE, as in SGLang): a draft folder whose architecture is DeepSeek-V3's (the target checkpoint
itself, or an exported NextN folder) is loaded by common/models/nextn.py.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from torch import nn

from common.models.config import CheckpointError, ModelConfig
from common.models.decoder import Attention, DecoderLayer, RMSNorm, split_fused
from common.models.loader import load_tensors
from common.models.nextn import ARCHITECTURES as NEXTN_ARCHITECTURES
from common.models.nextn import load_nextn_head, nextn_layer_config

ALGORITHMS = {"EAGLE": "LlamaForCausalLMEagle", "EAGLE3": "LlamaForCausalLMEagle3"}
ALIASES = {"NEXTN": "EAGLE"}  # SGLang's name for DeepSeek's MTP layer run by the EAGLE worker


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    algorithm: str  # "EAGLE", "EAGLE3", or "NEXTN": a DeepSeek MTP layer (drafts as EAGLE does)
    layer: ModelConfig  # the head's one layer (shapes from the head's config.json)
    draft_vocab_size: int  # EAGLE: the target's vocabulary
    aux_layer_ids: tuple[int, ...] = ()  # EAGLE3: target layers whose outputs feed fc
    tensor_prefix: str = ""  # NEXTN: the layer's tensors in the folder (model.layers.{index}.)


def load_draft_config(path: str, algorithm: str, target: ModelConfig) -> DraftConfig:
    """Read the head's config.json and check it against `--speculative-algorithm` and the target."""
    algorithm = ALIASES.get(algorithm, algorithm)
    if algorithm not in ALGORITHMS:
        raise CheckpointError(f"--speculative-algorithm {algorithm!r}: supported {sorted([*ALGORITHMS, *ALIASES])}")
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise CheckpointError(f"{path}: no config.json for the draft head")
    with open(file) as f:
        hf = json.load(f)
    archs = hf.get("architectures") or []
    if algorithm == "EAGLE" and len(archs) == 1 and archs[0] in NEXTN_ARCHITECTURES:
        layer, prefix = nextn_layer_config(hf, os.path.abspath(path), target)
        return DraftConfig("NEXTN", layer, target.vocab_size, tensor_prefix=prefix)
    if archs != [ALGORITHMS[algorithm]]:
        raise CheckpointError(
            f"draft head config.json: field 'architectures' is {archs}, but "
            f"--speculative-algorithm {algorithm} needs [{ALGORITHMS[algorithm]!r}]"
            + (f" (or a DeepSeek MTP layer: {list(NEXTN_ARCHITECTURES)})" if algorithm == "EAGLE" else "")
        )
    if hf.get("hidden_size") != target.hidden_size:
        raise CheckpointError(
            f"draft head config.json: field 'hidden_size' is {hf.get('hidden_size')}, the target's "
            f"is {target.hidden_size}"
        )
    heads = hf.get("num_attention_heads", target.num_heads)
    layer = dataclasses.replace(
        target,
        path=os.path.abspath(path),
        architecture=archs[0],
        num_layers=1,
        intermediate_size=hf.get("intermediate_size", target.intermediate_size),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or target.hidden_size // heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", target.rms_norm_eps)),
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=False,
        tie_word_embeddings=False,
        moe=None,  # the head is a dense Llama layer whatever the target's MLP and attention are
        mla=None,
        cache_v_dim=None,
    )
    if algorithm == "EAGLE":
        return DraftConfig(algorithm, layer, target.vocab_size)
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    n = target.num_layers
    ids = tuple(ids) if ids else (1, n // 2 - 1, n - 4)
    if len(ids) != 3 or not all(0 <= i < n for i in ids):
        raise CheckpointError(
            f"draft head config.json: field 'eagle_config.eagle_aux_hidden_state_layer_ids' is "
            f"{list(ids)}; need 3 layer ids of the {n}-layer target"
        )
    return DraftConfig(algorithm, layer, int(hf.get("draft_vocab_size") or target.vocab_size), ids)


class Eagle3Layer(DecoderLayer):
    """EAGLE3's one layer: attention over [input_layernorm(embed); hidden_norm(hidden)] (2H wide)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, 0)
        self.self_attn = Attention(dataclasses.replace(cfg, hidden_size=2 * cfg.hidden_size), 0)
        self.self_attn.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward_pair(self, embeds, hidden, cos, sin, forward_batch, backend):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        h = hidden + self.self_attn(x, cos, sin, forward_batch, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftHead(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        h = cfg.layer.hidden_size
        if cfg.algorithm == "EAGLE":
            self.fc = nn.Linear(2 * h, h, bias=True)
            self.layer = DecoderLayer(cfg.layer, 0)
            self.layer.input_layernorm = nn.Identity()
        else:
            self.fc = nn.Linear(3 * h, h, bias=False)
            self.layer = Eagle3Layer(cfg.layer)
            self.norm = RMSNorm(h, cfg.layer.rms_norm_eps)
            self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos, sin, forward_batch, backend) -> torch.Tensor:
        """embeds [T, H] of the tokens at p+1, hidden [T, H] (or EAGLE3's [T, 3H] target capture) for p
        -> the head's hidden for p+1 [T, H]."""
        if self.config.algorithm == "EAGLE":
            return self.layer(self.fc(torch.cat([embeds, hidden], dim=-1)), cos, sin, forward_batch, backend)
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden)
        return self.layer.forward_pair(embeds, hidden, cos, sin, forward_batch, backend)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Public layout name -> tensor to load (fused projections split into views, as the target)."""
        prefix = "layers.0." if self.config.algorithm == "EAGLE" else "midlayer."
        out = {}
        for name, t in split_fused(self.layer, self.config.layer).items():
            out[prefix + name] = t
        out.update({f"fc.{k}": v.data for k, v in self.fc.named_parameters()})
        if self.config.algorithm == "EAGLE3":
            out.update(
                {"norm.weight": self.norm.weight.data, "lm_head.weight": self.lm_head.weight.data, "d2t": self.d2t}
            )
        return out


def load_draft_head(path: str, cfg: DraftConfig, device, dtype) -> nn.Module:
    """Build the head (a DraftHead, or a NextNHead for NEXTN) and load its tensors; names the missing,
    unexpected or mis-shaped tensor."""
    if cfg.algorithm == "NEXTN":
        return load_nextn_head(path, cfg.layer, cfg.tensor_prefix, device, dtype)
    with torch.device("meta"):
        head = DraftHead(cfg)
    head = head.to(dtype).to_empty(device=device)
    if cfg.algorithm == "EAGLE3":
        head.d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64, device=device)
    aliases = {"layers.0.": "midlayer."} if cfg.algorithm == "EAGLE3" else {}

    def skip(key: str) -> bool:
        # the head embeds with the target's table; t2d is derivable from d2t; EAGLE uses the target's lm_head
        return key in ("embed_tokens.weight", "t2d") or (key == "lm_head.weight" and cfg.algorithm == "EAGLE")

    def rename(name: str) -> str:
        return next((name.replace(a, b, 1) for a, b in aliases.items() if name.startswith(a)), name)

    load_tensors(path, head.checkpoint_tensors(), cfg.algorithm, label="draft head ", skip=skip, rename=rename)
    return head.eval().requires_grad_(False)
