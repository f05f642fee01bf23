"""Random-weight EAGLE / EAGLE3 draft heads for a target checkpoint, in the public layouts (tests).

    python -m common.tools.eagle_checkpoint --target DIR --algorithm EAGLE|EAGLE3 --out DIR

Deterministic (seeded); the head's shapes follow the target's. EAGLE3 gets a draft vocabulary of
half the target's ids (a fixed random subset) mapped back by `d2t`. Random heads rarely propose the
target's token, so they test exactness, not speed; `python -m bench.fit_eagle` fits real ones.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

from common.models.config import load_model_config
from common.models.eagle import ALGORITHMS, DraftHead, load_draft_config


def head_config(target, algorithm: str, draft_vocab_size: int | None = None) -> dict:
    cfg = {
        "architectures": [ALGORITHMS[algorithm]],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps,
        "num_hidden_layers": 1,
        "vocab_size": target.vocab_size,
        "max_position_embeddings": target.max_position_embeddings,
        "rope_theta": target.rope["rope_theta"],
        "torch_dtype": "float32",
    }
    if algorithm == "EAGLE3":
        n = target.num_layers
        cfg["draft_vocab_size"] = draft_vocab_size or max(2, target.vocab_size // 2)
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [min(1, n - 1), max(n // 2 - 1, 0), max(n - 4, 0)]}
    return cfg


def save_head(head: DraftHead, config: dict, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {k: v.detach().contiguous().clone().cpu() for k, v in head.checkpoint_tensors().items()}
    save_file(tensors, os.path.join(out, "model.safetensors"))
    return out


def build(target_path: str, algorithm: str, out: str, seed: int = 0, std: float = 0.05) -> str:
    target = load_model_config(target_path)
    config = head_config(target, algorithm)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    torch.manual_seed(seed)
    head = DraftHead(load_draft_config(out, algorithm, target))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
        if algorithm == "EAGLE3":
            keep = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(seed))
            keep = keep[: config["draft_vocab_size"]].sort().values
            head.d2t.copy_(keep - torch.arange(keep.numel()))
    return save_head(head, config, out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m common.tools.eagle_checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--algorithm", required=True, choices=sorted(ALGORITHMS))
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(build(args.target, args.algorithm, args.out, args.seed))


if __name__ == "__main__":
    main()
