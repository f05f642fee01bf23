"""FakeWorker: the DecodeWorker's interface with scripted outputs and no model, for scheduler tests.

Tokens are a pure function of (request id, output index) (`token_of`, overridable per position), so
any batching, overlap setting or accept pattern must give each request the same tokens. With EAGLE
the accepted draft count of each lane comes from `accept(rid, step)`, and the new lengths are
"published" for `resolve_kv_committed_lens_cpu` exactly as the real worker's FutureMap does.

The fake checks what the real worker relies on: the device kv_committed_lens mirror the host ones,
every lane's row was seeded by a prebuilt write and not released since, EAGLE lengths come from the
previous publish, a step never writes past the request's reserved KV, and each publish is resolved
at most once. `log` keeps every stream operation in submission order (the real worker's stream runs them in
that order), so ordering questions (invariant 7) are answered by reading it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from common.engine.handoff import Handoff, HandoffRequest
from common.engine.req_to_token_pool import ReqToTokenPool
from common.engine.slot_allocator import SlotAllocator
from common.engine.streams import HostEvent, StreamFailed
from decode_service.worker_batch import BatchResult, WorkerBatch, WorkerInfo

EOS = 1
HIDDEN = 8


def token_of(rid: str, index: int) -> int:
    """The scripted token at output index `index` of request `rid` (never EOS)."""
    return 10 + (zlib.crc32(rid.encode()) + 7 * index) % 80


class FakeWorker:
    def __init__(
        self,
        req_slots: int = 4,
        kv_slots: int = 256,
        context: int = 128,
        spec=None,
        accept: Callable[[str, int], int] | None = None,
        overrides: dict | None = None,
        hooks=None,
    ):
        self.hooks = hooks  # DecodeHooks (the scheduler reads `retract` from them)
        self.info = WorkerInfo(
            torch.device("cpu"),
            vocab_size=100,
            context_length=context,
            eos_token_ids=(EOS,),
            num_layers=2,
            hidden_size=HIDDEN,
            spec=spec,
        )
        extra = spec.extra_slots if spec else 0
        self.req_to_token_pool = ReqToTokenPool(req_slots, context + extra, "cpu")
        self.kv_allocator = SlotAllocator(kv_slots, name="KV slots")
        self.accept = accept or (lambda rid, step: step % (spec.num_steps + 1) if spec else 0)
        self.overrides = overrides or {}  # (rid, output index) -> token
        self.log: list[tuple] = []
        self.fail_at_step: int | None = None
        self._seeded: dict[int, int] = {}  # row -> reserved KV slots, from its prebuilt write to its release
        self._published: dict[int, int] = {}  # row -> new committed length not yet resolved (EAGLE)
        self._committed: dict[int, int] = {}  # row -> the committed length the next step must start from
        self._prompt_len: dict[int, int] = {}

    def token(self, rid: str, index: int) -> int:
        return self.overrides.get((rid, index), token_of(rid, index))

    def handoff(self, request: HandoffRequest) -> Handoff:
        """What a prefill replica would deliver for `request` (the KV came as chunks: none in the record)."""
        draft = {}
        if self.info.spec:
            draft = dict(
                draft_topk_ids=torch.tensor([3]), draft_topk_p=torch.tensor([1.0]), draft_hidden=torch.zeros(HIDDEN)
            )
        first = self.token(request.rid, request.first_position)
        n = request.params.n  # samples 1..n-1 under their own ids (decode names forks `<rid>/<i>`)
        more = tuple(self.token(f"{request.rid}/{i}", request.first_position) for i in range(1, n))
        return Handoff(
            request.rid,
            request.prompt_ids,
            request.params,
            request.seed,
            first,
            k=None,
            v=None,
            first_position=request.first_position,
            more_first_tokens=more,
            **draft,
        )

    # ---- the worker interface ----------------------------------------------------------------------
    def run_batch(self, batch: WorkerBatch) -> BatchResult:
        spec = self.info.spec
        committed = batch.kv_committed_lens_cpu
        assert batch.kv_committed_lens.tolist() == committed, "device kv_committed_lens diverged from the host's"
        assert batch.req_pool_indices.tolist() == batch.req_pool_indices_cpu
        assert len(set(batch.req_pool_indices_cpu)) == len(batch), "a row twice in one batch"
        rows, tokens, accepted = batch.req_pool_indices_cpu, [], []
        for row, n, lane in zip(rows, committed, batch.lanes):
            assert row in self._seeded, f"row {row} in a step without a prebuilt write since its release"
            assert n == self._committed[row], f"row {row}: step starts at {n}, committed {self._committed[row]}"
            base = n - lane.prompt_len + 1  # output index of the first token this step commits
            if spec is None:
                assert n + 1 <= self._seeded[row], f"row {row}: KV past the reservation"
                tokens.append(self.token(lane.rid, base))
                self._committed[row] = n + 1
                continue
            assert n + spec.window <= self._seeded[row], f"row {row}: draft window past the reservation"
            a = min(self.accept(lane.rid, batch.step), spec.num_steps)
            tokens.append([self.token(lane.rid, base + j) for j in range(spec.num_steps + 1)])
            accepted.append(a)
            self._published[row] = n + a + 1
            self._committed[row] = n + a + 1
        self.log.append(("forward", batch.step, tuple(rows)))
        result = BatchResult(
            batch.step,
            HostEvent(),
            torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(accepted, dtype=torch.int64) if spec else None,
        )
        result.results_ready.set_here()
        return result

    def wait(self, result: BatchResult) -> None:
        if result.step == self.fail_at_step:
            raise StreamFailed(f"forward stream failed: step {result.step} broke")
        assert result.results_ready.query()

    def resolve_kv_committed_lens_cpu(self, indices: torch.Tensor) -> torch.Tensor:
        rows = indices.tolist()
        missing = [r for r in rows if r not in self._published]
        assert not missing, f"rows {missing} resolved without a publish since their last resolve"
        return torch.tensor([self._published.pop(r) for r in rows], dtype=torch.int64)

    def write_kv_chunk(self, kv_slots, token_start, layer_start, k, v, draft=False, done=None) -> None:
        self.log.append(("kv", token_start, len(kv_slots)))
        if done is not None:
            done()

    def write_prebuilt(self, req_pool_idx: int, kv_slots: torch.Tensor, handoff: Handoff, fork=None) -> None:
        assert req_pool_idx not in self._seeded, f"row {req_pool_idx} seeded twice"
        self._seeded[req_pool_idx] = len(kv_slots)
        self._committed[req_pool_idx] = handoff.prompt_len
        self._prompt_len[req_pool_idx] = handoff.prompt_len
        if self.info.spec:
            self._published[req_pool_idx] = handoff.prompt_len  # seed_kv_committed_lens
        self.log.append(("prebuilt", req_pool_idx))

    def extend_row(self, req_pool_idx: int, start: int, slots: torch.Tensor) -> None:
        mapped = self._seeded.get(req_pool_idx)
        assert mapped == start, f"row {req_pool_idx}: grown at {start}, but {mapped} positions are mapped"
        self._seeded[req_pool_idx] = start + len(slots)
        self.log.append(("extend", req_pool_idx, start, len(slots)))

    def release_row(self, req_pool_idx: int) -> None:
        self._seeded.pop(req_pool_idx, None)
        self._published.pop(req_pool_idx, None)
        self.log.append(("release", req_pool_idx))

    def raise_if_failed(self) -> None:
        pass

    def synchronize(self, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        self.log.append(("close",))
