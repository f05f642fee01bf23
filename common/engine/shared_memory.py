"""KV pool buffers as files of a shared-memory folder (the shm handoff, common/wire/shm_transfer.py).

A buffer is a file `disagg-kv-<pid>-<random>` (mode 0600) mapped shared: a prefill replica on the
same host maps the same file and writes handoffs straight into the pool.
- Its room is taken when it is made: tmpfs hands out pages on first touch, so a full folder would
  otherwise kill the service with SIGBUS on some later write.
- Its process holds a shared lock (flock) on it while the buffer lives. The first buffer made in a
  folder removes this user's files there that nobody holds: left by a crash. A lock, not the pid in
  the name, tells: pids repeat across containers and restarts.
- The file is removed when the buffer is collected, at exit, or by `release_all()` (a service that
  ends with os._exit, which skips exit handlers).
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import weakref

import torch

PREFIX = "disagg-kv-"
NAME = re.compile(rf"{PREFIX}[0-9]+-[0-9a-f]+")  # re.fullmatch
CPU_ONLY = "--disaggregation-transfer-backend shm is for CPU services on one host (on GPUs: mooncake)"
_swept: set[str] = set()
_live: list[weakref.finalize] = []  # one per buffer made here: closes its lock, removes its file


class SharedMemoryFull(RuntimeError):
    """The folder has no room for the buffer (the message says what to change)."""


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
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            raise SharedMemoryFull(
                f"the KV pool needs {nbytes >> 20} MiB in {folder}, which has {_free_mib(folder)} MiB free "
                f"({e.strerror}): give it more (docker: --shm-size), lower --max-total-tokens, or name another "
                "--disaggregation-shm-dir"
            ) from e
        t = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    except BaseException:
        _remove(path, fd)
        raise
    _live.append(weakref.finalize(t.untyped_storage(), _remove, path, fd))
    return path, t


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
    """Remove this user's buffer files in `folder` that no process holds; the removed paths."""
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
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.getuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live buffer
            continue
        finally:
            os.close(fd)
        _remove(path)
        removed.append(path)
    return removed
