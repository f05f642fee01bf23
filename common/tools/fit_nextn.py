"""Fit a DeepSeek-V3 checkpoint's MTP (NextN) layer to its own target, in place (tiny test checkpoints).

A random MTP layer accepts nothing, so speculation is only proven exact; fitted, it accepts runs and
the accept length of the serving path can be asserted. Data: the target's greedy answers to generated
instructions (common/tools/eagle_data.py, the held-out split excluded) and its final normed hidden at
each position, from the engine. Model: the MTP layer as Hugging Face's own one-layer DeepseekV3 (its
decoder layer, `model.norm` = shared_head.norm, the target's lm_head frozen) behind enorm / hnorm /
eh_proj, trained with cross-entropy on the token two ahead (draft step 1), and on the step after
from its own output (step 2, the hidden as it reads it while drafting). A fixed step count and seed:
the same checkpoint gives the same layer. The fitted tensors replace the MTP layer's in the folder.

    python -m common.tools.fit_nextn --target DIR [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from common.tools.tiny_mtp import write_mtp

NEXTN_ONLY = ("enorm.weight", "hnorm.weight", "eh_proj.weight")


def _layer_model(tensors: dict[str, torch.Tensor], cfg: dict):
    """HF's one-layer DeepseekV3ForCausalLM holding the MTP decoder layer and shared head."""
    from transformers import AutoModelForCausalLM

    skip = NEXTN_ONLY + ("shared_head.norm.weight", "shared_head.head.weight", "embed_tokens.weight")
    layer = {f"model.layers.0.{k}": v for k, v in tensors.items() if k not in skip}
    layer["model.embed_tokens.weight"] = tensors["embed_tokens.weight"]
    layer["model.norm.weight"] = tensors["shared_head.norm.weight"]
    layer["lm_head.weight"] = tensors["shared_head.head.weight"]
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/config.json", "w") as f:
            json.dump({**cfg, "num_hidden_layers": 1, "first_k_dense_replace": 0}, f)
        save_file(layer, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, experts_implementation="eager")


def _data(target: str, prompts: int, answer_tokens: int, seed: int):
    from common.engine.model_runner import ModelRunner, RunnerArgs
    from common.tools import eagle_data
    from common.tools.tokenizer import load_tokenizer

    runner = ModelRunner(RunnerArgs(target, max_total_tokens=32 * (answer_tokens + 256), max_running_requests=32))
    tok = load_tokenizer(target)
    ids = [eagle_data.chat_ids(tok, t) for t in eagle_data.instructions(prompts, seed)]
    seqs, feats = eagle_data.answers(runner, ids, answer_tokens)
    return seqs, feats


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def fit(target: str, steps: int = 300, prompts: int = 64, answer_tokens: int = 48, seed: int = 0, lr: float = 3e-3):
    """Fit the MTP layer of the DeepSeek-V3 folder `target` and write it back; returns the last losses."""
    torch.manual_seed(seed)
    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    n, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    prefix = f"model.layers.{n}."
    files = [f for f in sorted(os.listdir(target)) if f.endswith(".safetensors")]
    tensors = {}
    for file in files:
        tensors.update(
            {k[len(prefix) :]: v for k, v in load_file(os.path.join(target, file)).items() if k.startswith(prefix)}
        )
    seqs, feats = _data(target, prompts, answer_tokens, seed)
    model = _layer_model(tensors, cfg).train()
    model.lm_head.requires_grad_(False)
    model.model.embed_tokens.requires_grad_(False)
    embed = tensors["embed_tokens.weight"]
    head = nn.ParameterDict({k.split(".")[0]: nn.Parameter(tensors[k].clone()) for k in NEXTN_ONLY})
    params = [p for p in model.parameters() if p.requires_grad] + list(head.values())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    batch, losses = 8, []

    def mtp(tokens_embed, hidden, mask):
        x = F.linear(
            torch.cat([_rms(tokens_embed, head["enorm"], eps), _rms(hidden, head["hnorm"], eps)], -1), head["eh_proj"]
        )
        out = model.model(inputs_embeds=x, attention_mask=mask)
        return out.last_hidden_state  # after model.norm: shared_head.norm

    for step in range(steps):
        pick = torch.randperm(len(seqs), generator=gen)[:batch].tolist()
        length = max(len(seqs[i]) for i in pick) - 1  # positions p with token p+1
        toks = torch.zeros(len(pick), length + 1, dtype=torch.int64)
        hid = torch.zeros(len(pick), length, embed.shape[1])
        mask = torch.zeros(len(pick), length, dtype=torch.int64)
        for row, i in enumerate(pick):
            toks[row, : len(seqs[i])] = torch.tensor(seqs[i])
            hid[row, : len(feats[i])] = feats[i]
            mask[row, : len(seqs[i]) - 1] = 1
        y1 = mtp(embed[toks[:, 1:]], hid, mask)  # at p: reads token p+1, predicts token p+2
        labels = toks[:, 2:].masked_fill(mask[:, 1:] == 0, -100)
        loss1 = F.cross_entropy(model.lm_head(y1[:, :-1]).flatten(0, 1), labels.flatten(), ignore_index=-100)
        y2 = mtp(embed[toks[:, 2:]], y1[:, :-1], mask[:, 1:])  # step 2: its own output, token p+2 -> p+3
        labels2 = toks[:, 3:].masked_fill(mask[:, 2:] == 0, -100)
        loss2 = F.cross_entropy(model.lm_head(y2[:, :-1]).flatten(0, 1), labels2.flatten(), ignore_index=-100)
        loss = loss1 + 0.8 * loss2
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * step / steps)).item())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append((loss1.item(), loss2.item()))
        if step % 50 == 0 or step == steps - 1:
            print(f"[fit_nextn] step {step} loss {loss1.item():.3f} / {loss2.item():.3f}", file=sys.stderr, flush=True)
    _write_back(target, model.eval(), head, tensors, prefix)
    return losses[-1]


def _write_back(target: str, model, head, tensors: dict, prefix: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:  # HF writes the published per-expert names
        model.save_pretrained(tmp)
        saved = load_file(os.path.join(tmp, "model.safetensors"))
    out = {prefix + k[len("model.layers.0.") :]: v for k, v in saved.items() if k.startswith("model.layers.0.")}
    out[prefix + "shared_head.norm.weight"] = saved["model.norm.weight"]
    out.update({prefix + k: head[k.split(".")[0]].detach() for k in NEXTN_ONLY})
    out[prefix + "embed_tokens.weight"] = tensors["embed_tokens.weight"]
    out[prefix + "shared_head.head.weight"] = tensors["shared_head.head.weight"]
    write_mtp(target, {k: v.contiguous() for k, v in out.items()})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(fit(args.target, args.steps, seed=args.seed))


if __name__ == "__main__":
    main()
