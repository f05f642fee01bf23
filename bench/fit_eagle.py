"""Fit an EAGLE / EAGLE3 draft head to a target on the target's own greedy answers.

    python -m bench.fit_eagle --target DIR --algorithm EAGLE|EAGLE3 --out DIR [--minutes 10 | --total-minutes 15]
        [--prompts 256] [--answer-tokens 96] [--seed 0] [--unroll 3] [--lr 1e-3] [--batch-tokens 1024] [--data FILE]
        [--eval-prompts 20] [--eval-only --topk K --num-draft-tokens M]

1. data (eagle_data.py): generated instructions, chat-formatted, answered greedily by the target,
   with the target's features at every position (kept in --data FILE for a later fit);
2. fit from random init within the time budget: at position p the head reads (token p+1, the
   target's features at p, plus a little noise) and is trained to predict the target's token at p+2
   (cross-entropy over the draft vocabulary: the answers' most frequent tokens, EAGLE3's lm_head or
   EAGLE's token map) and, for EAGLE, the target's hidden at p+1 (smooth L1, the main term; CE
   weighted 0.1); unrolled `--unroll` draft steps deep on its own hidden (training-time test), so
   later drafts learn from the inputs they get when serving; AdamW, cosine schedule over the
   budget; progress on stderr;
3. write the head in the public layout (config.json + model.safetensors) that the services load
   with --speculative-draft-model-path, and for EAGLE `token_map.json` (the answers' tokens, most
   frequent first, at most HOT_TOKENS) for --speculative-token-map; atomically (a temp folder renamed).
`measure_acceptance` runs the decode scheduler with a head on held-out prompts (a split of the
instructions never fitted on) and returns the mean accept length (tokens committed per verify step).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch
from torch.nn import functional as F

from common.engine.model_runner import ModelRunner, RunnerArgs
from common.models.eagle import DraftHead, load_draft_config
from common.models.rope import RotaryEmbedding
from common.tools import eagle_data
from common.tools.eagle_checkpoint import head_config, save_head

TOKEN_MAP = "token_map.json"  # beside an EAGLE head: the hot tokens it drafts from (FR-Spec style)
# The token map's size. Each draft step multiplies by these rows of the lm_head: on SmolLM2-135M at
# batch 1 on 2 CPU cores, 4096 rows (9 MB) decoded 1.30x plain against 1.20x with 8192 (19 MB) for the
# same head, at the same accept length (1.81 vs 1.80; 2048: 1.78, 1024: 1.72). 2026-11-25.
HOT_TOKENS = 4096
HELD_OUT_SEED = 10_000  # instructions(n, seed + HELD_OUT_SEED, evaluation=True): the evaluation prompts


class UnrolledBlocks:
    """Training attention over a padded batch of sequences [N, L] (queries flat [N * L, heads, d]), for a
    head unrolled on its own outputs (EAGLE3's training-time test). Step 1 is causal within each
    sequence (padding sits at the ends, so no real position sees it). Step k > 1 at position p is the
    head's k-th draft from p: like serving, it sees step 1's keys at positions <= p (drafts there were
    computed from the target's features) and its own chain of drafts at p."""

    def __init__(self, num_seqs: int, length: int):
        self.shape = (num_seqs, length)
        self.causal = torch.ones(length, length, dtype=torch.bool).tril()
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, q, k, v, layer, forward_batch, scale):
        group = q.shape[1] // k.shape[1]
        q, k, v = (x.view(*self.shape, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))  # [N, heads, L, d]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        self.kv.append((k, v))
        k1, v1 = self.kv[0]
        if len(self.kv) == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            scores = (q @ k1.transpose(2, 3)).masked_fill(~self.causal, float("-inf"))
            own = torch.stack([(q * kj).sum(-1) for kj, _ in self.kv[1:]], dim=-1)  # [N, heads, L, k-1]
            probs = torch.softmax(torch.cat([scores, own], dim=-1) * scale, dim=-1)
            length = self.shape[1]
            out = probs[..., :length] @ v1
            for j, (_, vj) in enumerate(self.kv[1:]):
                out = out + probs[..., length + j, None] * vj
        return out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])  # [N * L, heads, d]


def _batches(seqs, feats, max_tokens: int, gen: torch.Generator):
    order = torch.randperm(len(seqs), generator=gen).tolist()
    batch, size = [], 0
    for i in order:
        n = len(seqs[i]) - 2  # positions with both targets (hidden at p+1, token at p+2)
        if n <= 0:
            continue
        if batch and size + n > max_tokens:
            yield batch
            batch, size = [], 0
        batch.append(i)
        size += n
    if batch:
        yield batch


def _hot_tokens(seqs: list[list[int]], vocab_size: int, limit: int, floor: int = 64) -> torch.Tensor:
    """The ids the answers use, most frequent first (at most `limit`, at least `floor`)."""
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=vocab_size)
    return counts.argsort(descending=True)[: min(vocab_size, limit, max(floor, int((counts > 0).sum())))]


def _unrolled_loss(head, batch, seqs, feats, embed, vocab_head, t2d, rotary, unroll: int, noise: float):
    """Sum over draft depths k = 1..unroll of the head's loss at every position p of the batch's
    sequences (padded to one length): step k reads token p+k and (k = 1) the target's features at p,
    with noise, or (k > 1) its own hidden from step k-1; it predicts the target's token at p+k+1
    (cross-entropy over the draft vocabulary) and, for EAGLE, the target's hidden at p+k (smooth L1,
    the main term; CE x 0.1). Depth k weighs 0.8^(k-1). Returns (loss, step-1 top-1 accuracy)."""
    lengths = torch.tensor([len(seqs[i]) - 2 for i in batch])  # positions with both step-1 targets
    n, dim = int(lengths.max()), feats[batch[0]].shape[-1]
    toks = torch.zeros(len(batch), n + unroll + 2, dtype=torch.int64)
    target = torch.zeros(len(batch), n + unroll + 1, dim)
    for row, i in enumerate(batch):
        toks[row, : len(seqs[i])] = torch.tensor(seqs[i])
        target[row, : len(feats[i])] = feats[i]
    attn, loss, acc = UnrolledBlocks(len(batch), n), 0.0, 0.0
    hidden = target[:, :n].reshape(-1, dim)
    hidden = hidden + noise * hidden.std() * torch.randn_like(hidden) / dim**0.5
    for k in range(1, unroll + 1):
        valid = (torch.arange(n)[None, :] <= (lengths - k)[:, None]).flatten()  # token p+k+1 exists
        cos, sin = rotary.cos_sin((torch.arange(n) + k - 1).repeat(len(batch)), torch.float32)
        hidden = head(embed[toks[:, k : k + n].flatten()], hidden, cos, sin, None, attn)
        labels = t2d[toks[:, k + 1 : k + 1 + n].flatten()][valid]
        pred = hidden[valid]
        if head.config.algorithm == "EAGLE":
            logits = F.linear(pred, vocab_head)
            truth = target[:, k : k + n].reshape(-1, dim)[valid]
            step = F.smooth_l1_loss(pred, truth) + 0.1 * F.cross_entropy(logits, labels, ignore_index=-100)
        else:
            logits = head.lm_head(head.norm(pred))
            step = F.cross_entropy(logits, labels, ignore_index=-100)
        loss = loss + 0.8 ** (k - 1) * step
        if k == 1:
            acc = (logits.argmax(-1) == labels).float().mean().item()
    return loss, acc


def fit(
    target: str,
    algorithm: str,
    out: str,
    minutes: float = 10.0,
    prompts: int = 256,
    answer_tokens: int = 96,
    seed: int = 0,
    max_batch_tokens: int = 1024,
    noise: float = 0.2,
    lr: float = 1e-3,
    max_steps: int | None = None,
    unroll: int = 3,
    data: str | None = None,
    total_minutes: float | None = None,
) -> str:
    """Fit and write a head; stops at the time budget or after `max_steps` optimizer steps (tests use
    a step cap so the result does not depend on the machine's speed). `data`: a file that keeps the
    generated answers and features, reused by a later fit with the same target, prompts and seed.
    `total_minutes`: a budget for the whole call instead (the fit gets what the data left of it)."""
    called = time.monotonic()
    torch.manual_seed(seed)
    runner = ModelRunner(RunnerArgs(target, max_total_tokens=64 * (answer_tokens + 512), max_running_requests=64))
    cfg = runner.config
    from common.tools.tokenizer import load_tokenizer

    tok = load_tokenizer(target)
    prompt_ids = [eagle_data.chat_ids(tok, t) for t in eagle_data.instructions(prompts, seed)]
    tmp = f"{out}.tmp-{os.getpid()}"
    save_head_config(tmp, head_config(cfg, algorithm, None if algorithm == "EAGLE" else cfg.vocab_size))
    capture = load_draft_config(tmp, algorithm, cfg).aux_layer_ids  # the layers the head reads (EAGLE3)
    key = dict(target=os.path.abspath(target), prompts=prompts, answer_tokens=answer_tokens, seed=seed, capture=capture)
    if data and os.path.exists(data) and (cached := torch.load(data))["key"] == key:
        seqs, feats = cached["seqs"], cached["feats"]
        print(f"[fit] data from {data}", file=sys.stderr, flush=True)
    else:
        seqs, feats = eagle_data.answers(runner, prompt_ids, answer_tokens, capture)
        if data:
            torch.save(dict(key=key, seqs=seqs, feats=feats), data)
    # the draft vocabulary: EAGLE3's lm_head rows, EAGLE's token map (both trained over it alone)
    hot = _hot_tokens(seqs, cfg.vocab_size, HOT_TOKENS if algorithm == "EAGLE" else cfg.vocab_size)
    draft_vocab = hot.sort().values if algorithm == "EAGLE3" else hot
    config = head_config(cfg, algorithm, None if algorithm == "EAGLE" else draft_vocab.numel())
    save_head_config(tmp, config)
    head = DraftHead(load_draft_config(tmp, algorithm, cfg)).float().train()
    print(f"[fit] {len(seqs)} sequences, {sum(map(len, seqs))} tokens of data", file=sys.stderr, flush=True)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
        if algorithm == "EAGLE3":
            head.d2t.copy_(draft_vocab - torch.arange(draft_vocab.numel()))
    t2d = torch.full((cfg.vocab_size,), -100, dtype=torch.int64)
    t2d[draft_vocab] = torch.arange(draft_vocab.numel())
    embed = runner.model.model.embed_tokens.weight.detach().float()
    vocab_head = runner.model.lm_head_weight.detach().float()[draft_vocab]
    rotary = RotaryEmbedding(head.config.layer.rope, head.config.layer.head_dim)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    if total_minutes is not None:  # keep ~10 s to write the head
        minutes = max(0.0, total_minutes - (time.monotonic() - called + 10) / 60)
        print(f"[fit] {minutes:.1f} minutes left for the fit", file=sys.stderr, flush=True)
    gen, budget, start, step, shown = torch.Generator().manual_seed(seed), 60 * minutes, time.monotonic(), 0, 0.0
    while (elapsed := time.monotonic() - start) < budget and (max_steps is None or step < max_steps):
        for batch in _batches(seqs, feats, max_batch_tokens, gen):
            elapsed = time.monotonic() - start
            if elapsed >= budget or (max_steps is not None and step >= max_steps):
                break
            for group in opt.param_groups:  # cosine over the time budget
                done = max(elapsed / budget, step / max_steps if max_steps else 0.0)
                group["lr"] = lr * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * min(done, 1.0))).item())
            loss, acc = _unrolled_loss(head, batch, seqs, feats, embed, vocab_head, t2d, rotary, unroll, noise)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)  # the unrolled chain can spike
            opt.step()
            step += 1
            if elapsed - shown >= max(5.0, budget / 40):
                shown = elapsed
                print(
                    f"[fit] {elapsed:5.0f}/{budget:.0f}s step {step} loss {loss.item():.4f} top-1 {acc:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
    save_head(head.eval(), config, tmp)
    if algorithm == "EAGLE":  # for --speculative-token-map
        with open(os.path.join(tmp, TOKEN_MAP), "w") as f:
            json.dump(hot.tolist(), f)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.rename(tmp, out)
    print(f"[fit] wrote {out} after {step} steps", file=sys.stderr, flush=True)
    return out


def save_head_config(path: str, config: dict) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def measure_acceptance(
    target: str,
    head: str,
    algorithm: str,
    prompts: list[list[int]],
    num_steps: int = 3,
    max_new_tokens: int = 64,
    token_map: str | None = None,
    topk: int = 1,
    num_draft_tokens: int | None = None,
) -> float:
    """Mean accept length (committed tokens per verify step) of the decode scheduler on `prompts`
    (topk > 1: tree drafting with `num_draft_tokens` nodes)."""
    from bench import offline
    from common.engine.draft_runner import SpecArgs
    from common.engine.sampling import SamplingParams

    spec = SpecArgs(algorithm, head, num_steps, topk, num_draft_tokens or num_steps + 1, token_map)
    batch = min(len(prompts), 32)
    size = dict(
        max_total_tokens=batch * (max(map(len, prompts)) + max_new_tokens + spec.extra_slots),
        spec=spec,
        max_running_requests=batch,
    )
    runners = ModelRunner(RunnerArgs(target, **size)), ModelRunner(RunnerArgs(target, **size))
    _, (accepted, proposed) = offline.generate(*runners, prompts, SamplingParams(max_new_tokens=max_new_tokens))
    return 1 + accepted / (proposed / num_steps) if proposed else 1.0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fit_eagle", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="target checkpoint folder")
    p.add_argument("--algorithm", required=True, choices=["EAGLE", "EAGLE3"])
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=10.0, help="time budget of the fit (data generation not included)")
    p.add_argument(
        "--total-minutes",
        type=float,
        default=None,
        help="time budget of data generation and fit together (replaces --minutes)",
    )
    p.add_argument("--prompts", type=int, default=256, help="generated instructions answered by the target")
    p.add_argument("--answer-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--unroll", type=int, default=3, help="draft steps trained on the head's own outputs")
    p.add_argument("--batch-tokens", type=int, default=1024, help="positions per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate (cosine to 0 over the budget)")
    p.add_argument("--data", default=None, help="keep the generated data in this file and reuse it when it matches")
    p.add_argument("--eval-prompts", type=int, default=20, help="held-out prompts for the accept length (0: skip)")
    p.add_argument("--eval-only", action="store_true", help="skip the fit: evaluate the head already in --out")
    p.add_argument("--topk", type=int, default=1, help="evaluate with --speculative-eagle-topk (> 1: a tree)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="tree nodes verified (default num_steps + 1)")
    args = p.parse_args(argv)
    if not args.eval_only:
        fit(
            args.target,
            args.algorithm,
            args.out,
            args.minutes,
            args.prompts,
            args.answer_tokens,
            args.seed,
            max_batch_tokens=args.batch_tokens,
            unroll=args.unroll,
            lr=args.lr,
            data=args.data,
            total_minutes=args.total_minutes,
        )
    if args.eval_prompts:
        from common.tools.tokenizer import load_tokenizer

        tok = load_tokenizer(args.target)
        texts = eagle_data.instructions(args.eval_prompts, args.seed + HELD_OUT_SEED, evaluation=True)
        held_out = [eagle_data.chat_ids(tok, t) for t in texts]
        tree = dict(topk=args.topk, num_draft_tokens=args.num_draft_tokens)
        length = measure_acceptance(args.target, args.out, args.algorithm, held_out, **tree)
        print(
            f"mean accept length at num_steps 3, topk {args.topk} on {len(held_out)} held-out prompts: {length:.2f}",
            flush=True,
        )
        token_map = os.path.join(args.out, TOKEN_MAP)
        if os.path.exists(token_map):
            length = measure_acceptance(args.target, args.out, args.algorithm, held_out, token_map=token_map, **tree)
            print(f"  with --speculative-token-map {token_map}: {length:.2f}", flush=True)


if __name__ == "__main__":
    main()
