"""The one error a KV transfer raises while a Prefill call streams.

The prefill server catches `KvTransferError` alone: a destination that does not fit the KV or whose
capability does not verify, a write the engine did not complete, a shared-memory session this
writer refuses. Each backend's own errors subclass it, so a caller never lists backends. Errors at
start-up (an engine that cannot load) are not transfer errors: they stop the service.
"""

from __future__ import annotations

from collections.abc import Iterator


class KvTransferError(RuntimeError):
    """A handoff's KV could not be moved to the decode side (the message says why)."""


def as_transfer_errors(messages: Iterator) -> Iterator:
    """`messages`, with a ValueError raised while they are made (a destination that does not fit, a
    refused capability: common/wire/kv_capability.py) raised as KvTransferError from it."""
    try:
        yield from messages
    except KvTransferError:
        raise
    except ValueError as e:
        raise KvTransferError(str(e)) from e
