"""The handoff record: one prefilled request, as the prefill side hands it to the decode side.

Transport-independent: the gRPC layer streams it as first token, KV chunks and a final record;
in-process tests pass the object. KV is per layer [prompt_len, kv_heads, head_dim] in the model
dtype, on the host, or on the pool's device where the KV transport stages it (prefill's worker makes
a `StagedHandoff`, common/kv_transfer/staging.py, which adds the event its readers wait for).
`HandoffRequest` is what the decode side asks a prefill replica for (the wire's message of the same
content is `disagg.v1.PrefillRequest`).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

from common.engine.logprobs import TokenLogprobs
from common.engine.prompt_logprobs import logit_positions
from common.engine.sampling import SamplingParams

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def check_token(rid: str, what: str, token: int, vocab_size: int) -> None:
    """Raise ValueError unless `token` (sent by a prefill replica) is an id of the vocabulary."""
    if not 0 <= token < vocab_size:
        raise ValueError(f"handoff {rid}: {what} {token} is outside the vocabulary [0, {vocab_size})")


def prefix_digest(ids: list[int]) -> bytes:
    """SHA-256 of token ids as little-endian uint32: how both sides name the prefix decode holds."""
    return hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).digest()


@dataclass
class HandoffRequest:
    rid: str
    prompt_ids: list[int]  # the ids to prefill: the prompt, plus tokens already sent on a retry
    params: SamplingParams
    seed: int
    first_position: int = 0  # output index of the token this prefill samples (= tokens resent)
    kv_slots: torch.Tensor | None = None  # decode's slots of positions kv_start.. (a transfer engine writes there)
    trace: tuple | None = None  # (parent span context, submission ns) of the caller's trace; opaque here
    kv_start: int = 0  # decode holds the KV of prompt_ids[:kv_start] (its prefix cache): the handoff's starts here


@dataclass
class Handoff:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    first_token: int
    k: list[torch.Tensor] | None  # None: the KV already arrived as chunks (written on arrival)
    v: list[torch.Tensor] | None
    first_position: int = 0  # output index of first_token; prompt_ids ends with that many outputs
    cached_tokens: int = 0  # leading prompt tokens whose KV the prefill side took from its prefix cache
    first_logprobs: TokenLogprobs | None = None  # the first token's, when the request asks for logprobs
    # n > 1 (SamplingParams.n): the first tokens of samples 1..n-1 (first_token is sample 0's), each
    # drawn with sample_seed(seed, i), and their logprobs when the request asks (else empty)
    more_first_tokens: tuple[int, ...] = ()
    more_first_logprobs: tuple[TokenLogprobs, ...] = ()
    # prompt logprobs (params.logprob_start_len = s >= 0): positions max(s, 1).. of the prompt (the
    # prompt_ids less a retry's first_position resent outputs), one each; None when not asked
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # EAGLE: the head's one layer of KV over the prompt, and its seed at the last position (the next
    # draft token(s) with their probabilities, and the head's hidden there)
    draft_k: list[torch.Tensor] | None = None
    draft_v: list[torch.Tensor] | None = None
    draft_topk_ids: torch.Tensor | None = None
    draft_topk_p: torch.Tensor | None = None
    draft_hidden: torch.Tensor | None = None
    # EAGLE with n > 1: the head at the last prompt position reads the sample's own first token, so
    # samples 1..n-1 each have their own seed and head KV there (prefill_service/draft_prefill.py),
    # stacked over the samples: top-k ids and probabilities [n-1, k], hidden [n-1, H], the head's
    # K and V at that position [n-1, kv_heads, head_dim] (its one layer); None without EAGLE or n = 1
    more_draft_topk_ids: torch.Tensor | None = None
    more_draft_topk_p: torch.Tensor | None = None
    more_draft_hidden: torch.Tensor | None = None
    more_draft_k: torch.Tensor | None = None
    more_draft_v: torch.Tensor | None = None
    kv_start: int = 0  # k / v (and the chunks or writes of them) are positions kv_start..prompt_len

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def kv_len(self) -> int:
        """Positions whose KV the handoff carries."""
        return len(self.prompt_ids) - self.kv_start

    def check(self, num_layers: int) -> None:
        """Raise ValueError if the record is malformed (so the receiver frees and fails cleanly)."""
        if len(self.k) != num_layers or len(self.v) != num_layers:
            raise ValueError(f"handoff {self.rid}: KV for {len(self.k)}/{len(self.v)} layers, expected {num_layers}")
        for t in self.k + self.v:
            if t.shape[0] != self.kv_len:
                raise ValueError(f"handoff {self.rid}: KV of {t.shape[0]} tokens, expected {self.kv_len}")

    def check_record(self, vocab_size: int) -> None:
        """Raise ValueError unless the first token is in the vocabulary and the counts fit the prompt."""
        check_token(self.rid, "first token", self.first_token, vocab_size)
        if len(self.more_first_tokens) != self.params.n - 1:
            raise ValueError(
                f"handoff {self.rid}: {1 + len(self.more_first_tokens)} first tokens for n = {self.params.n}"
            )
        for t in self.more_first_tokens:
            check_token(self.rid, "first token", t, vocab_size)
        if self.params.return_logprob and len(self.more_first_logprobs) != len(self.more_first_tokens):
            raise ValueError(f"handoff {self.rid}: logprobs for {len(self.more_first_logprobs)} more first tokens")
        if not 0 <= self.first_position <= self.prompt_len:
            raise ValueError(f"handoff {self.rid}: first position {self.first_position} outside the prompt")
        want = len(logit_positions(self.params, self.prompt_len, self.first_position))
        if self.params.prompt_logprobs and len(self.prompt_logprobs or ()) != want:
            raise ValueError(f"handoff {self.rid}: {len(self.prompt_logprobs or ())} prompt logprobs, {want} asked")
        if not 0 <= self.cached_tokens <= self.prompt_len:
            raise ValueError(
                f"handoff {self.rid}: {self.cached_tokens} cached tokens, but the prompt has {self.prompt_len}"
            )

    def check_draft(self, hidden_size: int, vocab_size: int) -> None:
        """For a speculative receiver: the draft seed (and draft KV, when in the record) is present and
        sound: top-k ids in the vocabulary with as many finite probabilities, a finite hidden of the
        target's width. Raise ValueError naming what is wrong."""
        if self.draft_topk_ids is None or self.draft_topk_p is None or self.draft_hidden is None:
            raise ValueError(f"handoff {self.rid}: no draft seed, but speculative decoding is on here")
        self._check_seed("", self.draft_topk_ids, self.draft_topk_p, self.draft_hidden, hidden_size, vocab_size)
        more = (self.more_draft_topk_ids, self.more_draft_topk_p, self.more_draft_hidden)
        rows = self.params.n - 1
        if rows and (any(t is None for t in more) or self.more_draft_k is None or self.more_draft_v is None):
            raise ValueError(f"handoff {self.rid}: no draft seeds for samples 1..{rows}, but n = {self.params.n}")
        if rows and any(t.dim() < 2 or len(t) != rows for t in (*more, self.more_draft_k, self.more_draft_v)):
            raise ValueError(f"handoff {self.rid}: the samples' draft seeds and KV are not {rows} rows each")
        for i in range(rows):
            self._check_seed(f"sample {i + 1}'s ", *(t[i] for t in more), hidden_size, vocab_size)
        if self.draft_k is not None and any(t.shape[0] != self.kv_len for t in self.draft_k + self.draft_v):
            raise ValueError(f"handoff {self.rid}: draft KV does not cover the prompt from kv_start")

    def _check_seed(self, who: str, ids, p, hidden, hidden_size: int, vocab_size: int) -> None:
        """One draft seed (`who`: whose, for the message): see check_draft."""
        if ids.dim() != 1 or not len(ids) or ids.dtype not in _INT_DTYPES:
            raise ValueError(
                f"handoff {self.rid}: {who}draft top-k ids {ids.dtype} {tuple(ids.shape)}, expected int [k]"
            )
        # values are checked where they came off the wire (host tensors); a device seed is our own
        # engine's (in-process), and reading its values here would stall the host on the device
        wire = ids.device.type == "cpu"
        bad = ids[(ids < 0) | (ids >= vocab_size)] if wire else ids[:0]
        if len(bad):
            raise ValueError(
                f"handoff {self.rid}: {who}draft top-k ids {bad.tolist()[:4]} outside the vocabulary [0, {vocab_size})"
            )
        if p.shape != ids.shape or not p.dtype.is_floating_point or (wire and not bool(torch.isfinite(p).all())):
            raise ValueError(f"handoff {self.rid}: {who}draft top-k probabilities must be {len(ids)} finite floats")
        if tuple(hidden.shape) != (hidden_size,) or not hidden.dtype.is_floating_point:
            raise ValueError(
                f"handoff {self.rid}: {who}draft hidden {hidden.dtype} of shape {tuple(hidden.shape)}, expected "
                f"floating ({hidden_size},)"
            )
        if wire and not bool(torch.isfinite(hidden).all()):
            raise ValueError(f"handoff {self.rid}: {who}draft hidden holds NaN or infinity")

    def check_continues(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Raise ValueError unless the record continues exactly what the receiver has: it prefilled
        the prompt + the first `first_position` outputs, and its first token is the next output (or
        the one already streamed)."""
        first = self.first_position
        sent = output_ids[:first]
        if self.prompt_ids != prompt_ids + sent or len(sent) != first:
            raise ValueError(f"handoff {self.rid}: prefilled ids differ from prompt + tokens sent")
        if len(output_ids) > first + 1 or output_ids[first:] not in ([], [self.first_token]):
            raise ValueError(f"handoff {self.rid}: first token differs from the one streamed")
