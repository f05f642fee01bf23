"""Per-handoff write capabilities: a prefill replica writes KV only where decode asked.

A Prefill call that names a `kv_destination` tells prefill where to write: pool files or registered
regions and the request's slot runs. Without a check any caller of prefill's API could name decode's
pools and another request's slots, and prefill would overwrite that request's KV with the KV of the
caller's prompt. So decode signs each destination it sends, and prefill's writer refuses one whose
signature does not verify with a key the caller cannot know:

- the capability (per rank of a tensor-parallel destination) is `expires | nonce | tag`, with
  tag = HMAC-SHA256(key, request_id, session, target and draft regions, KV heads, slot runs, expires,
  nonce): any other slots, pools, session or request need another tag, which only a key holder makes;
- shm: the key is the decode process's secret, written by common/kv_transfer/shm_files.py in a
  trailer of each of its pool files (mode 0600: only decode's user reads it). The writer reads it
  from the files it maps, past the part it writes (writes cannot reach it), and needs every file of
  a session to hold the same one. A prefill of the same user can read it; another user, or a remote
  caller, cannot;
- mooncake: the key is derived from the internal API key (`key_from_internal`), which both services
  already share out-of-band. Without an internal key there is no channel a stranger cannot use across
  hosts, so destinations go unsigned and prefill writes them unchecked (it warns at start): then
  prefill's port must be as private as the Mooncake network itself, whose engine serves raw writes to
  anyone who reaches it;
- replays: a capability expires with the call's deadline (decode's clock: hosts keep time in sync) and
  a writer refuses one it has already accepted (remembered until it expires, at most MAX_SEEN), so a
  copy read off the wire cannot later steer writes into slots that a newer request holds.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import struct
import threading
import time

DOMAIN = b"disagg-serve kv capability v1"
NONCE_BYTES = 16
SIZE = 8 + NONCE_BYTES + 32  # expiry (ms since the epoch), nonce, tag


class CapabilityRefused(ValueError):
    """A destination whose capability is missing, forged, expired or used before (the message says which)."""


def key_from_internal(api_key: str | None) -> bytes | None:
    """The mooncake destinations' key: derived from the internal API key, or None without one."""
    if not api_key:
        return None
    return hmac.new(api_key.encode(), DOMAIN, hashlib.sha256).digest()


def ranks(dest) -> list:
    """The write targets a destination names: each rank of a tensor-parallel decode side, or itself."""
    return list(dest.tp_ranks) or [dest]


def _region(region) -> bytes:
    n, m = len(region.k_ptrs), len(region.v_ptrs)
    return struct.pack(f"<Q{n}QQ{m}QQ", n, *region.k_ptrs, m, *region.v_ptrs, region.slot_bytes)


def _tag(key: bytes, request_id: str, rank, runs, head: bytes) -> bytes:
    """The tag over everything that decides where a write lands (each field length-prefixed)."""
    fields = [
        DOMAIN,
        request_id.encode(),
        rank.session.encode(),
        _region(rank.target),
        _region(rank.draft) if rank.HasField("draft") else b"",
        struct.pack("<II", getattr(rank, "kv_head_start", 0), getattr(rank, "kv_head_count", 0)),
        b"".join(struct.pack("<IQI", r.token_start, r.slot, r.length) for r in runs),
        head,
    ]
    message = b"".join(struct.pack("<Q", len(f)) + f for f in fields)
    return hmac.new(key, message, hashlib.sha256).digest()


def sign(dest, request_id: str, keys: list[bytes], ttl_s: float) -> None:
    """Set the capability of each rank of `dest` (its runs set) with that rank's key, valid `ttl_s`."""
    targets = ranks(dest)
    if len(keys) != len(targets):
        raise ValueError(f"{len(keys)} capability keys for a destination of {len(targets)} ranks")
    expires = int((time.time() + ttl_s) * 1000)
    for rank, key in zip(targets, keys):
        head = struct.pack("<Q", expires) + os.urandom(NONCE_BYTES)
        rank.capability = head + _tag(key, request_id, rank, dest.runs, head)


class Verifier:
    """A writer's check of capabilities; remembers those it accepted until they expire."""

    MAX_SEEN = 1 << 16

    def __init__(self):
        self._seen: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # tag -> expiry (ms)
        self._lock = threading.Lock()

    def check(self, key: bytes, request_id: str, rank, runs) -> None:
        """CapabilityRefused unless `rank.capability` is decode's, for exactly this request, session,
        regions and runs, unexpired and not used before."""
        cap = rank.capability
        where = f"KV destination {rank.session[:80]!r} of request {request_id[:80]!r}"
        if len(cap) != SIZE:
            raise CapabilityRefused(
                f"{where} has no valid capability: prefill writes only where the decode side that owns "
                "the pools asked (a decode service of this version signs its destinations)"
            )
        head, tag = cap[: SIZE - 32], cap[SIZE - 32 :]
        if not hmac.compare_digest(tag, _tag(key, request_id, rank, runs, head)):
            raise CapabilityRefused(
                f"{where}: the capability does not verify (not issued by the decode side that owns these "
                "pools for these slots; with mooncake both services need the same internal API key)"
            )
        expires, now = struct.unpack_from("<Q", head)[0], int(time.time() * 1000)
        if expires < now:
            raise CapabilityRefused(f"{where}: the capability expired {(now - expires) / 1000:.1f}s ago")
        with self._lock:
            while self._seen and (next(iter(self._seen.values())) < now or len(self._seen) >= self.MAX_SEEN):
                self._seen.popitem(last=False)
            if tag in self._seen:
                raise CapabilityRefused(f"{where}: the capability was used before (a replay)")
            self._seen[tag] = expires
