"""Where the services' API keys come from: a file (preferred), the environment, or a flag value.

Each key field of a config (`api_key` on decode, `internal_api_key` on both) has three sources:
1. `--X-file PATH` (or `X-file:` in a --config YAML): the file's text without its trailing newline.
   Refused with a clear error (the service does not start) when the file is empty, not a regular
   file, larger than 4 KiB, or readable by other users or writable by anyone but its owner (mode
   bits 027, as PostgreSQL treats its key files). Group read is allowed: a Kubernetes Secret mounted
   with an fsGroup is 0440. Owner read-only (0400 or 0600) is best.
2. The environment: `DISAGG_API_KEY`, `DISAGG_INTERNAL_API_KEY`, read when neither the flag nor the
   file is given. Set but empty is an error (unset it to run without a key).
3. `--X KEY`: still accepted, but a value on the command line shows in `ps` and `docker inspect`.
Giving both the value and the file is an error. A key is printable ASCII without spaces (it travels
in gRPC metadata `authorization: Bearer <key>`).

`generated_env()` is the local launcher's default (common/tools/demo.py): a fresh internal key in
the environment of the two services it starts, never on their command lines.
"""

from __future__ import annotations

import os
import secrets
import stat

ENV = {"api_key": "DISAGG_API_KEY", "internal_api_key": "DISAGG_INTERNAL_API_KEY"}
MAX_BYTES = 4096
UNSAFE_MODE = stat.S_IWGRP | stat.S_IRWXO  # group-writable, or any access for others


class KeySourceError(ValueError):
    """A key source that cannot be used (the message says which and what to do)."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def read_key_file(path: str, flag: str = "--api-key-file") -> str:
    """The key held in `path` (one line; the trailing newline dropped), or KeySourceError saying why not."""
    try:  # O_NONBLOCK: a FIFO planted at the path must not hang start-up (it is refused below)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise KeySourceError(f"{flag} {path}: cannot open it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeySourceError(f"{flag} {path}: not a regular file")
        if st.st_mode & UNSAFE_MODE:
            raise KeySourceError(
                f"{flag} {path}: other users may read or change it (mode {stat.S_IMODE(st.st_mode):04o}): "
                f"run chmod 600 {path} (a Kubernetes Secret: defaultMode 0440 with an fsGroup)"
            )
        data = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise KeySourceError(f"{flag} {path}: larger than {MAX_BYTES} bytes; a key file holds one key on one line")
    key = data.decode("utf-8", errors="replace").removesuffix("\n").removesuffix("\r")
    if not key:
        raise KeySourceError(f"{flag} {path}: the file is empty; write the key into it (e.g. openssl rand -hex 32)")
    return _checked(key, f"{flag} {path}")


def _checked(key: str, source: str) -> str:
    if not all("!" <= c <= "~" for c in key):
        raise KeySourceError(f"{source}: a key must be printable ASCII without spaces or line breaks")
    return key


def resolve(name: str, value: str | None, path: str | None, environ=os.environ) -> str | None:
    """The key `name` ("api_key" or "internal_api_key") from its flag value, its file or the environment."""
    if value and path:
        raise KeySourceError(f"give {_flag(name)} or {_flag(name)}-file, not both (the file is preferred)")
    if path:
        return read_key_file(path, _flag(name) + "-file")
    if value:
        return _checked(value, _flag(name))
    env = environ.get(ENV[name])
    if env is None:
        return None
    if not env:
        raise KeySourceError(f"{ENV[name]} is set but empty: set the key, or unset it to run without one")
    return _checked(env, ENV[name])


def load_keys(config) -> None:
    """Fill the config's key fields from their sources (in place)."""
    for name in ENV:
        if hasattr(config, name):
            setattr(config, name, resolve(name, getattr(config, name), getattr(config, name + "_file", None)))


def generated_env(environ=os.environ) -> dict:
    """`environ` plus a fresh internal key for a pair started together on this host (kept if one is set)."""
    env = dict(environ)
    env.setdefault(ENV["internal_api_key"], secrets.token_urlsafe(32))
    return env
