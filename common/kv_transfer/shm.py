"""The shared-memory backend (--disaggregation-transfer-backend shm): a same-host, CPU-only KV handoff.

The decode service's KV pools live in files of a shared-memory folder (default /dev/shm, a tmpfs),
so a prefill replica on the same host maps them and copies each handoff's K and V straight into
the reserved slots: one memory copy per byte, where the gRPC path copies a handoff about eight
times (stack, encode, serialize, transport, parse, decode, write) and runs them on the cores both
services share. Everything else is the address-writing path (address_writes.py, plan.py): the
same destination (per-layer addresses and slot runs), the same `KvWritten` notices and the same
quiesce on early ends. The KV is staged in host memory (memmove reads it).

- decode (`ShmReceiver`): its pools' buffers are files `disagg-kv-<pid>-<random>`
  (shm_files.py: mode 0600, room taken at once, locked while alive, removed with
  the pool; a start sweeps those nobody holds; a trailer past the buffer holds the process's
  secret). `ShmEndpoint(files)` names the files and where they are mapped in its session: `shm:` +
  JSON [[path, base address, bytes], ...]; its `key` (the files' secret) signs each call's
  destination (common/wire/kv_capability.py).
- prefill (`ShmSender`): `ShmWriter(folder)` maps a session's files on first use (only regular files
  of that folder named as above, with one link, owned by this user, of the size the session says
  plus the trailer), checks every write lies inside one of them (the trailer is never mapped), and
  unmaps a file its decode side removed once no write uses it. A session it cannot map (decode on
  another host) gets bytes instead. `capability_key(session)` is the secret its files hold: each
  destination's capability is checked with it before anything is written.
Only the two processes' user can open the files. Separate containers need a shared /dev/shm
(compose: `ipc: shareable` on decode, `ipc: "service:decode"` on prefill).
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import stat
import threading

import torch

from common.kv_transfer import shm_files
from common.kv_transfer.address_writes import AddressSender, PoolReceiver
from common.kv_transfer.errors import KvTransferError
from common.kv_transfer.shm_files import NAME as _NAME
from common.wire import kv_capability
from common.wire.kv_capability import Verifier

logger = logging.getLogger(__name__)
LABEL = "shm"
SESSION_PREFIX = "shm:"


class ShmTransferError(KvTransferError):
    """A session or a write that this writer refuses (the message says why)."""


def _inside(base: int, size: int, start: int, n: int) -> bool:
    return base <= start and start + n <= base + size


class ShmEndpoint:
    """The decode side: its pools' files as a session. `register` checks that tensors lie in them."""

    def __init__(self, segments: list[tuple[str, torch.Tensor]]):
        """`segments`: (file path, the whole tensor mapped from it) of each shared pool buffer."""
        self.segments = [(path, t.data_ptr(), t.numel() * t.element_size()) for path, t in segments]
        self.session = SESSION_PREFIX + json.dumps(self.segments)
        self.key = _secret_of([(path, size) for path, _, size in self.segments])

    def register(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            start, n = t.data_ptr(), t.numel() * t.element_size()
            if not any(_inside(base, size, start, n) for _, base, size in self.segments):
                raise ShmTransferError("a tensor to receive KV is not in a shared-memory pool file")

    def unregister(self, tensors: list[torch.Tensor]) -> None:
        pass


class _Mapped:
    """One pool file mapped here; `users`: writes in progress (it is unmapped only at 0)."""

    def __init__(self, mm: mmap.mmap, size: int, inode: int, secret: bytes):
        self.mm, self.size, self.inode, self.secret, self.users = mm, size, inode, secret, 0
        self.first = ctypes.c_char.from_buffer(mm)  # held: the map cannot close under a write
        self.addr = ctypes.addressof(self.first)

    def close(self) -> None:
        del self.first  # the export ends with its last reference
        self.mm.close()


class ShmWriter:
    """The prefill side: writes local memory into the decode side's pool files, mapped on first use
    and kept while they exist. A file its decode side removed (it stopped) is unmapped once no write
    uses it, within PRUNE_S: our map would otherwise keep its memory, and the room a restarted
    decode side needs."""

    PRUNE_S = 1.0
    MAX_SESSION = 1 << 16  # bytes: a few paths, not more

    def __init__(self, folder: str = "/dev/shm"):
        self.folder = os.path.realpath(folder)
        self._maps: dict[str, _Mapped] = {}
        self._lock = threading.Lock()
        self._refused: set[str] = set()  # sessions whose refusal was logged (bounded)
        self._closed = threading.Event()
        self._pruner: threading.Thread | None = None
        self.capabilities = Verifier()  # the capabilities of destinations in our decode sides' files

    def register(self, tensors: list[torch.Tensor]) -> None:
        pass

    def unregister(self, tensors: list[torch.Tensor]) -> None:
        pass

    def reaches(self, session: str) -> bool:
        """Whether this writer can map the session's files (a decode side on this host, in our folder);
        if not, the call sends its KV as bytes. A session's first refusal is logged."""
        try:
            self._release(self._acquire(session))
        except ShmTransferError as e:
            if session not in self._refused:
                if len(self._refused) >= 64:
                    self._refused.clear()
                self._refused.add(session)
                logger.warning("shared-memory KV destination out of reach, sending bytes instead: %s", e)
            return False
        return True

    def write(self, session: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        """Copy each piece (local address, decode-side address, bytes); returns once all landed."""
        held = self._acquire(session)
        try:
            for src, dst, n in zip(srcs, dsts, lens):
                for base, m in held:
                    if _inside(base, m.size, dst, n):
                        ctypes.memmove(m.addr + (dst - base), src, n)
                        break
                else:
                    raise ShmTransferError(f"a write of {n} bytes at {dst:#x} falls outside the session's pool files")
        finally:
            self._release(held)

    def capability_key(self, session: str) -> bytes:
        """The secret the session's files hold (their decode process's): the key of its capabilities."""
        held = self._acquire(session)
        try:
            keys = {m.secret for _, m in held}
        finally:
            self._release(held)
        if len(keys) != 1:
            raise ShmTransferError("the session's pool files are not one decode process's (their secrets differ)")
        return keys.pop()

    def parse(self, session: str) -> list[tuple[str, int, int]]:
        if not session.startswith(SESSION_PREFIX) or len(session) > self.MAX_SESSION:
            raise ShmTransferError(f"not a shared-memory session: {session[:40]!r}")
        try:
            segments = [(str(p), int(b), int(s)) for p, b, s in json.loads(session[len(SESSION_PREFIX) :])]
        except Exception as e:  # noqa: BLE001 (anything a caller's JSON can raise: a refusal, not a crash)
            raise ShmTransferError(f"malformed shared-memory session: {e!r}"[:200]) from e
        if not segments:
            raise ShmTransferError("the shared-memory session names no pool file")
        for path, base, size in segments:
            if os.path.dirname(path) != self.folder or not _NAME.fullmatch(os.path.basename(path)):
                raise ShmTransferError(f"{path!r} is not a KV pool file of {self.folder}")
            if base < 0 or size <= 0:
                raise ShmTransferError(f"{path!r}: bad extent {base}+{size}")
        return segments

    def _acquire(self, session: str) -> list[tuple[int, _Mapped]]:
        """(decode-side base address, its map) of each of the session's files, each held by us."""
        segments = self.parse(session)
        held: list[tuple[int, _Mapped]] = []
        with self._lock:
            try:
                for path, base, size in segments:
                    m = self._maps.get(path) or self._open(path, size)
                    if m.size != size:  # refused, and the map stays: a write may be using it
                        raise ShmTransferError(f"{path} is mapped here with {m.size} bytes, the session says {size}")
                    m.users += 1
                    held.append((base, m))
            except BaseException:
                self._release_locked(held)
                raise
        return held

    def _release(self, held: list[tuple[int, _Mapped]]) -> None:
        with self._lock:
            self._release_locked(held)

    def _release_locked(self, held: list[tuple[int, _Mapped]]) -> None:
        for _, m in held:
            m.users -= 1
        self._prune_locked()

    def _open(self, path: str, size: int) -> _Mapped:
        """Map `path` (checked: a regular file of ours with one name, of `size` bytes); lock held."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise ShmTransferError(f"cannot open the decode side's pool file {path}: {e}") from e
        try:
            st = os.fstat(fd)
            whole = size + shm_files.TRAILER
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1 or st.st_size != whole:
                raise ShmTransferError(f"{path} is not this user's pool file of {size} bytes")
            secret = shm_files.read_secret(fd, size)
            if secret is None:
                raise ShmTransferError(f"{path} holds no decode secret: not a pool file of this version")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)  # the trailer stays out
            m = _Mapped(mm, size, st.st_ino, secret)
        finally:
            os.close(fd)
        self._maps[path] = m
        if self._pruner is None:
            self._pruner = threading.Thread(target=self._prune_loop, name="shm-prune", daemon=True)
            self._pruner.start()
        return m

    def _prune_locked(self) -> None:
        for path, m in list(self._maps.items()):
            if m.users == 0 and _inode(path) != m.inode:  # its decode side removed it
                del self._maps[path]
                m.close()

    def _prune_loop(self) -> None:
        while not self._closed.wait(self.PRUNE_S):
            with self._lock:
                self._prune_locked()

    def close(self) -> None:
        """Unmap every file no write is using (the decode side keeps its pools)."""
        self._closed.set()
        with self._lock:
            for path, m in list(self._maps.items()):
                if m.users == 0:
                    del self._maps[path]
                    m.close()


def _secret_of(files: list[tuple[str, int]]) -> bytes:
    """The secret that every one of these (path, buffer bytes) pool files holds."""
    keys = set()
    for path, size in files:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            keys.add(shm_files.read_secret(fd, size))
        finally:
            os.close(fd)
    if len(keys) != 1 or None in keys:
        raise ShmTransferError("the pool files do not hold one secret (made by common/kv_transfer/shm_files.py?)")
    return keys.pop()


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


class ShmSender(AddressSender):
    label = LABEL

    def __init__(self, writer: ShmWriter):
        self.writer = writer

    @classmethod
    def from_config(cls, config) -> ShmSender:
        one_host(config)
        return cls(ShmWriter(config.disaggregation_shm_dir))

    def reaches(self, dest) -> bool:
        """Every target is a session of pool files this writer maps (a decode side on this host, in
        our folder); else the call's KV goes as bytes."""
        sessions = [r.session for r in kv_capability.ranks(dest)]
        return all(s.startswith(SESSION_PREFIX) and self.writer.reaches(s) for s in sessions)


class ShmReceiver(PoolReceiver):
    @staticmethod
    def pool_memory(config):
        """The pools are files of the shared-memory folder, which a prefill replica maps."""
        return shm_files.allocator(config.disaggregation_shm_dir)

    @staticmethod
    def check(config) -> None:
        """Pools off the CPU cannot be shared files (on GPUs the KV stays in device memory: use mooncake)."""
        if config.device != "cpu":
            raise ValueError(shm_files.CPU_ONLY)
        one_host(config)

    @classmethod
    def from_config(cls, runner, config) -> ShmReceiver:
        pools = [runner.kv_pool] + ([runner.draft.kv_pool] if runner.draft is not None else [])
        files = [f for pool in pools for f in pool.files]
        if not files:
            raise ValueError("the shm backend needs KV pools in shared-memory files (RunnerArgs.kv_allocate)")
        endpoint = ShmEndpoint(files)
        return cls(runner, endpoint, endpoint.key)


def one_host(config) -> None:
    """Shared-memory files reach one host's processes: a service spread over nodes cannot use them."""
    if getattr(config, "nnodes", 1) > 1:
        raise ValueError("--disaggregation-transfer-backend shm is one host's: not with --nnodes > 1")
