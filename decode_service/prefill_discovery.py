"""Prefill replicas from `--prefill-addr`: static HOST:PORT entries, and `dns:///NAME:PORT` entries
re-resolved periodically, so replicas behind a name (a Kubernetes headless Service) can appear and
disappear without restarting decode.

`expand(entries)` turns the entries into replica addresses now: a static entry as it is, a dns entry
into IP:PORT for every address NAME resolves to (none while it resolves to nothing, as a headless
Service with no ready pod does). `PrefillClient` calls it at start and every `resolve_interval_s`.
"""

from __future__ import annotations

import logging
import socket

logger = logging.getLogger(__name__)
DNS_PREFIX = "dns:///"


def lookup(host: str) -> list[str]:
    """The IP addresses `host` resolves to now (sorted; empty if it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({info[4][0] for info in infos})


def split_entry(entry: str) -> tuple[str, int]:
    """`dns:///NAME:PORT` -> (NAME, PORT); ValueError naming the entry otherwise."""
    name, sep, port = entry[len(DNS_PREFIX) :].rpartition(":")
    if not entry.startswith(DNS_PREFIX) or not sep or not name or not port.isdigit():
        raise ValueError(f"prefill address {entry!r}: expected dns:///NAME:PORT")
    return name, int(port)


def has_dns(entries: list[str]) -> bool:
    return any(e.startswith(DNS_PREFIX) for e in entries)


def expand(entries: list[str]) -> list[str]:
    """Replica addresses for the entries, in order, each once."""
    out: list[str] = []
    for entry in entries:
        if not entry.startswith(DNS_PREFIX):
            found = [entry]
        else:
            name, port = split_entry(entry)
            found = [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in lookup(name)]
            if not found:
                logger.warning("prefill address %s resolves to nothing (yet)", entry)
        out.extend(a for a in found if a not in out)
    return out
