"""FinishNotes: what the front door learns about a finished request besides its tokens: why it
failed, how many prompt tokens the prefill side found in its prefix cache, and (EAGLE) how many of
its drafts were accepted. Written by the scheduler before it emits
the finish, popped by the front door when it builds the Complete; bounded (oldest dropped past 1024)
so callers that never pop (in-process use) leak nothing."""

from __future__ import annotations

import threading


class FinishNotes:
    LIMIT = 1024

    def __init__(self):
        self._lock = threading.Lock()
        self._errors: dict[str, str] = {}
        self._spec: dict[str, tuple[int, int]] = {}
        self._cached: dict[str, int] = {}

    def _put(self, table: dict, rid: str, value) -> None:
        with self._lock:
            table[rid] = value
            while len(table) > self.LIMIT:
                table.pop(next(iter(table)))

    def put_error(self, rid: str, detail: str) -> None:
        self._put(self._errors, rid, detail)

    def put_spec(self, rid: str, accepted: int, drafted: int) -> None:
        self._put(self._spec, rid, (accepted, drafted))

    def put_cached(self, rid: str, tokens: int) -> None:
        self._put(self._cached, rid, tokens)

    def pop_cached(self, rid: str) -> int:
        with self._lock:
            return self._cached.pop(rid, 0)

    def pop_error(self, rid: str) -> str | None:
        with self._lock:
            return self._errors.pop(rid, None)

    def pop_spec(self, rid: str) -> tuple[int, int]:
        """(drafts accepted, drafts proposed); (0, 0) without EAGLE."""
        with self._lock:
            return self._spec.pop(rid, (0, 0))
