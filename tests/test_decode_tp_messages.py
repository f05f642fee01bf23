"""The decode service's TP messages (decode_service/tp_messages.py): each one travels through the TP
codec whole, a KV-carrying one is cut to the receiving rank's KV heads, and a rank dispatches by type."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from common.engine.handoff import Handoff
from common.engine.sampling import SamplingBatch, SamplingParams
from common.parallel import tp_codec
from decode_service.tp_messages import Forward, ReleaseRow, Stop, WriteKvChunk, WritePrebuilt
from decode_service.tp_worker import apply, cut_kv_message
from decode_service.worker_batch import Lane, WorkerBatch

CPU = torch.device("cpu")
KV = [torch.arange(24, dtype=torch.float32).view(3, 4, 2)]  # one layer: [tokens, KV heads, head_dim]


def _handoff() -> Handoff:
    params = SamplingParams(max_new_tokens=4, temperature=0.5)
    return Handoff("r", [5, 6, 7], params, 11, 9, k=KV, v=[t + 100 for t in KV])


def _batch() -> WorkerBatch:
    params = [SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=8, temperature=0.7)]
    return WorkerBatch(
        step=3,
        req_pool_indices=torch.tensor([1, 2]),
        req_pool_indices_cpu=[1, 2],
        kv_committed_lens=torch.tensor([5, 9]),
        kv_committed_lens_cpu=[5, 9],
        sampling=SamplingBatch(params, [1, 2]),
        output_indices=[1, 3],
        lanes=(Lane("a", 4), Lane("b", 6)),
    )


def _same(a, b) -> bool:
    """Equal field by field, tensors by value."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, SamplingBatch):  # a plain class: its inputs (the rest is derived from them)
        return type(b) is SamplingBatch and a.params == b.params and a.seeds == b.seeds
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


MESSAGES = [
    Forward(_batch()),
    WriteKvChunk(torch.tensor([4, 5, 6]), 0, 1, torch.ones(1, 3, 4, 2), torch.zeros(1, 3, 4, 2), False),
    WritePrebuilt(2, torch.tensor([7, 8, 9]), _handoff()),
    ReleaseRow(2),
    Stop(),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_travels_through_the_codec_whole(message):
    got = tp_codec.loads(tp_codec.dumps(message), CPU)
    assert type(got) is type(message) and _same(got, message)
    if isinstance(got, Forward):  # the batch's own classes come back too, still frozen
        assert type(got.batch.lanes[0]) is Lane
        with pytest.raises(dataclasses.FrozenInstanceError):
            got.batch.step = 4


def test_kv_messages_are_cut_to_the_ranks_kv_heads_and_the_draft_heads_kv_is_not():
    config = SimpleNamespace(num_kv_heads=4, mla=None)  # a GQA model: KV heads are split, not replicated
    k = torch.arange(48, dtype=torch.float32).view(1, 3, 4, 4)  # [layers, tokens, KV heads, head_dim]
    target = WriteKvChunk(torch.tensor([1, 2, 3]), 0, 0, k, k + 1, draft=False)
    part = cut_kv_message(target, config, rank=1, size=2)
    assert torch.equal(part.k, k[:, :, 2:4]) and torch.equal(part.v, (k + 1)[:, :, 2:4])
    assert torch.equal(part.kv_slots, target.kv_slots) and part.draft is False
    draft = dataclasses.replace(target, draft=True)
    assert cut_kv_message(draft, config, rank=1, size=2) is draft
    prebuilt = cut_kv_message(WritePrebuilt(2, torch.tensor([1, 2, 3]), _handoff()), config, rank=0, size=2)
    assert torch.equal(prebuilt.handoff.k[0], KV[0][:, 0:2]) and prebuilt.req_pool_idx == 2
    assert cut_kv_message(ReleaseRow(2), config, rank=1, size=2) == ReleaseRow(2)


def test_a_rank_dispatches_by_type_and_refuses_anything_else():
    seen = []
    worker = SimpleNamespace(forward=seen.append)
    batch = _batch()
    apply(worker, Forward(batch))
    assert seen == [batch]
    with pytest.raises(ValueError, match="unknown TP message tuple"):
        apply(worker, ("forward", batch))  # the old tuple-tagged form is no message any more
