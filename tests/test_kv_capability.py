"""Prefill writes KV only where decode asked (common/wire/kv_capability.py, checked by the address-writing
senders of common/kv_transfer/): a caller that names
decode's real pool files or regions with another request's slots, without decode's capability for
exactly those (none, a guessed key, one issued for other slots or another request, a replay, an
expired one), is refused and the victim's KV stays as it was."""

from __future__ import annotations

import os

import grpc
import pytest
import torch

from common.engine.handoff import Handoff
from common.engine.kv_pool import KVPool
from common.kv_transfer import mooncake, plan, shm, shm_files
from common.kv_transfer.address_writes import PoolReceiver
from common.kv_transfer.errors import KvTransferError
from common.kv_transfer.receiver import join_ranks
from common.wire import kv_capability
from common.wire.kv_capability import CapabilityRefused
from common.wire.proto_gen import prefill_pb2, prefill_pb2_grpc
from tests.grpc_harness import GrpcPair

VICTIM = [1, 2, 3]


def _handoff(rid: str, value: float, layers: int = 2) -> Handoff:
    kv = [torch.full((len(VICTIM), 1, 4), value) for _ in range(layers)]
    return Handoff(rid, list(range(len(VICTIM))), None, 0, 0, kv, [t.clone() for t in kv])


def _write(sender, dest, handoff) -> None:
    label, messages = sender.messages(handoff.rid, dest, handoff, 1 << 20, lambda: False)
    assert label == sender.label  # the sender reaches the destination: it writes, or refuses
    for _ in messages:
        pass


def _dest(base, rid: str, slots: list[int], keys: list[bytes] | None, ttl_s: float = 60.0):
    d = prefill_pb2.KvDestination()
    d.CopyFrom(base)
    d.runs.extend(plan.slot_runs(slots))
    if keys is not None:
        kv_capability.sign(d, rid, keys, ttl_s)
    return d


def _attacks(base, key: bytes, victim) -> list[tuple]:
    """(destination, the attacker's handoff, why refused) of each way to aim at the victim's slots."""
    moved = _dest(base, "attacker", [5, 6, 7], [key])  # decode's capability for the attacker's own slots
    del moved.runs[:]
    moved.runs.extend(victim.runs)
    attacker = _handoff("attacker", 9.0)
    return [
        (_dest(base, "attacker", VICTIM, None), attacker, "no valid capability"),
        (_dest(base, "attacker", VICTIM, [os.urandom(32)]), attacker, "does not verify"),  # a guessed key
        (moved, attacker, "does not verify"),  # a real capability, moved to other slots
        # a fresh capability decode issued for the victim's request, never used: only the request binding refuses it
        (_dest(base, "victim", VICTIM, [key]), attacker, "does not verify"),
        (victim, attacker, "does not verify"),  # the victim's capability, for another request
        (victim, _handoff("victim", 9.0), "used before"),  # the victim's call, replayed
        (_dest(base, "victim", VICTIM, [key], ttl_s=-1), _handoff("victim", 9.0), "expired"),
    ]


def _check_refused_and_untouched(sender, base, key: bytes, pool: KVPool) -> None:
    victim = _dest(base, "victim", VICTIM, [key])
    _write(sender, victim, _handoff("victim", 1.0))  # the honest handoff lands
    assert pool.k_all[:, VICTIM].eq(1.0).all() and pool.v_all[:, VICTIM].eq(1.0).all()
    before = pool.k_all.clone(), pool.v_all.clone()
    for dest, handoff, why in _attacks(base, key, victim):
        with pytest.raises(KvTransferError, match=why) as refused:  # the transport's one error type
            _write(sender, dest, handoff)
        assert isinstance(refused.value.__cause__, CapabilityRefused)
    assert torch.equal(pool.k_all, before[0]) and torch.equal(pool.v_all, before[1])
    _write(sender, _dest(base, "next", [5, 6, 7], [key]), _handoff("next", 2.0))  # decode's next request does land
    assert pool.k_all[:, 5:8].eq(2.0).all() and torch.equal(pool.k_all[:, VICTIM], before[0][:, VICTIM])


def test_shm_a_caller_without_decodes_capability_cannot_write_into_its_pool_files(tmp_path):
    pool = KVPool(8, 2, 1, 4, torch.float32, allocate=shm_files.allocator(str(tmp_path)))
    endpoint = shm.ShmEndpoint(pool.files)
    base = prefill_pb2.KvDestination(session=endpoint.session, target=plan.kv_region(pool.k, pool.v))
    writer = shm.ShmWriter(str(tmp_path))
    try:
        assert writer.capability_key(endpoint.session) == endpoint.key  # read from the files' trailers
        _check_refused_and_untouched(shm.ShmSender(writer), base, endpoint.key, pool)
    finally:
        writer.close()


def test_shm_pool_files_hold_the_secret_past_what_a_writer_maps(tmp_path):
    """The key is in the files (mode 0600), not in anything a caller sees, and no write reaches it."""
    pool = KVPool(4, 1, 1, 4, torch.float32, allocate=shm_files.allocator(str(tmp_path)))
    endpoint = shm.ShmEndpoint(pool.files)
    assert endpoint.key.hex() not in endpoint.session and endpoint.key not in endpoint.session.encode()
    (path, k_all), _ = pool.files
    end = k_all.data_ptr() + k_all.numel() * 4
    writer = shm.ShmWriter(str(tmp_path))
    src = torch.zeros(16)
    with pytest.raises(shm.ShmTransferError, match="falls outside"):
        writer.write(endpoint.session, [src.data_ptr()], [end], [16])  # the trailer's place
    assert writer.capability_key(endpoint.session) == endpoint.key
    writer.close()


def test_mooncake_a_caller_without_the_internal_key_cannot_aim_prefills_writes():
    key = kv_capability.key_from_internal("internal-key")
    decode = mooncake.TransferEngine("127.0.0.1")
    pool = KVPool(8, 2, 1, 4, torch.float32)
    decode.register(pool.k + pool.v)
    prefill = mooncake.TransferEngine("127.0.0.1", capability_key=key)
    base = prefill_pb2.KvDestination(session=decode.session, target=plan.kv_region(pool.k, pool.v))
    sender = mooncake.MooncakeSender(prefill)
    _check_refused_and_untouched(sender, base, key, pool)
    elsewhere = _dest(base, "other", [5, 6, 7], [key])  # decode's capability, aimed at another engine
    elsewhere.session = prefill.session
    with pytest.raises(KvTransferError, match="does not verify"):
        _write(sender, elsewhere, _handoff("other", 3.0))
    assert kv_capability.key_from_internal(None) is None and kv_capability.key_from_internal("other") != key


def test_tensor_parallel_ranks_send_their_keys_to_rank_0():
    """join_ranks: rank 0's destination names every rank, its keys sign each rank's capability."""

    class Rank0:
        rank = 0

        def all_gather_object(self, mine: bytes) -> list[bytes]:
            other = bytes([32]) + b"k" * 32 + prefill_pb2.KvRankDestination(session="shm:1").SerializeToString()
            return [mine, other]

    receiver = PoolReceiver.__new__(PoolReceiver)
    receiver.destination = prefill_pb2.KvDestination(session="shm:0")
    receiver.keys = [b"j" * 32]
    join_ranks(Rank0(), receiver, range(0, 1))
    assert receiver.keys == [b"j" * 32, b"k" * 32]
    assert [r.session for r in receiver.destination.tp_ranks] == ["shm:0", "shm:1"]
    dest = prefill_pb2.KvDestination()
    dest.CopyFrom(receiver.destination)
    kv_capability.sign(dest, "r", receiver.keys, 60)
    verifier = kv_capability.Verifier()
    for rank, key in zip(dest.tp_ranks, receiver.keys):
        verifier.check(key, "r", rank, dest.runs)
    with pytest.raises(CapabilityRefused, match="does not verify"):  # rank 1's capability is not rank 0's
        verifier.check(receiver.keys[0], "r", dest.tp_ranks[1], dest.runs)


def test_a_stranger_calling_prefill_with_decodes_pool_files_is_refused(checkpoint):
    """End to end: any local process can read decode's pool file names and call prefill. It names
    decode's real session and regions with slots it does not own; prefill refuses, no byte changes."""
    pair = GrpcPair(checkpoint("qwen2"), transfer="shm")
    channel = grpc.insecure_channel(pair.prefill.address)
    try:
        pool = pair.decode.runner.kv_pool
        before = pool.k_all.clone(), pool.v_all.clone()
        dest = prefill_pb2.KvDestination()
        dest.CopyFrom(pair.decode.kv_receiver.destination)
        dest.runs.extend(plan.slot_runs([1, 2, 3, 4]))
        stub = prefill_pb2_grpc.PrefillStub(channel)
        request = prefill_pb2.PrefillRequest(request_id="stranger", input_ids=[5, 6, 7, 8], kv_destination=dest)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Prefill(request, timeout=60))
        assert "no valid capability" in refused.value.details()
        assert torch.equal(pool.k_all, before[0]) and torch.equal(pool.v_all, before[1])
        pair.check_against_oracle(checkpoint("qwen2"), [[5, 6, 7, 8]], 4)  # decode's own calls still land
        assert pair.prefill.kv_notices > 0
    finally:
        channel.close()
        pair.close()


def test_a_mooncake_pair_with_an_internal_key_signs_every_destination(checkpoint):
    """The honest path with a key: decode derives the same key as prefill and its handoffs land."""
    path = checkpoint("qwen2")
    keyed = dict(internal_api_key="internal-key")
    pair = GrpcPair(path, transfer="mooncake", prefill_kw=keyed, decode_kw=keyed)
    try:
        key = kv_capability.key_from_internal("internal-key")
        assert pair.prefill.sender.transfer_engine.capability_key("any") == key
        assert pair.decode.kv_receiver.keys == [key]
        pair.check_against_oracle(path, [[5, 6, 7, 8], list(range(9, 40))], 6)
        assert pair.prefill.kv_notices > 0  # written through the engine, each write's destination verified
    finally:
        pair.close()
