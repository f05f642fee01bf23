"""The same-host shared-memory handoff (common/engine/shm_files.py, common/kv_transfer/shm.py):
pool files, what a prefill replica agrees to map and write, and each sender's choice between writing
and gRPC bytes (`reaches`)."""

from __future__ import annotations

import gc
import json
import os
import stat

import pytest
import torch

from common.engine.kv_pool import KVPool
from common.kv_transfer import grpc_bytes, mooncake, shm, shm_files
from common.wire.proto_gen import prefill_pb2


def _pool_files(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(shm_files.PREFIX))


def test_a_shared_pool_is_private_zeroed_files_that_a_writer_fills_and_that_go_with_the_pool(tmp_path):
    pool = KVPool(10, 3, 2, 4, torch.float32, allocate=shm_files.allocator(str(tmp_path)))
    names = _pool_files(tmp_path)
    assert len(names) == 2 and sorted(os.path.basename(p) for p, _ in pool.files) == names
    assert {p for p, _ in pool.files} == {str(tmp_path / n) for n in names}
    for path, buffer in pool.files:
        assert (
            stat.S_IMODE(os.stat(path).st_mode) == 0o600
            and os.path.getsize(path) == buffer.numel() * 4 + shm_files.TRAILER
        )
    del buffer
    assert not pool.k_all.any() and pool.k[1].data_ptr() == pool.k_all[1].data_ptr()

    endpoint = shm.ShmEndpoint(pool.files)
    endpoint.register(pool.k + pool.v)  # every layer lies in the files
    with pytest.raises(shm.ShmTransferError, match="not in a shared-memory pool file"):
        endpoint.register([torch.zeros(4)])

    # the prefill side: layer 1, slots 3..4 of K, by the decode side's addresses
    src = torch.arange(16, dtype=torch.float32).view(2, 2, 4)
    dst = pool.k[1][3].data_ptr()
    writer = shm.ShmWriter(str(tmp_path))
    writer.write(endpoint.session, [src.data_ptr()], [dst], [src.numel() * 4])
    assert torch.equal(pool.k_all[1, 3:5], src) and pool.k_all.sum() == src.sum()
    writer.close()

    del pool, endpoint
    gc.collect()
    assert _pool_files(tmp_path) == []  # unlinked with the pool


def test_a_writer_refuses_sessions_and_writes_outside_a_pool_file_of_its_folder(tmp_path):
    folder = tmp_path / "shm"
    folder.mkdir()
    pool = KVPool(4, 1, 1, 4, torch.float32, allocate=shm_files.allocator(str(folder)))
    session = shm.ShmEndpoint(pool.files).session
    writer = shm.ShmWriter(str(folder))
    (path, k_all), (_, v_all) = pool.files
    src = torch.ones(4)
    refused = {
        "127.0.0.1:1234": "not a shared-memory session",
        "shm:[[1, 2": "malformed",
        "shm:" + json.dumps([[str(tmp_path / "x"), k_all.data_ptr(), 80]]): "is not a KV pool file",
        "shm:" + json.dumps([[str(folder / "other-file"), k_all.data_ptr(), 80]]): "is not a KV pool file",
        "shm:" + json.dumps([[path, k_all.data_ptr(), 64]]): "of 64 bytes",  # not the file's size
    }
    for bad, why in refused.items():
        with pytest.raises(shm.ShmTransferError, match=why):
            writer.write(bad, [src.data_ptr()], [k_all.data_ptr()], [16])
    link = folder / f"{shm_files.PREFIX}{os.getpid()}-abc"
    os.symlink(path, link)
    with pytest.raises(shm.ShmTransferError, match="cannot open"):  # a link is not followed
        writer.write(
            "shm:" + json.dumps([[str(link), k_all.data_ptr(), 80]]), [src.data_ptr()], [k_all.data_ptr()], [16]
        )
    end = k_all.data_ptr() + k_all.numel() * 4
    for dst, n in ((end - 8, 16), (v_all.data_ptr() - 4, 8), (k_all.data_ptr() - 16, 16)):
        with pytest.raises(shm.ShmTransferError, match="falls outside"):
            writer.write(session, [src.data_ptr()], [dst], [n])
    assert not k_all.any() and not v_all.any()  # nothing was written
    writer.write(session, [src.data_ptr()], [end - 16], [16])  # the last 16 bytes are in
    assert k_all.view(-1)[-4:].tolist() == [1.0] * 4


def test_a_writer_lets_go_of_a_stopped_decode_sides_files(tmp_path):
    writer = shm.ShmWriter(str(tmp_path))
    src = torch.ones(4)
    old = KVPool(4, 1, 1, 4, torch.float32, allocate=shm_files.allocator(str(tmp_path)))
    writer.write(shm.ShmEndpoint(old.files).session, [src.data_ptr()], [old.k_all.data_ptr()], [16])
    first = old.files[0][0]
    assert first in writer._maps
    del old
    gc.collect()  # that decode service stopped: its files are gone, our map still holds the memory
    new = KVPool(4, 1, 1, 4, torch.float32, allocate=shm_files.allocator(str(tmp_path)))
    writer.write(shm.ShmEndpoint(new.files).session, [src.data_ptr()], [new.k_all.data_ptr()], [16])
    assert first not in writer._maps and set(writer._maps) == {p for p, _ in new.files}


def test_a_start_sweeps_pool_files_that_no_process_holds(tmp_path):
    """A live buffer's process holds a lock on its file; a crash leaves files nobody holds. The pid in
    the name decides nothing (pids repeat across containers and restarts)."""
    live = KVPool(4, 1, 1, 4, torch.float32, allocate=shm_files.allocator(str(tmp_path)))
    stale = tmp_path / f"{shm_files.PREFIX}{os.getpid()}-00ff"  # our own pid, but nobody holds it
    other = tmp_path / "someone-elses-file"
    for f in (stale, other):
        f.write_bytes(b"x")
    held = [os.path.basename(p) for p, _ in live.files]
    assert shm_files.sweep(str(tmp_path)) == [str(stale)]
    assert sorted(os.listdir(tmp_path)) == sorted([*held, other.name])
    shm_files.release_all()  # what a service ending with os._exit does: the files go, the pool stays
    assert sorted(os.listdir(tmp_path)) == [other.name]
    live.k_all += 1
    assert live.k_all.sum() == live.k_all.numel()


def test_a_pool_that_does_not_fit_the_folder_is_refused_at_once(tmp_path, monkeypatch):
    """tmpfs hands out pages on first touch: a pool larger than its room would kill the service
    (SIGBUS) on some later write, so the room is taken when the pool is made."""

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(shm_files.SharedMemoryFull, match="MiB free .*--shm-size"):
        KVPool(4, 1, 1, 4, torch.float32, allocate=shm_files.allocator(str(tmp_path)))
    assert _pool_files(tmp_path) == []


def test_shared_pools_are_for_cpu(checkpoint):
    from decode_service.config import DecodeConfig
    from decode_service.server import DecodeService

    with pytest.raises(ValueError, match="host memory: the pool's device must be the CPU"):
        KVPool(4, 1, 1, 4, torch.float32, device="meta", allocate=shm_files.allocator("/dev/shm"))
    config = DecodeConfig(checkpoint("qwen2"), port=0, device="cuda", disaggregation_transfer_backend="shm")
    with pytest.raises(ValueError, match="for CPU services on one host"):  # before any model loads
        DecodeService(config)


def test_a_replica_writes_only_where_its_sender_reaches_else_sends_bytes(tmp_path):
    pool = KVPool(4, 1, 1, 4, torch.float32, allocate=shm_files.allocator(str(tmp_path)))
    session = shm.ShmEndpoint(pool.files).session
    local = prefill_pb2.KvDestination(session=session)
    other = prefill_pb2.KvDestination(session="127.0.0.1:1234")
    tp_local = prefill_pb2.KvDestination(tp_ranks=[prefill_pb2.KvRankDestination(session=session)] * 2)
    elsewhere = prefill_pb2.KvDestination(session=session.replace(shm_files.PREFIX, shm_files.PREFIX + "1"))
    sender = shm.ShmSender(shm.ShmWriter(str(tmp_path)))
    assert sender.reaches(local) and sender.reaches(tp_local) and not sender.reaches(other)
    assert not sender.reaches(elsewhere)  # files this host does not have: decode gets bytes
    assert not shm.ShmSender(shm.ShmWriter(str(tmp_path / "other"))).reaches(local)  # not our folder
    assert not grpc_bytes.BytesSender().reaches(local) and not grpc_bytes.BytesSender().reaches(other)
    assert mooncake.is_session("127.0.0.1:1234") and mooncake.is_session("::1:80") and not mooncake.is_session(session)
    if mooncake.available() is None:
        moon = mooncake.MooncakeSender(mooncake.TransferEngine())
        assert moon.reaches(other) and not moon.reaches(local) and not moon.reaches(tp_local)


def test_a_malformed_or_oversized_session_is_a_refusal_not_a_crash(tmp_path):
    writer = shm.ShmWriter(str(tmp_path))
    for bad in ('shm:[["x", Infinity, 1]]', "shm:" + "[" * 100_000, "shm:" + "[" * 5000 + "]" * 5000, "shm:{}"):
        with pytest.raises(shm.ShmTransferError):
            writer.parse(bad)
        assert not writer.reaches(bad)


def test_a_hard_link_to_a_pool_file_is_not_a_pool_file(tmp_path):
    pool = KVPool(4, 1, 1, 4, torch.float32, allocate=shm_files.allocator(str(tmp_path)))
    (path, k_all), _ = pool.files
    link = tmp_path / f"{shm_files.PREFIX}1-abc"
    os.link(path, link)
    session = "shm:" + json.dumps([[str(link), k_all.data_ptr(), k_all.numel() * 4]])
    assert not shm.ShmWriter(str(tmp_path)).reaches(session)


def test_a_map_in_use_is_never_unmapped_under_a_write(tmp_path):
    """A caller's session naming a mapped file with another size is refused without touching the map;
    a file whose decode side went away is unmapped only once no write holds it."""
    writer = shm.ShmWriter(str(tmp_path))
    pool = KVPool(4, 1, 1, 4, torch.float32, allocate=shm_files.allocator(str(tmp_path)))
    session = shm.ShmEndpoint(pool.files).session
    (path, k_all), _ = pool.files
    src = torch.full((4,), 7.0)
    writer.write(session, [src.data_ptr()], [k_all.data_ptr()], [16])
    wrong = "shm:" + json.dumps([[path, k_all.data_ptr(), 64]])
    with pytest.raises(shm.ShmTransferError, match="mapped here with"):
        writer.write(wrong, [src.data_ptr()], [k_all.data_ptr()], [16])
    assert path in writer._maps
    held = writer._acquire(session)  # a write in progress
    del pool, k_all
    gc.collect()  # the decode side went away: its files are removed
    writer._release([])  # a prune while the write holds the maps
    assert path in writer._maps
    writer._release(held)
    assert path not in writer._maps
