"""FutureMap: device buffers that relay values from forward N to step N+1 without a host sync.

Invariants (docs/architecture.md, "The FutureMap and its invariants"), each with a test in
tests/test_future_map.py:
1. Every buffer has req_pool_size + 1 rows and is indexed by req_pool_idx; the future indices of
   a batch *are* its req_pool_indices (no ring counter).
2. `stash` writes forward-only values (next tokens; EAGLE's draft seed), read only by the next
   forward on the same stream: no fence. `publish` writes values the schedule side consumes
   (EAGLE's new kv_committed_lens) and sets that step's `publish_ready` event right after the
   write; a publish from another stream first waits on the previous event (chaining).
3. The schedule side reads published kv_committed_lens only through
   `resolve_kv_committed_lens_cpu`, which waits on the event armed for step N when forward N was
   submitted (`arm_publish`), never an older one, and raises if the stream failed before the
   publish ran.
6. Consume-once (debug mode): a gather must follow exactly one stash/publish of that row since
   the previous gather; gathered rows are poisoned (-1) and the gathered values are asserted valid
   (tokens >= 0, kv_committed_lens > 0). `reset_rows` clears a row's guard (release, prebuilt seeding).
All buffer mutations run as work on the forward stream, so they are ordered with the forwards.
"""

from __future__ import annotations

import torch

from common.engine.penalties import PenaltyCounts
from common.engine.streams import wait_event
from common.forward.host_copy import to_device


class ConsumeOnceError(AssertionError):
    """A FutureMap row was gathered without exactly one write since its previous gather."""


class FutureMap:
    def __init__(
        self,
        req_pool_size: int,
        device: torch.device | str,
        make_event,
        debug: bool = False,
        draft_hidden_size: int = 0,
        draft_dtype: torch.dtype = torch.float32,
        vocab_size: int = 0,
    ):
        self.num_rows = req_pool_size + 1
        self.device = torch.device(device)
        self.debug = debug
        self._make_event = make_event
        self.token_ids = torch.zeros(self.num_rows, dtype=torch.int64, device=self.device)
        self.kv_committed_lens = torch.zeros(self.num_rows, dtype=torch.int64, device=self.device)
        names = ["token_ids", "kv_committed_lens"]
        if draft_hidden_size:  # EAGLE: the draft seed of each row (next draft token, head hidden)
            self.draft_token_ids = torch.zeros(self.num_rows, dtype=torch.int64, device=self.device)
            self.draft_hidden = torch.zeros(self.num_rows, draft_hidden_size, dtype=draft_dtype, device=self.device)
            names += ["draft_token_ids", "draft_hidden"]
        # debug guard: writes since the last gather, per buffer and row
        self._writes = {name: torch.zeros(self.num_rows, dtype=torch.int32, device=self.device) for name in names}
        # per-row penalty state (ids seen, output counts), read and updated by every step of a row with
        # a penalty; not relayed once like the buffers above (common/engine/penalties.py)
        self.penalties = PenaltyCounts(self.num_rows, vocab_size, self.device) if vocab_size else None
        self.publish_ready = None  # the event of the latest armed step
        self._last_publish_stream = None

    # --- forward-stream side -------------------------------------------------------------------
    def stash_tokens(self, indices: torch.Tensor, tokens: torch.Tensor) -> None:
        self._write("token_ids", indices, tokens.to(torch.int64).flatten())

    def gather_tokens(self, indices: torch.Tensor) -> torch.Tensor:
        return self._gather("token_ids", indices, minimum=0)

    def tokens_in_place(self, indices: torch.Tensor) -> torch.Tensor:
        """The token buffer itself, for a step that gathers the pending tokens of `indices` and stashes their
        next ones in one call of its own (ModelRunner.greedy_step). In debug mode the guard checks here what
        `gather_tokens` checks; a gather and a stash together leave each row's count of writes at one."""
        if self.debug:
            indices = indices.to(self.device)
            self._check("token_ids", indices, self.token_ids[indices], minimum=0)
        return self.token_ids

    def stash_draft(self, indices: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """EAGLE: the next step's first draft token and the head hidden it came from (forward-only)."""
        self._write("draft_token_ids", indices, tokens.to(torch.int64).flatten())
        self._write("draft_hidden", indices, hidden)

    def gather_draft(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._gather("draft_token_ids", indices, minimum=0), self._gather("draft_hidden", indices, minimum=None)

    def seed_kv_committed_lens(self, indices: torch.Tensor, kv_committed_lens: torch.Tensor) -> None:
        """A prebuilt batch's rows: their committed lengths as if published (stream work, no fence
        needed: the schedule side knows them from the handoff)."""
        self.kv_committed_lens[to_device(indices, self.device)] = to_device(kv_committed_lens, self.device, torch.int64)

    def publish_kv_committed_lens(
        self, indices: torch.Tensor, kv_committed_lens: torch.Tensor, fence: PublishReady
    ) -> None:
        """Write the new committed lengths, then set `fence` (the publish_ready armed for this step at
        submit). Runs as work on the stream the fence was armed for."""
        self._write("kv_committed_lens", indices, kv_committed_lens.to(torch.int64))
        fence.set_here()

    def reset_rows(self, indices: torch.Tensor) -> None:
        """Clear the consume-once guard of rows (on release and when a prebuilt batch seeds them)."""
        for w in self._writes.values():
            w.index_fill_(0, indices, 0)  # not `w[indices] = 0`: on CUDA that copies a host scalar (a sync)

    # --- schedule side -------------------------------------------------------------------------
    def arm_publish(self, stream) -> PublishReady:
        """Arm step N's publish_ready when forward N is submitted: from now on resolve waits for it."""
        self.publish_ready = PublishReady(self._make_event(), self.publish_ready, stream)
        return self.publish_ready

    def resolve_kv_committed_lens_cpu(self, indices: torch.Tensor, timeout: float | None = None) -> torch.Tensor:
        """Wait for the armed step's publish, then copy its committed lengths for `indices` to the host.
        Raises StreamFailed (never hangs) if the stream failed before the publish ran."""
        if self.publish_ready is None:
            raise RuntimeError("resolve_kv_committed_lens_cpu before any step armed publish_ready")
        self.publish_ready.synchronize(timeout)
        values = self.kv_committed_lens[indices.to(self.device)].cpu()
        if self.debug and not bool((values > 0).all()):
            raise ConsumeOnceError(f"resolved kv_committed_lens not positive: {values.tolist()}")
        return values

    # --- internals -----------------------------------------------------------------------------
    def _write(self, name: str, indices: torch.Tensor, values: torch.Tensor) -> None:
        indices = indices.to(self.device)
        getattr(self, name)[indices] = values
        if self.debug:
            writes = self._writes[name]
            writes[indices] += 1

    def _gather(self, name: str, indices: torch.Tensor, minimum: int | None) -> torch.Tensor:
        indices = indices.to(self.device)
        buf = getattr(self, name)
        values = buf[indices]
        if self.debug:
            self._check(name, indices, values, minimum)
            self._writes[name].index_fill_(0, indices, 0)
            buf.index_fill_(0, indices, -1)  # poison: a second gather without a write reads -1
        return values

    def _check(self, name: str, indices: torch.Tensor, values: torch.Tensor, minimum: int | None) -> None:
        """Debug mode: each gathered row written exactly once since its last gather, its values valid."""
        writes = self._writes[name][indices]
        ok = (writes == 1).all()
        if minimum is not None:
            ok = ok & (values >= minimum).all()
        if self.device.type == "cuda":
            torch._assert_async(ok)
        elif not bool(ok):
            raise ConsumeOnceError(
                f"{name}: rows {indices.tolist()} gathered with writes {writes.tolist()} "
                f"(need exactly 1 since the last gather) and values {values.tolist()}"
            )


class PublishReady:
    """The publish_ready fence of one step, armed at submit. If the publish runs on another stream
    than the one the previous step's fence was armed for, it first waits on that fence (chain)."""

    def __init__(self, event, previous: PublishReady | None, stream):
        self.event = event
        self.previous = previous
        self.armed_stream = stream

    def set_here(self) -> None:
        """Called inside the step's work on its stream, right after the publish write."""
        if self.previous is not None and self.previous.armed_stream is not self.armed_stream:
            self.previous.event.wait_here()
        self.previous = None  # drop the chain once resolved, so it does not grow
        self.event.set_here()

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait for the publish; raises if the stream failed first, TimeoutError after `timeout`."""
        wait_event(self.event, self.armed_stream, timeout)
