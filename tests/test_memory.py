"""Slot allocator, ReqToTokenPool and KV pool: exact frees, clear errors, integrity, budget sizing."""

from __future__ import annotations

import random

import pytest
import torch

from common.engine import kv_pool
from common.engine.kv_pool import KVPool, bytes_per_slot, slots_for_budget
from common.engine.req_to_token_pool import ReqToTokenPool
from common.engine.slot_allocator import DoubleFree, IntegrityError, OutOfSlots, SlotAllocator


def test_churn_keeps_integrity():
    alloc = SlotAllocator(500, name="KV slots")
    rng = random.Random(0)
    held: list[torch.Tensor] = []
    for _ in range(2000):
        if held and (rng.random() < 0.45 or not alloc.can_alloc(40)):
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(alloc.alloc(rng.randint(0, 40)))
        alloc.check_integrity(holders=held)
    for h in held:
        alloc.free(h)
    alloc.check_integrity(holders=[])
    assert alloc.num_free == 500 and alloc.num_used == 0


def test_padding_id_never_handed_out():
    alloc = SlotAllocator(10)
    ids = alloc.alloc(10)
    assert sorted(ids.tolist()) == list(range(1, 11))


def test_double_free_raises_and_frees_nothing():
    alloc = SlotAllocator(10, name="KV slots")
    a = alloc.alloc(4)
    alloc.free(a[:2])
    with pytest.raises(DoubleFree, match="KV slots: double free"):
        alloc.free(a)  # first two already free: nothing of this call may be freed
    assert alloc.num_free == 8
    alloc.check_integrity(holders=[a[2:]])
    with pytest.raises(DoubleFree, match="twice in one free"):
        alloc.free(torch.tensor([a[2], a[2]]))
    with pytest.raises(DoubleFree, match="outside"):
        alloc.free([0])
    alloc.check_integrity(holders=[a[2:]])


def test_exhaustion_raises_clearly_and_allocates_nothing():
    alloc = SlotAllocator(8, name="KV slots")
    alloc.alloc(5)
    with pytest.raises(OutOfSlots, match=r"KV slots: need 4, only 3 of 8 free"):
        alloc.alloc(4)
    assert alloc.num_free == 3


def test_integrity_catches_leaks_and_shared_slots():
    alloc = SlotAllocator(10)
    a, b = alloc.alloc(3), alloc.alloc(2)
    with pytest.raises(IntegrityError, match="leak"):
        alloc.check_integrity(holders=[a])  # b's slots are used but nobody holds them
    with pytest.raises(IntegrityError, match="two holders"):
        alloc.check_integrity(holders=[a, b, a[:1]])
    alloc._stack[alloc._top] = a[0]  # corrupt the books: a slot both free and used
    alloc._top += 1
    with pytest.raises(IntegrityError, match="both free and used"):
        alloc.check_integrity()


def test_req_to_token_pool_rows():
    pool = ReqToTokenPool(size=3, max_context=16)
    assert pool.req_to_token.shape == (4, 16) and pool.req_to_token.dtype == torch.int32
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [1, 2, 3]
    with pytest.raises(OutOfSlots, match="request slots"):
        pool.alloc()
    pool.write(rows[0], 2, torch.tensor([7, 8, 9]))
    assert pool.slots(rows[0], 0, 5).tolist() == [0, 0, 7, 8, 9]
    with pytest.raises(ValueError, match="max_context"):
        pool.write(rows[0], 14, torch.tensor([1, 2, 3]))
    pool.free(rows[1])
    with pytest.raises(DoubleFree):
        pool.free(rows[1])
    pool.allocator.check_integrity(holders=[[rows[0]], [rows[2]]])


def test_kv_pool_capacity_from_byte_budget():
    per_slot = bytes_per_slot(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    assert per_slot == 2 * 2 * 2 * 16 * 4
    n = slots_for_budget(1 << 20, 2, 2, 16, torch.float32)
    assert n == (1 << 20) // per_slot - 1
    pool = KVPool(n, 2, 2, 16, torch.float32)
    assert pool.k[0].shape == (n + 1, 2, 16)  # slot 0 is padding
    assert pool.nbytes <= 1 << 20
    assert slots_for_budget(1 << 20, 2, 2, 16, torch.bfloat16) == 2 * (n + 1) - 1
    with pytest.raises(ValueError, match="holds no slot"):
        slots_for_budget(100, 2, 2, 16, torch.float32)
    loc = torch.tensor([3, 1])
    pool.write(1, loc, torch.ones(2, 2, 16), torch.full((2, 2, 16), 2.0))
    assert pool.k[1][3].eq(1).all() and pool.v[1][1].eq(2).all() and pool.k[1][0].eq(0).all()


def test_allocations_own_their_ids_and_freed_runs_come_back_whole():
    """23.5: an allocation keeps no part of the free list alive (it was a view that pinned the whole
    list), and alloc/free touch only the ids they move, so the last freed run is the next one out."""
    alloc = SlotAllocator(500_000, name="KV slots")
    first = alloc.alloc(8)
    assert first.tolist() == list(range(1, 9))
    assert first.untyped_storage().nbytes() == 8 * first.element_size()
    second = alloc.alloc(5)
    alloc.free(first)
    assert alloc.alloc(8).tolist() == first.tolist()  # the freed run, in order
    alloc.free(second)
    alloc.check_integrity()
    assert alloc.num_used == 8


def test_kv_pool_layers_share_one_buffer_and_bulk_writes_and_gathers_match_per_layer_ones(monkeypatch):
    """Each layer's K/V is a view of one buffer; write_layers (a handoff chunk over several layers)
    (per-layer lists, or a chunk's one [layers, tokens, heads, dim] tensor) and gather (the prefill
    copy-out) equal the per-layer write and indexing they replace."""
    g = torch.Generator().manual_seed(0)
    bulk, single = KVPool(12, 4, 2, 3, torch.float32), KVPool(12, 4, 2, 3, torch.float32)
    assert bulk.k[2].data_ptr() == bulk.k_all[2].data_ptr() and bulk.k[2].is_contiguous()
    loc = torch.tensor([7, 2, 11])
    k = [torch.randn(3, 2, 3, generator=g) for _ in range(3)]
    v = [torch.randn(3, 2, 3, generator=g) for _ in range(3)]
    bulk.write_layers(1, loc, k, v)  # layers 1..3
    bulk.write_layers(0, loc[:2], torch.stack([k[0][:2]]), torch.stack([v[0][:2]]))  # a wire chunk: one tensor
    for i in range(3):
        single.write(1 + i, loc, k[i], v[i])
    single.write(0, loc[:2], k[0][:2], v[0][:2])
    assert torch.equal(bulk.k_all, single.k_all) and torch.equal(bulk.v_all, single.v_all)
    gk, gv = bulk.gather(loc)
    for layer in range(4):
        assert torch.equal(gk[layer], bulk.k[layer][loc]) and torch.equal(gv[layer], bulk.v[layer][loc])
    locs = [loc, torch.tensor([3]), torch.tensor([11, 0, 5, 7]), torch.tensor([1, 2])]  # a step's prompts
    token_bytes = 4 * 2 * 3 * 4  # one token's K over the 4 layers
    for bound in (1 << 20, 4 * token_bytes, 1):  # one copy for all; groups [0, 1] [2] [3]; one per request
        monkeypatch.setattr(kv_pool, "GATHER_BYTES", bound)
        gathered = bulk.gather_many(locs)
        assert len(gathered) == len(locs)
        for (mk, mv), slots in zip(gathered, locs):
            assert mk.shape == (4, len(slots), 2, 3) and mk.is_contiguous() and mv.is_contiguous()
            assert torch.equal(mk, bulk.k_all[:, slots]) and torch.equal(mv, bulk.v_all[:, slots])
        buffers = len({mk.untyped_storage().data_ptr() for mk, _ in gathered})
        assert buffers == {1 << 20: 1, 4 * token_bytes: 3, 1: 4}[bound]
