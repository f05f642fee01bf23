"""KV pool buffers as files of a shared-memory folder (the shm handoff, shm.py beside this file).

A buffer is a file `disagg-kv-<pid>-<random>` (mode 0600) mapped shared: a prefill replica on the
same host maps the same file and writes handoffs straight into the pool.
- Its room is taken when it is made: tmpfs hands out pages on first touch, so a full folder would
  otherwise kill the service with SIGBUS on some later write.
- Its process holds a shared lock (flock) on it while the buffer lives. The first buffer made in a
  folder removes this user's files there that nobody holds: left by a crash. A lock, not the pid in
  the name, tells: pids repeat across containers and restarts.
- The file is removed when the buffer is collected, at exit, or by `release_all()` (a service that
  ends with os._exit, which skips exit handlers).
- Past the buffer, a trailer of TRAILER bytes holds MAGIC and this process's secret (random, made once):
  the key of the write capabilities its decode side signs (common/wire/kv_capability.py). The file's
  mode keeps it from other users; the tensor, and a writer's map, end before it.
"""

from __future__ import annotations

import fcntl
import functools
import os
import re
import secrets
import stat
import weakref

import torch

PREFIX = "disagg-kv-"
NAME = re.compile(rf"{PREFIX}[0-9]+-[0-9a-f]+")  # re.fullmatch
CPU_ONLY = "--disaggregation-transfer-backend shm is for CPU services on one host (on GPUs: mooncake)"
MAGIC = b"disagg-kv-secret"
SECRET_BYTES = 32
TRAILER = len(MAGIC) + SECRET_BYTES  # bytes past the buffer
_secret = secrets.token_bytes(SECRET_BYTES)  # this process's: every buffer file it makes holds it
_swept: set[str] = set()
_live: list[weakref.finalize] = []  # one per buffer made here: closes its lock, removes its file


class SharedMemoryFull(RuntimeError):
    """The folder has no room for the buffer (the message says what to change)."""


def allocator(folder: str):
    """`allocate` in `folder`: what a KVPool makes its buffers with (KVPool's `allocate`)."""
    return functools.partial(allocate, folder)


def allocate(folder: str, shape: tuple, dtype: torch.dtype) -> tuple[str, torch.Tensor]:
    """A zeroed tensor whose memory is a new file in `folder`: (file path, tensor)."""
    folder = os.path.realpath(folder)
    if folder not in _swept:
        sweep(folder)
        _swept.add(folder)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    path = os.path.join(folder, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            os.posix_fallocate(fd, 0, nbytes + TRAILER)
        except OSError as e:
            raise SharedMemoryFull(
                f"the KV pool needs {nbytes >> 20} MiB in {folder}, which has {_free_mib(folder)} MiB free "
                f"({e.strerror}): give it more (docker: --shm-size), lower --max-total-tokens, or name another "
                "--disaggregation-shm-dir"
            ) from e
        if os.pwrite(fd, MAGIC + _secret, nbytes) != TRAILER:
            raise OSError(f"could not write the trailer of {path}")
        t = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    except BaseException:
        _remove(path, fd)
        raise
    _live.append(weakref.finalize(t.untyped_storage(), _remove, path, fd))
    return path, t


def read_secret(fd: int, nbytes: int) -> bytes | None:
    """The secret in the trailer of a buffer file of `nbytes` (open as `fd`), or None if it has none."""
    trailer = os.pread(fd, TRAILER, nbytes)
    if len(trailer) != TRAILER or not trailer.startswith(MAGIC):
        return None
    return trailer[len(MAGIC) :]


def release_all() -> None:
    """Remove every buffer file this process made (its tensors stay mapped until they go)."""
    while _live:
        _live.pop()()


def _free_mib(folder: str) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return -1
    return (st.f_bavail * st.f_frsize) >> 20


def _remove(path: str, fd: int | None = None) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    if fd is not None:
        os.close(fd)


def sweep(folder: str) -> list[str]:
    """Remove this user's buffer files in `folder` that no process holds; the removed paths. Anything
    named like one that is not a regular file (a FIFO anyone can make there, a link, a device) is
    skipped without being opened; the open cannot block (O_NONBLOCK) if one is swapped in meanwhile."""
    removed = []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return removed
    for name in names:
        if not NAME.fullmatch(name):
            continue
        path = os.path.join(folder, name)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live buffer
            continue
        finally:
            os.close(fd)
        _remove(path)
        removed.append(path)
    return removed
