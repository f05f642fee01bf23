"""Split a handoff's KV into bounded KvChunk messages, and check/assemble them on arrival.

A chunk covers a token range and a layer range; its payload (K and V of those tokens and layers,
each one tensor) is at most `max_bytes` unless a single (token, layer) pair is larger than that.
`max_bytes` is the server's flag, or the Prefill request's own bound when it names one within
[MIN_REQUEST_CHUNK_BYTES, MAX_CHUNK_BYTES] (`chunk_bound`; outside: refused, never clamped).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from common.wire import tensor_codec
from common.wire.grpc_server import MAX_CHUNK_BYTES, MIN_REQUEST_CHUNK_BYTES
from common.wire.proto_gen import prefill_pb2


def chunk_bound(requested: int, default: int) -> int:
    """The payload bound of a call's chunks: `requested` (a Prefill request's max_chunk_bytes), or
    `default` when it is 0; ValueError naming the field when the request asks outside the range."""
    if requested == 0:
        return default
    if not MIN_REQUEST_CHUNK_BYTES <= requested <= MAX_CHUNK_BYTES:
        raise ValueError(
            f"max_chunk_bytes must be 0 (the server's default) or within [{MIN_REQUEST_CHUNK_BYTES}, "
            f"{MAX_CHUNK_BYTES}], got {requested}"
        )
    return requested


def plan(
    num_tokens: int, num_layers: int, bytes_per_token_layer: int, max_bytes: int
) -> Iterator[tuple[int, int, int, int]]:
    """Yield (token_start, num_tokens, layer_start, num_layers) covering the grid within max_bytes."""
    layers = max(1, min(num_layers, max_bytes // bytes_per_token_layer))
    tokens = max(1, max_bytes // (layers * bytes_per_token_layer)) if layers == num_layers else 1
    for t0 in range(0, num_tokens, tokens):
        for l0 in range(0, num_layers, layers):
            yield t0, min(tokens, num_tokens - t0), l0, min(layers, num_layers - l0)


def split(
    k: list[torch.Tensor], v: list[torch.Tensor], max_bytes: int, draft: bool = False
) -> Iterator[prefill_pb2.PrefillChunk]:
    """The stream messages carrying the target KV, or with `draft` the EAGLE head's KV (its one
    layer); a chunk's K (and V) is one tensor [layers, tokens, kv_heads, head_dim]. Each message is
    filled in place: protobuf copies a submessage's bytes whenever one is assigned into another.
    A latent pool's V (MLA) has width 0: its chunks carry the latent as K and an empty V."""
    num_tokens = k[0].shape[0]
    per = (k[0][:1].numel() + v[0][:1].numel()) * k[0].element_size()
    for t0, nt, l0, nl in plan(num_tokens, len(k), per, max_bytes):
        message = prefill_pb2.PrefillChunk()
        chunk = message.kv
        chunk.token_start, chunk.num_tokens, chunk.layer_start, chunk.draft = t0, nt, l0, draft
        tensor_codec.encode_into(chunk.k, torch.stack([t[t0 : t0 + nt] for t in k[l0 : l0 + nl]]))
        tensor_codec.encode_into(chunk.v, torch.stack([t[t0 : t0 + nt] for t in v[l0 : l0 + nl]]))
        yield message


def payload_bytes(chunk: prefill_pb2.KvChunk) -> int:
    """K and V bytes of a chunk, from their shapes (a checked chunk's are its payload's length)."""
    return tensor_codec.nbytes(chunk.k) + tensor_codec.nbytes(chunk.v)


class KvAssembler:
    """Checks chunks against the prompt's (layer, token) grid; with `store`, collects them into
    per-layer host tensors."""

    def __init__(self, prompt_len: int, num_layers: int, kv_heads: int, head_dim: int, store: bool = True, v_dim=None):
        """`v_dim`: V's width when it is not head_dim (a latent pool's: 0)."""
        self.prompt_len, self.num_layers, self.store = prompt_len, num_layers, store
        self.shape = (kv_heads, head_dim)
        self.v_shape = (kv_heads, head_dim if v_dim is None else v_dim)
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.covered = torch.zeros(num_layers, prompt_len, dtype=torch.int32)
        self.chunks = 0

    def add(self, chunk: prefill_pb2.KvChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """Check and decode one chunk; returns its K and V, each [layers, tokens, kv_heads, head_dim],
        read-only (views of a copy of the message's bytes: reading a bytes field copies it)."""
        t0, nt, l0 = chunk.token_start, chunk.num_tokens, chunk.layer_start
        k, v = tensor_codec.decode(chunk.k, readonly=True), tensor_codec.decode(chunk.v, readonly=True)
        if k.dim() != 4 or tuple(k.shape[1:]) != (nt, *self.shape) or v.shape != (k.shape[0], nt, *self.v_shape):
            raise ValueError(
                f"KV chunk with K {tuple(k.shape)} and V {tuple(v.shape)}, expected [layers, {nt}, {self.shape[0]}, "
                f"{self.shape[1]}] and [layers, {nt}, {self.v_shape[0]}, {self.v_shape[1]}]"
            )
        self.cover(t0, nt, l0, k.shape[0])
        if self.store:
            for i in range(k.shape[0]):
                if self.k[l0 + i] is None:
                    self.k[l0 + i] = torch.empty((self.prompt_len, *self.shape), dtype=k.dtype)
                    self.v[l0 + i] = torch.empty((self.prompt_len, *self.v_shape), dtype=k.dtype)
                self.k[l0 + i][t0 : t0 + nt] = k[i]
                self.v[l0 + i][t0 : t0 + nt] = v[i]
        return k, v

    def cover(self, token_start: int, num_tokens: int, layer_start: int, num_layers: int) -> None:
        """Count one chunk (sent, or written into our slots by a transfer engine) covering this range."""
        if (
            num_layers == 0
            or num_tokens == 0
            or layer_start + num_layers > self.num_layers
            or token_start + num_tokens > self.prompt_len
        ):
            raise ValueError(
                f"KV chunk out of range: tokens {token_start}+{num_tokens}, layers {layer_start}+{num_layers}"
            )
        self.covered[layer_start : layer_start + num_layers, token_start : token_start + num_tokens] += 1
        self.chunks += 1

    def finish(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if not bool((self.covered == 1).all()):
            raise ValueError("KV chunks do not cover every (layer, token) exactly once")
        return self.k, self.v


SEED_FIELDS = ("draft_topk_ids", "draft_topk_p", "draft_hidden")


def encode_seed(handoff) -> dict:
    """The EAGLE draft seed of a handoff as the record's `draft_seed` map (empty without EAGLE)."""
    if handoff.draft_hidden is None:
        return {}
    return {name: tensor_codec.encode(getattr(handoff, name)) for name in SEED_FIELDS}


def decode_seed(record: prefill_pb2.PrebuiltRecord) -> dict:
    """The record's draft seed as Handoff fields; raises ValueError if it is partial."""
    names = set(record.draft_seed)
    if not names:
        return {}
    if names != set(SEED_FIELDS):
        raise ValueError(f"draft seed has fields {sorted(names)}, expected {list(SEED_FIELDS)}")
    return {name: tensor_codec.decode(record.draft_seed[name]) for name in SEED_FIELDS}


MORE_DRAFT_FIELDS = ("draft_topk_ids", "draft_topk_p", "draft_hidden", "draft_k", "draft_v")


def encode_more_draft(handoff) -> dict:
    """n > 1 with EAGLE: samples 1..n-1's seeds and head KV at the last position as the record's
    `more_draft` map (empty otherwise)."""
    if handoff.more_draft_hidden is None:
        return {}
    return {name: tensor_codec.encode(getattr(handoff, f"more_{name}")) for name in MORE_DRAFT_FIELDS}


def decode_more_draft(record: prefill_pb2.PrebuiltRecord) -> dict:
    """The record's `more_draft` map as Handoff fields; raises ValueError if it is partial
    (Handoff.check_draft checks the rows against n, and handoff_writes.check_prebuilt the KV's shape)."""
    names = set(record.more_draft)
    if not names:
        return {}
    if names != set(MORE_DRAFT_FIELDS):
        raise ValueError(f"samples' draft seeds have fields {sorted(names)}, expected {list(MORE_DRAFT_FIELDS)}")
    return {f"more_{name}": tensor_codec.decode(record.more_draft[name]) for name in MORE_DRAFT_FIELDS}
