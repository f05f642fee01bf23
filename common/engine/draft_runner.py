"""DraftRunner: an EAGLE / EAGLE3 head (or DeepSeek's MTP layer, common/models/nextn.py) beside a
target ModelRunner, with its own one-layer KV pool.

The draft pool shares slot indices (and the ReqToTokenPool) with the target: the slots reserved for a
request hold its target KV and its draft KV at the same indices (docs/architecture.md, section 3). The head embeds
with the target's embedding table; EAGLE's logits come from the target's lm_head (or the rows of a
token map), EAGLE3's from its own lm_head over its draft vocabulary. An MTP layer drafts as EAGLE does
(the target's embedding and lm_head); with MLA its pool holds the latent, as the target's.
`SpecArgs` are the speculative settings, named as SGLang users know them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.attention import create_backend
from common.engine.cuda_graph_runner import CudaGraphRunner
from common.engine.kv_pool import KVPool
from common.forward.forward_batch import ForwardBatch
from common.models import cpu_fused, packed_linear
from common.models.eagle import DraftHead, load_draft_config, load_draft_head
from common.models.nextn import NextNHead
from common.models.rope import RotaryEmbedding


@dataclass
class SpecArgs:
    algorithm: str | None = None  # None (off), "EAGLE", "EAGLE3" or "NEXTN" (an alias of EAGLE)
    draft_model_path: str | None = None  # NEXTN without one: the target checkpoint's own MTP layer
    num_steps: int = 3  # draft tokens proposed per step (a chain of num_steps)
    eagle_topk: int = 1  # 1: chain drafting; > 1: tree drafting (K branches per step)
    num_draft_tokens: int = 4  # tokens one verify covers: the bonus token + the drafts (tree nodes)
    token_map: str | None = None  # EAGLE: a JSON list of "hot" token ids the head drafts from

    def validate(self) -> None:
        if self.algorithm is None:
            return
        if not self.draft_model_path and self.algorithm != "NEXTN":
            raise ValueError("--speculative-algorithm needs --speculative-draft-model-path")
        if self.num_steps < 1:
            raise ValueError(f"--speculative-num-steps must be >= 1, got {self.num_steps}")
        if self.eagle_topk < 1:
            raise ValueError(f"--speculative-eagle-topk must be >= 1, got {self.eagle_topk}")
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                f"--speculative-num-draft-tokens must be num_steps + 1 = {self.num_steps + 1} for "
                f"chain drafting (--speculative-eagle-topk 1), got {self.num_draft_tokens}"
            )
        k, most = self.eagle_topk, 1 + self.eagle_topk + (self.num_steps - 1) * self.eagle_topk**2
        if k > 1 and not 2 <= self.num_draft_tokens <= most:
            raise ValueError(
                f"--speculative-num-draft-tokens must be in [2, {most}] for a tree of topk {k} and "
                f"{self.num_steps} steps (root + candidates), got {self.num_draft_tokens}"
            )

    @property
    def window(self) -> int:
        """Positions past the committed length one step writes: the verify's tokens (tree nodes), the
        tree's draft scratch entries, and the draft extend over num_steps + 1 positions."""
        return max(self.num_draft_tokens, (self.num_steps - 1) * self.eagle_topk, self.num_steps + 1)

    @property
    def extra_slots(self) -> int:
        """KV positions a request may write past prompt + max_new_tokens: one step's window from its
        last committed length, and one more step if it finished while the next was in flight."""
        return 0 if self.algorithm is None else 2 * self.window


class DraftRunner:
    def __init__(self, spec: SpecArgs, target):
        spec.validate()
        self.spec = spec
        self.target = target
        path = spec.draft_model_path or target.config.path  # NEXTN: the target's own MTP layer
        self.config = load_draft_config(path, spec.algorithm, target.config)
        layer = self.config.layer
        self.head: DraftHead | NextNHead = load_draft_head(path, self.config, target.device, target.dtype)
        if target.packs_linears:
            packed_linear.pack_linears(self.head)  # CPU fp32: the layouts of common/models/packed_linear.py
        self.kv_pool = KVPool(
            target.kv_pool.num_slots,
            1,
            layer.num_kv_heads,
            layer.head_dim,
            target.dtype,
            target.device,
            target.args.kv_allocate,
            v_head_dim=layer.v_dim,  # an MLA layer keeps the latent alone (V of width 0)
        )
        self.backend = create_backend(target.attention_backend, self.kv_pool, target.req_to_token_pool)
        # MLA rotates qk_rope_head_dim columns, YaRN scaled as the target's
        self.rotary = RotaryEmbedding(layer.rope, layer.rope_dim, layer.max_position_embeddings if layer.mla else None)
        self.decode_graphs = self.extend_graphs = None  # CudaGraphRunner, set by the target when it has them
        self.tree_graphs: list[CudaGraphRunner] = []  # a tree's draft step at depth d: tree_graphs[d - 1]
        # The draft vocabulary: the columns of the head's logits and the target id of each. EAGLE
        # drafts over the target's whole vocabulary (its lm_head) unless a token map narrows it to hot
        # ids (a far smaller lm_head per draft step); EAGLE3 over its own, mapped by d2t.
        self.vocab_ids = self.vocab_lm_head = None
        if spec.token_map:
            if self.config.algorithm not in ("EAGLE", "NEXTN"):
                raise ValueError("--speculative-token-map is for EAGLE heads (EAGLE3 has its own draft vocabulary)")
            self.vocab_ids = load_token_map(spec.token_map, target.config.vocab_size).to(target.device)
            weight = full_lm_head(target)[self.vocab_ids].contiguous()
            self.vocab_lm_head = packed_linear.LinearWeight(weight) if target.packs_linears else weight
        elif self.config.algorithm == "EAGLE3":
            self.vocab_ids = self.head.d2t + torch.arange(self.head.d2t.numel(), device=target.device)

    @property
    def capture(self) -> tuple[int, ...]:
        """Target layers whose outputs the head reads (EAGLE3); empty: the final normed hidden (EAGLE)."""
        return self.config.aux_layer_ids

    def use_cuda_graphs(self, max_bs: int, capture: bool, extends: bool = True) -> None:
        """Draft steps (a chain's: decode forwards; a tree's: K nodes per request at each depth d < S,
        over a block of d * K entries), the head's hidden in, and the draft extend (S + 1 tokens per
        request, the target's features in) through static buffers / graphs; without `extends` (a head
        whose extends read host lists: MLA) only a chain's draft steps."""
        width, dtype, device = self.target.config.hidden_size, self.target.dtype, self.target.device
        forward = lambda fb, hidden: (self.forward_eager(fb, hidden),)  # noqa: E731
        k = self.spec.eagle_topk
        if k == 1:
            self.decode_graphs = CudaGraphRunner(forward, self.backend, device, max_bs, capture, width, dtype)
        if not extends:
            return
        if k > 1:
            self.tree_graphs = [
                CudaGraphRunner(forward, self.backend, device, max_bs, capture, width, dtype, k, tree_block=d * k)
                for d in range(1, self.spec.num_steps)
            ]
        features = width * max(1, len(self.capture))  # EAGLE: the final hidden; EAGLE3: the captured layers
        self.extend_graphs = CudaGraphRunner(forward, self.backend, device, max_bs, capture, features, dtype,
                                          tokens_per_row=self.spec.num_steps + 1)  # fmt: skip

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """Tokens of `forward_batch` are those at p+1; `hidden` [T, H or 3H] the features for p.
        Writes the draft KV at the batch's slots and returns the head's hidden for p+1 [T, H]."""
        for graphs in (self.decode_graphs, self.extend_graphs, *self.tree_graphs):
            if graphs is not None and graphs.can_run(forward_batch, hidden):
                return graphs.run(forward_batch, hidden)[0]
        return self.forward_eager(forward_batch, hidden)

    @torch.inference_mode()
    def forward_eager(self, forward_batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        self.backend.init_forward_metadata(forward_batch)
        embeds = self.target.model.model.embed_tokens(forward_batch.input_ids)
        cos, sin = self.rotary.cos_sin(forward_batch.positions, embeds.dtype)
        return self.head(embeds, hidden.to(embeds.dtype), cos, sin, forward_batch, self.backend)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits [T, draft vocabulary] (column j is target id `vocab_ids[j]`, or j)."""
        if self.config.algorithm == "EAGLE3":
            return self.head.lm_head(self.head.norm(hidden)).float()
        if self.vocab_lm_head is None:
            return self.target.model.compute_logits(hidden)
        if isinstance(self.vocab_lm_head, packed_linear.LinearWeight):
            return self.vocab_lm_head(hidden).float()
        return torch.nn.functional.linear(hidden, self.vocab_lm_head).float()

    def to_target_vocab(self, columns: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary columns (any shape) -> target token ids."""
        return columns if self.vocab_ids is None else self.vocab_ids[columns]

    def target_probs(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """Probabilities over the draft vocabulary [T, Vd] -> over the target's [T, V] (0 off the map)."""
        if self.vocab_ids is None:
            return draft_probs
        full = draft_probs.new_zeros(draft_probs.shape[0], self.target.config.vocab_size)
        return full.index_copy_(1, self.vocab_ids, draft_probs)

    @torch.inference_mode()
    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's most likely next token [T] (a target id): the argmax of its logits (no softmax)."""
        if self.config.algorithm != "EAGLE3" and self.vocab_lm_head is None:  # the target's lm_head itself
            return self.target.model.greedy_tokens(hidden)  # (its greedy head, where it has one)
        return self.to_target_vocab(cpu_fused.argmax(self.logits(hidden)))

    @torch.inference_mode()
    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's k most likely next tokens [T, k] (probabilities over its draft vocabulary, target
        ids)."""
        probs, idx = torch.softmax(self.logits(hidden), dim=-1).topk(k, dim=-1)
        return probs, self.to_target_vocab(idx)


def full_lm_head(target) -> torch.Tensor:
    """The target's whole lm_head [V, H]: under tensor parallelism each rank holds a vocabulary shard,
    gathered here (every rank builds its draft runner at the same point, so the all-gather pairs up)."""
    weight = target.model.lm_head_weight
    tp = target.tp
    if tp.size == 1:
        return weight
    return tp.all_gather_last(weight.t().contiguous()).t()[: target.config.vocab_size]


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """A JSON list of distinct token ids in [0, vocab_size); a clear error otherwise."""
    import json

    with open(path) as f:
        ids = json.load(f)
    if (
        not isinstance(ids, list)
        or not ids
        or len(set(ids)) != len(ids)
        or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)
    ):
        raise ValueError(f"--speculative-token-map {path}: need a JSON list of distinct token ids in [0, {vocab_size})")
    return torch.tensor(ids, dtype=torch.int64)
