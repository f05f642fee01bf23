"""A tensor-parallel group across hosts (`--nnodes`, `--node-rank`, `--dist-init-addr`, SGLang's names).

`--tp-size N --nnodes M`: each of the M nodes runs k = N / M ranks, node r the ranks r*k .. r*k+k-1,
every node with the same flags but its own `--node-rank`. Node 0 runs the service (rank 0 serves
gRPC) and its store listens on exactly the host of `--dist-init-addr HOST:PORT`; the ranks of the
other nodes connect there and listen (gloo) on their own address on the route to HOST. A node
other than 0 runs only follower ranks and ends when the group does (common/parallel/launch.py).

The group's key (common/parallel/tp_auth.py) cannot travel through a pipe to another host, so with
--nnodes > 1 every node reads it from `--tp-key-file` (the same file on each: a Kubernetes Secret,
say), checked as the API key files are (common/api_keys.py). `check(config)` refuses what cannot
work before anything loads, with a message naming the flag.
"""

from __future__ import annotations

import ipaddress
import socket

from common import api_keys
from common.parallel import tp_auth

MIN_KEY_CHARS = 32


def settings(config) -> tuple[int, int, str | None, str | None]:
    """(nnodes, node_rank, dist_init_addr, tp_key_file) of a config (defaults where it has none)."""
    return (
        getattr(config, "nnodes", 1),
        getattr(config, "node_rank", 0),
        getattr(config, "dist_init_addr", None),
        getattr(config, "tp_key_file", None),
    )


def parse_addr(text: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets: [::1]:PORT) as (host, port), or ValueError saying why."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--dist-init-addr must be HOST:PORT (IPv6: [ADDR]:PORT), got {text!r}")
    return host, int(port)


def store_address(config) -> tuple[str, int]:
    """Where rank 0's store listens: --dist-init-addr, else loopback on --tp-port."""
    addr = settings(config)[2]
    return parse_addr(addr) if addr else ("127.0.0.1", getattr(config, "tp_port", 0))


def ranks_of_node(config) -> range:
    nnodes, node_rank, _, _ = settings(config)
    k = config.tp_size // nnodes
    return range(node_rank * k, node_rank * k + k)


def check(config) -> None:
    """The node flags, refused with a clear error before anything loads."""
    nnodes, node_rank, addr, key_file = settings(config)
    if nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in [0, --nnodes) = [0, {nnodes}), got {node_rank}")
    if config.tp_size % nnodes:
        raise ValueError(f"--tp-size ({config.tp_size}) must be divisible by --nnodes ({nnodes}): ranks per node")
    if addr is not None:
        host, port = parse_addr(addr)
        if getattr(config, "tp_port", 0):
            raise ValueError("give --dist-init-addr or --tp-port, not both (--dist-init-addr names the port)")
    if nnodes == 1:
        if key_file:
            group_key(config)  # a bad file is refused even where a fresh key would do
        return
    if addr is None:
        raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT: where node 0's rank 0 listens")
    if port == 0:
        raise ValueError("--dist-init-addr needs a fixed port with --nnodes > 1: every node must know it")
    if _is_wildcard(host):
        raise ValueError(
            f"--dist-init-addr {addr}: give node 0's address the other nodes reach, not a wildcard "
            "(the store binds exactly that host)"
        )
    if not key_file:
        raise ValueError(
            "--nnodes > 1 needs --tp-key-file: the TP group's key, the same file on every node "
            "(e.g. openssl rand -hex 32 > tp.key; chmod 600 tp.key)"
        )
    group_key(config)


def group_key(config) -> str:
    """The group's key: --tp-key-file's (every node the same), else a fresh one for this launch."""
    path = settings(config)[3]
    if not path:
        return tp_auth.new_key()
    try:
        key = api_keys.read_key_file(path, "--tp-key-file")
    except api_keys.KeySourceError as e:
        raise ValueError(str(e)) from None
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(
            f"--tp-key-file {path}: a key of {len(key)} characters is too short to guard the group "
            f"(at least {MIN_KEY_CHARS}: openssl rand -hex 32)"
        )
    return key


def local_address(host: str, port: int) -> str:
    """This host's address on the route to `host`: where a rank of another node listens (gloo)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)  # UDP: no packet sent, only the route chosen
        return s.getsockname()[0]


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host == ""
