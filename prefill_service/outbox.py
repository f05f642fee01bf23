"""The Outbox: one Prefill call's KV messages handed to the transfer threads one at a time.

The KV sender (common/kv_transfer/sender.py) makes a call's messages lazily, and each may block
(copies, encoding, writes into decode's slots), so the handoff stream (handoff_stream.py) takes them
on a small pool of threads, one `take` (one executor call) per message. Each take also makes the
message after the one it returns, so the take that returns the last message knows it and encodes the
record's draft seed too: a request's record never waits behind other requests' chunks in the pool's
queue, as a separate call for the end (or the seed) would.
"""

from __future__ import annotations

from collections.abc import Iterator

from common.engine.handoff import Handoff
from common.wire import kv_chunks
from common.wire.proto_gen import prefill_pb2


class Outbox:
    _UNSET = object()

    def __init__(self, messages: Iterator[prefill_pb2.PrefillChunk], handoff: Handoff):
        self._messages, self._handoff = messages, handoff
        self._ahead = self._UNSET

    def take(self) -> tuple[prefill_pb2.PrefillChunk | None, dict | None]:
        """(the next message, or None if there was none; the draft seed once no message is left, else None)."""
        message = next(self._messages, None) if self._ahead is self._UNSET else self._ahead
        self._ahead = None if message is None else next(self._messages, None)
        return message, (kv_chunks.encode_seed(self._handoff) if self._ahead is None else None)
