"""KV pool buffers as files of a shared-memory folder (the shm handoff, common/wire/shm_transfer.py).

A buffer is a file `disagg-kv-<pid>-<random>` (mode 0600) mapped shared: a prefill replica on the
same host maps the same file and writes handoffs straight into the pool. Its room is taken when it
is made (tmpfs hands out pages on first touch: a full folder would kill the service with SIGBUS on
some later write instead). The file is removed when the buffer is collected or at exit; the first
buffer made in a folder removes this user's files there of processes that are gone (a crash).
"""

from __future__ import annotations

import os
import re
import secrets
import weakref

import torch

PREFIX = "disagg-kv-"
NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+$")
_swept: set[str] = set()


class SharedMemoryFull(RuntimeError):
    """The folder has no room for the buffer (the message says what to change)."""


def allocate(folder: str, shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    """A zeroed tensor whose memory is a new file in `folder`: (tensor, file path). The file is
    removed when the tensor's storage is collected or at exit."""
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
        os.posix_fallocate(fd, 0, nbytes)  # now: a full tmpfs would otherwise kill us (SIGBUS) on a write
    except OSError as e:
        os.unlink(path)
        st = os.statvfs(folder)
        raise SharedMemoryFull(
            f"the KV pool needs {nbytes >> 20} MiB in {folder}, which has {(st.f_bavail * st.f_frsize) >> 20} MiB "
            f"free ({e.strerror}): give it more (docker: --shm-size), lower --max-total-tokens, or name another "
            "--disaggregation-shm-dir"
        ) from e
    finally:
        os.close(fd)
    try:
        t = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    except BaseException:
        os.unlink(path)
        raise
    weakref.finalize(t.untyped_storage(), _unlink, path)
    return t, path


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def sweep(folder: str) -> list[str]:
    """Remove this user's pool files in `folder` whose process is gone; the removed paths."""
    removed = []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return removed
    for name in names:
        m = NAME.match(name)
        path = os.path.join(folder, name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            if os.lstat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
