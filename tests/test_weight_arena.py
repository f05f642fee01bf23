"""The CPU linears' weight arena (common/models/weight_arena.py): the weights in one 2 MiB-aligned buffer
advised huge, the low-precision formats' packed copies gathered into one of their own."""

from __future__ import annotations

import logging

import pytest
import torch

from common.engine.model_runner import ModelRunner, RunnerArgs
from common.models import weight_arena
from common.models.packed_linear import linear_weights
from tests.oracle import hf_greedy
from tests.test_cpu_fused_ops import NEW, PROMPTS, _greedy


def test_the_linears_live_in_one_aligned_arena(checkpoint):
    """Every linear weight of the runner (the tied lm_head too) is a view of one 2 MiB-aligned buffer in
    model order, the tied embedding reads the same memory (nothing held twice), and tokens stay HF's."""
    path = checkpoint("qwen2-tied")
    runner = ModelRunner(RunnerArgs(path, max_total_tokens=256, max_running_requests=4))
    weights = linear_weights(runner.model)
    storages = {w.weight.untyped_storage().data_ptr() for w in weights}
    assert len(storages) == 1
    starts = sorted(w.weight.data_ptr() for w in weights)
    assert starts[0] % weight_arena.HUGE_PAGE == 0
    ends = sorted(w.weight.data_ptr() + w.weight.numel() * 4 for w in weights)
    assert starts[1:] == ends[:-1]  # back to back
    assert runner.model.model.embed_tokens.weight.data_ptr() == runner.model._lm_head_cpu.weight.data_ptr()
    for w in weights:
        assert w.blocks.data_ptr() == w.weight.data_ptr()  # the rowblock view follows the weight
    assert _greedy(runner) == [hf_greedy(path, p, NEW) for p in PROMPTS]


def test_hugepage_empty_is_aligned_and_advised():
    t = weight_arena.hugepage_empty(3 * weight_arena.HUGE_PAGE // 4 + 5)
    assert t.data_ptr() % weight_arena.HUGE_PAGE == 0 and t.numel() == 3 * weight_arena.HUGE_PAGE // 4 + 5
    t.fill_(1.0)
    assert float(t.sum()) == t.numel()
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read()
    except OSError:
        pytest.skip("no transparent huge pages on this host")
    if "[never]" not in thp:
        assert weight_arena._advise_huge(t.data_ptr(), weight_arena.HUGE_PAGE)


def test_a_refused_madvise_is_said_once(monkeypatch, caplog):
    """Where THP is off (madvise refused) the arena still works, on 4 KiB pages, and one log line says so."""
    monkeypatch.setattr(weight_arena, "_advise_huge", lambda address, length: False)
    monkeypatch.setattr(weight_arena, "_refusal_logged", False)
    with caplog.at_level(logging.INFO, logger=weight_arena.__name__):
        for _ in range(2):
            t = weight_arena.hugepage_empty(1000)
            assert t.data_ptr() % weight_arena.HUGE_PAGE == 0
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and "4 KiB pages" in lines[0]


def test_gather_moves_tensors_of_any_dtype_into_one_aligned_arena():
    """Each owner's tensor keeps its values, dtype and shape, lands 64-byte aligned in one huge-page arena
    in order, and the old tensor is no longer held; owners without one are left alone."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    values = [
        torch.randint(0, 256, (3, 5, 7), dtype=torch.uint8, generator=g),
        None,
        torch.randn(4, 33, generator=g).to(torch.bfloat16),
        torch.randn(10, generator=g),
    ]
    owners = [SimpleNamespace(t=None if v is None else v.clone()) for v in values]
    old = [o.t for o in owners]
    assert weight_arena.gather(owners, "t") == 128 + 320 + 64  # each rounded up to 64 bytes
    assert owners[1].t is None
    held = [o.t for o in owners if o.t is not None]
    assert len({t.untyped_storage().data_ptr() for t in held}) == 1
    assert held[0].data_ptr() % weight_arena.HUGE_PAGE == 0
    assert [t.data_ptr() - held[0].data_ptr() for t in held] == [0, 128, 448]
    for o, v, before in zip(owners, values, old):
        if v is not None:
            assert o.t.dtype == v.dtype and torch.equal(o.t, v) and o.t.data_ptr() != before.data_ptr()
    assert weight_arena.gather([SimpleNamespace(t=None)], "t") == 0


def test_the_packed_low_precision_weights_are_in_one_arena(checkpoint):
    """w8a8's int8 quads (what a decode step streams) sit in one 2 MiB-aligned arena, not on the 4 KiB
    pages the packing op allocated."""
    runner = ModelRunner(
        RunnerArgs(checkpoint("llama"), max_total_tokens=64, max_running_requests=2, quantization="w8a8")
    )
    quads = [w.low_panels for w in linear_weights(runner.model)]
    assert all(q is not None and q.dtype == torch.uint8 for q in quads)
    assert len({q.untyped_storage().data_ptr() for q in quads}) == 1
    assert min(q.data_ptr() for q in quads) % weight_arena.HUGE_PAGE == 0
