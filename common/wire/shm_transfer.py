"""Same-host KV handoff through shared memory (--disaggregation-transfer-backend shm).

The decode service's KV pools live in files of a shared-memory folder (default /dev/shm, a tmpfs),
so a prefill replica on the same host maps them and copies each handoff's K and V straight into
the reserved slots: one memory copy per byte, where the gRPC path copies a handoff about eight
times (stack, encode, serialize, transport, parse, decode, write) and runs them on the cores both
services share. Everything else is the transfer-engine path (prefill_service/kv_writer.py): the
same destination (per-layer addresses and slot runs), the same `KvWritten` notices and the same
quiesce on early ends. `ShmEndpoint` and `ShmWriter` have the methods of
`mooncake.TransferEngine` that path uses.

- decode: its pools' buffers are files `disagg-kv-<pid>-<random>` (common/engine/shared_memory.py:
  mode 0600, room taken at once, removed with the pool; a start sweeps those of processes that are
  gone). `ShmEndpoint(files)` names the files and where they are mapped in its session:
  `shm:` + JSON [[path, base address, bytes], ...].
- prefill: `ShmWriter(folder)` maps a session's files on first use (only regular files of that
  folder named as above, owned by this user, of the size the session says) and checks every write
  lies inside one of them. A session it cannot map (decode on another host) gets bytes instead.
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

from common.engine.shared_memory import NAME as _NAME

logger = logging.getLogger(__name__)
SESSION_PREFIX = "shm:"


class ShmTransferError(RuntimeError):
    """A session or a write that this writer refuses (the message says why)."""


class ShmEndpoint:
    """The decode side: its pools' files as a session. `register` checks that tensors lie in them."""

    def __init__(self, segments: list[tuple[str, torch.Tensor]]):
        """`segments`: (file path, the whole tensor mapped from it) of each shared pool buffer."""
        self.segments = [(path, t.data_ptr(), t.numel() * t.element_size()) for path, t in segments]
        self.session = SESSION_PREFIX + json.dumps(self.segments)

    def register(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            start, n = t.data_ptr(), t.numel() * t.element_size()
            if not any(base <= start and start + n <= base + size for _, base, size in self.segments):
                raise ShmTransferError("a tensor to receive KV is not in a shared-memory pool file")

    def unregister(self, tensors: list[torch.Tensor]) -> None:
        pass


class ShmWriter:
    """The prefill side: writes local memory into the decode side's pool files, mapped on first use."""

    def __init__(self, folder: str = "/dev/shm"):
        self.folder = os.path.realpath(folder)
        self._maps: dict[str, tuple[mmap.mmap, ctypes.c_char, int]] = {}  # path -> (map, its first byte, size)
        self._lock = threading.Lock()
        self._refused: set[str] = set()

    def register(self, tensors: list[torch.Tensor]) -> None:
        pass

    def unregister(self, tensors: list[torch.Tensor]) -> None:
        pass

    def reaches(self, session: str) -> bool:
        """Whether this writer can map the session's files (a decode side on this host, in our folder);
        if not, the call sends its KV as bytes. The first refusal of a session is logged."""
        try:
            for path, _, size in self.parse(session):
                self._map(path, size)
        except ShmTransferError as e:
            if session not in self._refused:
                self._refused.add(session)
                logger.warning("shared-memory KV destination out of reach, sending bytes instead: %s", e)
            return False
        return True

    def write(self, session: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        """Copy each piece (local address, decode-side address, bytes); returns once all landed."""
        segments = [(base, size, self._map(path, size)) for path, base, size in self.parse(session)]
        for src, dst, n in zip(srcs, dsts, lens):
            for base, size, addr in segments:
                if base <= dst and dst + n <= base + size:
                    ctypes.memmove(addr + (dst - base), src, n)
                    break
            else:
                raise ShmTransferError(f"a write of {n} bytes at {dst:#x} falls outside the session's pool files")

    def parse(self, session: str) -> list[tuple[str, int, int]]:
        if not session.startswith(SESSION_PREFIX):
            raise ShmTransferError(f"not a shared-memory session: {session[:40]!r}")
        try:
            segments = [(str(p), int(b), int(s)) for p, b, s in json.loads(session[len(SESSION_PREFIX) :])]
        except (ValueError, TypeError) as e:
            raise ShmTransferError(f"malformed shared-memory session: {e}") from e
        for path, _, size in segments:
            if os.path.dirname(path) != self.folder or not _NAME.match(os.path.basename(path)) or size <= 0:
                raise ShmTransferError(f"{path!r} is not a KV pool file of {self.folder}")
        return segments

    def _map(self, path: str, size: int) -> int:
        """The address of `path` mapped here (checked: a regular file of ours, of `size` bytes)."""
        with self._lock:
            if path in self._maps and self._maps[path][2] == size:
                return ctypes.addressof(self._maps[path][1])
            for gone in [p for p in self._maps if p == path or not os.path.exists(p)]:
                self._unmap(gone)  # a decode service that stopped: its pool's memory goes with our map
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            except OSError as e:
                raise ShmTransferError(f"cannot open the decode side's pool file {path}: {e}") from e
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != size:
                    raise ShmTransferError(f"{path} is not this user's pool file of {size} bytes")
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            first = ctypes.c_char.from_buffer(mm)
            self._maps[path] = (mm, first, size)
            return ctypes.addressof(first)

    def _unmap(self, path: str) -> None:
        mm, first, _ = self._maps.pop(path)
        del first  # the map's export ends with its last reference
        mm.close()

    def close(self) -> None:
        """Unmap every file (the decode side keeps its pools)."""
        with self._lock:
            for path in list(self._maps):
                self._unmap(path)
