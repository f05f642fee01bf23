"""KV chunks on the wire (model-free): split -> assemble round trip within the byte bound, bad chunks
refused, and the prefill Outbox that hands a request's record out with its last chunk."""

from __future__ import annotations

import pytest
import torch

from common.engine.handoff import Handoff
from common.kv_transfer.grpc_bytes import kv_messages as send_handoff
from common.wire import kv_chunks, tensor_codec
from common.wire.proto_gen import prefill_pb2
from prefill_service.outbox import Outbox

LAYERS, TOKENS, HEADS, DIM = 5, 37, 2, 4
PER_TOKEN_LAYER = 2 * HEADS * DIM * 4  # K and V, fp32


def _kv(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn(2, LAYERS, TOKENS, HEADS, DIM, generator=g)
    return list(whole[0].unbind(0)), list(whole[1].unbind(0))  # views of one buffer, like the copy-out


@pytest.mark.parametrize("max_bytes", [1, PER_TOKEN_LAYER * 3, PER_TOKEN_LAYER * TOKENS * 2, 1 << 20])
def test_split_then_assemble_gives_the_kv_back_within_the_bound(max_bytes):
    k, v = _kv()
    chunks = [m.kv for m in kv_chunks.split(k, v, max_bytes)]
    assembler = kv_chunks.KvAssembler(TOKENS, LAYERS, HEADS, DIM)
    for c in chunks:
        ck, cv = assembler.add(c)
        assert ck.shape == cv.shape == (ck.shape[0], c.num_tokens, HEADS, DIM)
        assert torch.equal(
            ck,
            torch.stack([t[c.token_start : c.token_start + c.num_tokens] for t in k])[
                c.layer_start : c.layer_start + ck.shape[0]
            ],
        )
        assert kv_chunks.payload_bytes(c) <= max(max_bytes, PER_TOKEN_LAYER)
    got_k, got_v = assembler.finish()
    assert assembler.chunks == len(chunks)
    assert all(torch.equal(a, b) for a, b in zip(got_k + got_v, k + v))
    if max_bytes == 1 << 20:
        assert len(chunks) == 1  # the whole handoff in one chunk: one encode per K and V


def _chunk(t0=0, nt=4, l0=0, layers=2, shape=None, v_shape=None) -> prefill_pb2.KvChunk:
    shape = shape or (layers, nt, HEADS, DIM)
    return prefill_pb2.KvChunk(
        token_start=t0,
        num_tokens=nt,
        layer_start=l0,
        k=tensor_codec.encode(torch.zeros(shape)),
        v=tensor_codec.encode(torch.zeros(v_shape or shape)),
    )


@pytest.mark.parametrize(
    "chunk, error",
    [
        (_chunk(shape=(4, HEADS, DIM)), "expected"),  # a per-layer tensor, not [layers, tokens, ...]
        (_chunk(shape=(2, 4, HEADS + 1, DIM)), "expected"),
        (_chunk(v_shape=(1, 4, HEADS, DIM)), "expected"),
        (_chunk(nt=4, shape=(2, 3, HEADS, DIM)), "expected"),  # num_tokens disagrees with the tensor
        (_chunk(l0=LAYERS - 1), "out of range"),
        (_chunk(t0=TOKENS - 2), "out of range"),
        (prefill_pb2.KvChunk(num_tokens=1), "dtype"),  # no tensors at all
    ],
)
def test_bad_chunks_are_refused(chunk, error):
    with pytest.raises(ValueError, match=error):
        kv_chunks.KvAssembler(TOKENS, LAYERS, HEADS, DIM).add(chunk)


def test_overlapping_or_missing_chunks_fail_the_coverage_check():
    a = kv_chunks.KvAssembler(TOKENS, LAYERS, HEADS, DIM, store=False)
    a.add(_chunk(t0=0, nt=TOKENS, layers=LAYERS))
    a.add(_chunk(t0=0, nt=1, layers=1))
    with pytest.raises(ValueError, match="exactly once"):
        a.finish()
    b = kv_chunks.KvAssembler(TOKENS, LAYERS, HEADS, DIM, store=False)
    b.add(_chunk(t0=0, nt=TOKENS - 1, layers=LAYERS))
    with pytest.raises(ValueError, match="exactly once"):
        b.finish()


def _handoff(k, v, **seed) -> Handoff:
    return Handoff("r", list(range(TOKENS)), None, 0, 3, k=k, v=v, **seed)


@pytest.mark.parametrize("max_bytes", [PER_TOKEN_LAYER * 5, 1 << 20])
def test_outbox_returns_the_seed_with_the_last_message_and_nothing_after(max_bytes):
    k, v = _kv()
    expected = [m.SerializeToString() for m in send_handoff(_handoff(k, v), max_bytes)]
    outbox = Outbox(send_handoff(_handoff(k, v), max_bytes), _handoff(k, v))
    got, seeds = [], []
    while not seeds or seeds[-1] is None:
        message, seed = outbox.take()
        got.append(message.SerializeToString())
        seeds.append(seed)
    assert got == expected  # every message, in order, the last one in the same take as the seed
    assert seeds[:-1] == [None] * (len(expected) - 1) and seeds[-1] == {}  # no EAGLE: an empty seed


def test_outbox_of_an_eagle_handoff_carries_its_draft_seed():
    k, v = _kv()
    seed = dict(
        draft_topk_ids=torch.tensor([[4, 5]]), draft_topk_p=torch.tensor([[0.6, 0.4]]), draft_hidden=torch.ones(8)
    )
    handoff = _handoff(k, v, **seed)
    message, got = Outbox(send_handoff(handoff, 1 << 20), handoff).take()
    assert message.HasField("kv") and set(got) == set(kv_chunks.SEED_FIELDS)
    assert torch.equal(tensor_codec.decode(got["draft_hidden"]), seed["draft_hidden"])


def test_outbox_over_no_messages_gives_only_the_seed():
    k, v = _kv()
    assert Outbox(iter(()), _handoff(k, v)).take() == (None, {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_tensor_decodes_the_same_read_only_or_as_a_writable_copy(dtype):
    """A KV chunk decodes read-only, as a view of the payload's bytes (no second copy on its way into
    the pool); everything else gets a copy it may write."""
    source = (torch.arange(24) * 3).to(dtype).view(2, 3, 4)
    msg = tensor_codec.encode(source)
    view, copy = tensor_codec.decode(msg, readonly=True), tensor_codec.decode(msg)
    assert view.dtype == copy.dtype == dtype and torch.equal(view, source) and torch.equal(copy, source)
    copy += 1  # the copy is ours: the message is untouched
    assert torch.equal(tensor_codec.decode(msg, readonly=True), source)
    assert tensor_codec.decode(prefill_pb2.Tensor(dtype="float32", shape=[0, 4]), readonly=True).shape == (0, 4)
