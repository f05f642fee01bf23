"""Issue 37, item 2: the tensor-parallel group opens no code or memory to the network.

The store and gloo listen on the host they are given only, a process without the launch's key can
neither join nor slip a value or a message in, and messages never run code when read."""

from __future__ import annotations

import datetime
import io
import json
import os
import socket
import struct
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.parallel import launch, tp_auth, tp_codec
from common.parallel.tp_group import TPGroup
from tests.tp_harness import run_ranks


def _listening_addresses(pid: int | str = "self") -> list[tuple[str, int]]:
    """(address, port) of every TCP socket of process `pid` in LISTEN state, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    addr, port = local.split(":")
                    raw = bytes.fromhex(addr)
                    if table == "tcp":
                        host = socket.inet_ntop(socket.AF_INET, raw[::-1])
                    else:  # four little-endian 32-bit words
                        host = socket.inet_ntop(
                            socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                        )
                    out.append((host, int(port, 16)))
    return out


def _my_listeners(tp: TPGroup) -> list:
    return _listening_addresses()


def test_every_listener_of_the_group_is_on_the_host_it_was_given():
    """Rank 0 hosts the store and each rank a gloo listener: all on 127.0.0.1, none on every
    interface (0.0.0.0 / ::) or this host's network address."""
    per_rank = run_ranks(_my_listeners, 2)
    assert per_rank[0], "rank 0 should listen (the store and gloo)"
    for rank, listeners in enumerate(per_rank):
        assert listeners and all(host == "127.0.0.1" for host, _ in listeners), (rank, listeners)


def test_the_port_is_reserved_before_anyone_joins_and_held_by_the_group():
    """tp_auth.listen holds the port (no bind-and-release race): a second bind on it fails."""
    sock = tp_auth.listen("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert _listening_addresses().count(("127.0.0.1", port)) == 1
        with pytest.raises(OSError, match="--tp-port"):
            tp_auth.listen("127.0.0.1", port)
    finally:
        sock.close()


class _Evil:
    """Under pickle, reading this object calls os.mkdir(path): code run by whoever sends it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _torch_save(obj) -> bytearray:
    f = io.BytesIO()
    torch.save(obj, f)
    return bytearray(f.getvalue())


def _send_code(tp: TPGroup, path: str):
    if tp.rank == 0:
        from common.parallel import tp_group

        if hasattr(tp_group, "tp_codec"):  # a rank 0 that sends a pickle anyway, signed with the key
            tp_group.tp_codec.dumps = _torch_save
        tp.broadcast_object(_Evil(path))
        return "sent"
    try:
        return repr(tp.broadcast_object(None))
    except Exception as e:  # noqa: BLE001 (the refusal is the result)
        return f"refused: {type(e).__name__}: {e}"


def test_a_message_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    path = str(tmp_path / "ran")
    _, follower = run_ranks(_send_code, 2, path)
    assert not os.path.exists(path), "the message ran code on the receiving rank"
    assert follower.startswith("refused: ValueError: malformed TP message"), follower


def test_no_pickle_and_no_class_outside_the_allowlist_is_read(tmp_path):
    path = str(tmp_path / "ran")
    with pytest.raises(TypeError, match="cannot carry a tests.test_tp_security._Evil"):
        tp_codec.dumps(_Evil(path))  # the sender refuses it too
    with pytest.raises(ValueError, match="malformed TP message"):
        tp_codec.loads(_torch_save(_Evil(path)), torch.device("cpu"))
    crafted = json.dumps({"v": {"o": "os.system", "f": {}}, "t": []}).encode()
    with pytest.raises(ValueError, match="KeyError: 'os.system'"):
        tp_codec.loads(bytearray(struct.pack("<I", len(crafted)) + crafted), torch.device("cpu"))
    assert not os.path.exists(path)


def test_plain_messages_still_travel():
    from common.engine.handoff import HandoffRequest
    from common.engine.sampling import SamplingParams

    request = HandoffRequest("r1", [1, 2, 3], SamplingParams(stop_token_ids=(7,)), 5, kv_slots=torch.arange(3))
    data = tp_codec.dumps(("admit", request, {"n": 1.5}, None))
    kind, got, extra, none = tp_codec.loads(data, torch.device("cpu"))
    assert (kind, got.rid, got.prompt_ids, got.params, extra, none) == (
        "admit",
        "r1",
        [1, 2, 3],
        request.params,
        {"n": 1.5},
        None,
    )
    assert torch.equal(got.kv_slots, torch.arange(3))


def test_a_message_not_signed_with_the_key_is_refused():
    key = tp_auth.new_key().encode()
    blob = tp_auth.seal(key, "msg/1/0/all", b"payload")
    assert tp_auth.unseal(key, "msg/1/0/all", blob) == b"payload"
    forged = tp_auth.seal(b"a stranger's key", "msg/1/0/all", b"payload")
    altered = blob[:-1] + b"X"
    for bad, label in ((forged, "msg/1/0/all"), (altered, "msg/1/0/all"), (blob, "msg/2/0/all"), (blob, "msg/1/0/1")):
        with pytest.raises(PermissionError, match="not signed with this group's key"):
            tp_auth.unseal(key, label, bad)


def test_a_store_value_a_stranger_wrote_is_refused():
    """What gloo and NCCL read from the store (peer addresses) is only taken from the key's holders."""
    sock = tp_auth.listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    timeout = datetime.timedelta(seconds=30)
    raw = dist.TCPStore("127.0.0.1", port, None, True, timeout, False, master_listen_fd=sock.detach(), use_libuv=False)
    store = tp_auth.AuthStore(raw, tp_auth.new_key().encode())
    store.set("gloo/0/0", b"127.0.0.1:1234")
    assert store.get("gloo/0/0") == b"127.0.0.1:1234"
    stranger = dist.TCPStore("127.0.0.1", port, None, False, timeout, False)
    stranger.set("gloo/0/1", b"10.0.0.66:4444")  # a stranger's own address
    stranger.set("gloo/0/2", raw.get("gloo/0/0"))  # a valid value moved to another name
    for name in ("gloo/0/1", "gloo/0/2"):
        with pytest.raises(PermissionError):
            store.get(name)


def _join(rank: int, port: int, key: str, queue) -> None:
    try:
        TPGroup.init(rank, 2, f"tcp://127.0.0.1:{port}", key=key, timeout_s=60)
        queue.put("joined")
    except BaseException as e:  # noqa: BLE001 (reported to the test)
        queue.put(f"{type(e).__name__}: {e}")


def test_a_rank_without_the_key_cannot_join():
    """A stranger on the TP port (here: a rank with another key) is refused by rank 0 before any
    process group forms; it fails too (told so, or seeing rank 0's store close)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    sock = tp_auth.listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    stranger = ctx.Process(target=_join, args=(1, port, tp_auth.new_key(), queue), daemon=True)
    stranger.start()
    try:
        with pytest.raises(PermissionError, match="rank 1 does not hold this launch's key"):
            TPGroup.init(0, 2, f"tcp://127.0.0.1:{port}", key=tp_auth.new_key(), listener=sock, timeout_s=60)
        assert queue.get(timeout=60) != "joined"
    finally:
        stranger.join(timeout=10)
        if stranger.is_alive():
            stranger.kill()


def _follower(config, tp: TPGroup) -> None:
    tp.broadcast_object(None)  # rank 0's "stop"


class _Config:
    tp_size, tp_port, device = 2, 0, "cpu"


def test_the_key_reaches_the_followers_off_the_command_line_and_environment():
    ranks = launch.TPRanks.start(_Config(), _follower, "decode")
    try:
        key = ranks.tp.key
        assert len(key) == 64 and key not in repr(ranks.tp).encode()
        for p in ranks.procs:
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                assert key not in f.read()
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                assert key not in f.read()
            assert all(host == "127.0.0.1" for host, _ in _listening_addresses(p.pid))
        ranks.tp.broadcast_object(("stop",))
    finally:
        ranks.stop()
    assert [p.exitcode for p in ranks.procs] == [0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def _store_after_forming(tp: TPGroup):
    """(whether a new connection to the store is refused, a collective, the store over the ranks' own
    connections) on a formed group."""
    try:
        socket.create_connection(("127.0.0.1", tp.store.inner.port), timeout=10).close()
        refused = False
    except ConnectionRefusedError:
        refused = True
    x = torch.full((2,), float(tp.rank + 1))
    tp.all_reduce(x)
    tp.store.set(f"late/{tp.rank}", b"ok")
    tp.store.wait([f"late/{1 - tp.rank}"])
    return refused, x.tolist(), tp.store.get(f"late/{1 - tp.rank}")


def test_the_store_takes_no_new_connection_once_the_group_formed():
    """A stranger reaching the TP port after the group formed is refused at connect (it can neither read
    the store nor fill rank 0's memory); the ranks' collectives and their own store connections work."""
    for rank, (refused, summed, late) in enumerate(run_ranks(_store_after_forming, 2)):
        assert refused, f"rank {rank}: the store still takes connections"
        assert summed == [3.0, 3.0] and late == b"ok", rank
