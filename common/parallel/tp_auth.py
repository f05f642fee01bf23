"""Who may join a tensor-parallel group, and what its messages may hold.

The ranks of one service meet at a TCPStore on rank 0 and then exchange control messages (Python
objects) over gloo. Whoever reaches that port could otherwise join the group, redirect its
connections, or send a message that runs code in the service. So:

1. The store listens on exactly the host it is given: `listen(host, port)` binds the socket here
   (port 0: a free one) and TCPStore takes it over (`master_listen_fd`). The port is the socket's
   from the start: no bind-and-release race, and never every interface.
2. A per-launch key (`new_key()`, 32 random bytes in hex) that rank 0 makes and hands to the ranks
   it spawns through multiprocessing's pipe: never on a command line or in the environment.
3. `AuthStore` wraps the store: every value carries an HMAC-SHA256 tag over its name and bytes, and a
   value without a valid tag (set by a process without the key, or moved from another name) is
   refused with PermissionError. Gloo's and NCCL's rendezvous (peer addresses, the NCCL id) goes
   through it, so the ranks only connect where another rank told them to. Counters (`add`) pass
   untagged: they carry no address.
4. `join(store, rank, size)`, before any process group forms: rank 0 publishes a fresh nonce, each
   follower writes it back under its rank's name (tagged: proof of the key, not replayable from an
   earlier launch), rank 0 checks every proof and publishes its verdict (tagged: the followers check
   rank 0 too). A wrong key fails every rank with PermissionError instead of a hang.
5. `stop_listening(held)`, once the groups formed (or failed to): the store's listening socket stops
   taking connections. Every rank connected before the store's constructor returned (it waits for all
   of them), and the store keeps serving those connections; nobody new can reach it, so a stranger
   can neither read it nor fill rank 0's memory for the rest of the service's life.
6. `seal` / `unseal`: every object message is tagged over a label (message number, sender,
   receiver) and its bytes; a forged, altered, replayed or misdelivered message is refused.
7. The messages hold tensors and plain data only, never pickles (common/parallel/tp_codec.py).

Not covered: the gloo (and NCCL) data connections have no authentication of their own (they are
made from the authenticated rendezvous and bound to the group's host); whoever reaches the store
while the group forms can read its values (never the key) and spoil them, which stops the group
forming (a denial of service, not a takeover). Keep the TP port on loopback, or on a private network.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

import torch.distributed as dist

TAG_BYTES = 32


def new_key() -> str:
    return secrets.token_hex(32)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket bound to exactly `host` (port 0: a free one, reserved from now on)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen for the TP group on {host}:{port}: {e} (choose another --tp-port, or 0)") from e
    return sock


def stop_listening(held: socket.socket) -> None:
    """No new connection to the store once the group formed (module docstring, 5): `held` is a
    duplicate of the listening socket the store took over; shutting it down stops the socket itself
    (connections made before stay, and the store keeps serving them), then the duplicate is closed."""
    try:
        held.shutdown(socket.SHUT_RDWR)
    except OSError:  # the store already closed it (it failed to start)
        pass
    held.close()


def tag(key: bytes, label: str, data) -> bytes:
    h = hmac.new(key, label.encode() + b"\0", hashlib.sha256)
    h.update(data)
    return h.digest()


def seal(key: bytes, label: str, data) -> bytearray:
    out = bytearray(tag(key, label, data))
    out += data
    return out


def unseal(key: bytes, label: str, blob):
    """`blob`'s data (a view, not a copy) if its tag is `label`'s under `key`, else PermissionError."""
    blob = memoryview(blob)
    data = blob[TAG_BYTES:]
    if len(blob) < TAG_BYTES or not hmac.compare_digest(blob[:TAG_BYTES], tag(key, label, data)):
        raise PermissionError(
            f"TP message {label!r} is not signed with this group's key: a process outside the group "
            "sent or changed it; keep the TP port on loopback or a private network"
        )
    return data


class AuthStore(dist.Store):
    """A store whose values are tagged with the group's key (module docstring, 3)."""

    def __init__(self, inner: dist.Store, key: bytes):
        super().__init__()
        self.inner, self._key = inner, key

    def __repr__(self) -> str:
        return f"AuthStore({self.inner!r})"

    def set(self, name: str, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(name, seal(self._key, "store/" + name, value))

    def get(self, name: str) -> bytes:
        return bytes(unseal(self._key, "store/" + name, self.inner.get(name)))

    def add(self, name: str, amount: int) -> int:
        return self.inner.add(name, amount)

    def wait(self, names, timeout=None) -> None:
        if timeout is None:
            self.inner.wait(names)
        else:
            self.inner.wait(names, timeout)

    def check(self, names) -> bool:
        return self.inner.check(names)

    def delete_key(self, name: str) -> bool:
        return self.inner.delete_key(name)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout) -> None:
        self.inner.set_timeout(timeout)


def join(store: AuthStore, rank: int, size: int) -> None:
    """Every rank proves the key to rank 0, and rank 0 to them (module docstring, 4)."""
    if rank == 0:
        nonce = secrets.token_hex(16).encode()
        store.inner.set("auth/nonce", nonce)  # a public challenge: its answers are what is tagged
        refused = []
        for r in range(1, size):
            try:
                if store.get(f"auth/join/{r}") != nonce:
                    refused.append(f"rank {r} answered another launch's challenge")
            except PermissionError:
                refused.append(f"rank {r} does not hold this launch's key")
        verdict = b"refused: " + "; ".join(refused).encode() if refused else nonce
        store.set("auth/ready", verdict)
        if refused:
            raise PermissionError(f"TP group refused: {'; '.join(refused)} (a stranger on the TP port?)")
        return
    nonce = store.inner.get("auth/nonce")
    store.set(f"auth/join/{rank}", nonce)
    try:
        verdict = store.get("auth/ready")
    except PermissionError as e:
        raise PermissionError(f"TP rank {rank}: the group's rank 0 does not hold this launch's key") from e
    if verdict != nonce:
        raise PermissionError(f"TP rank {rank}: rank 0 {verdict.decode(errors='replace')}")
