"""The decode side's grammar matchers: one per constrained request row, kept by one grammar thread.

Under overlap, step N+1's mask depends on step N's token. So the matchers live beside the forward
stream, on their own thread (SGLang's grammar work beside `sampling_info_done`), and every job is
queued from stream work, so the jobs run in stream order:
  - `seed(row, ...)` (with the prebuilt writes): a matcher at the grammar's start, advanced by the
    outputs already committed (the first token from the handoff record, and a retry's resent ones);
  - `fill(rows)` (when a constrained step starts, before its forward): the rows' bitmask, filled
    while the forward runs; the step's sampling waits for it (`Future.result`), and only then;
  - `advance(rows, tokens)` (right after a constrained step samples): its tokens into the matchers.
    On CUDA the tokens are copied to the host without waiting, behind an event the job waits for,
    so the stream work never waits for the device; the next `fill` queues behind it;
  - `release(row)` (with the row's release, after every step that still carries it).
  - EAGLE (`VerifyMask`): `fill_tree(rows, nodes, parents)` once the drafts are known, a mask per
    draft node from the state along its path (accept, fill, roll back), and `advance_runs` with each
    row's committed run (the accepted drafts and the bonus) after the verify.
A batch without a constrained row queues nothing and never waits. The scheduler learns a grammar's
end from the token itself: a constrained request ends ("stop") at an EOS, which the mask allows
only where the grammar may end.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from common.engine import grammar
from common.engine.streams import make_event
from common.forward.host_copy import to_device, to_host
from common.request_rules import InvalidRequest, Overloaded

logger = logging.getLogger(__name__)


class GrammarMatchers:
    def __init__(self, compiler_of, vocab_size: int, device):
        """`compiler_of()`: the model's GrammarCompiler (made on first use)."""
        self._compiler_of = compiler_of
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._matchers: dict[int, object] = {}  # req_pool_idx -> xgr.GrammarMatcher (the thread's alone)

    def seed(self, row: int, constraint: tuple[str, str], outputs: list[int]) -> None:
        def job():
            compiled = grammar.compiled_on_rank(self._compiler_of(), constraint)  # cached since the submit check
            self._matchers[row] = grammar.new_matcher(compiled, outputs)

        self._submit(job)

    def release(self, row: int) -> None:
        self._submit(lambda: self._matchers.pop(row, None))

    def fill(self, rows: list[int]) -> Future:
        """A future of the bitmask [len(rows), W] (host) of the matchers of `rows` as they stand once
        every job queued before this one ran."""
        return self._thread.submit(lambda: grammar.fill_bitmask([self._matchers.get(r) for r in rows], self.vocab_size))

    def advance(self, rows: list[int], tokens: torch.Tensor) -> None:
        """The committed tokens [len(rows)] (on the device) into the rows' matchers, in stream order."""
        host = to_host(tokens)
        ready = make_event(self.device)
        ready.set_here()  # on CUDA: recorded after the copy on this stream; on CPU: done already

        def job():
            ready.synchronize()
            for row, token in zip(rows, host.tolist()):
                grammar.advance(self._matchers.get(row), token)

        self._submit(job)

    def fill_tree(self, rows: list[int], nodes: torch.Tensor, parent: torch.Tensor | None) -> Future:
        """EAGLE's verify: a future of the bitmask [len(rows) * M, W] (host) for the rows' draft nodes
        [len(rows), M] (on the device; node 0 is the pending bonus, already in the matcher) with their
        parents [len(rows), M] (None: a chain), filled once the drafts reach the host (an event on
        CUDA, as `advance`) and every job queued before this one ran."""
        host_nodes, host_parent = to_host(nodes), to_host(parent) if parent is not None else None
        ready = make_event(self.device)
        ready.set_here()

        def job():
            ready.synchronize()
            parents = host_parent.tolist() if host_parent is not None else None
            matchers = [self._matchers.get(r) for r in rows]
            return grammar.fill_tree_bitmask(matchers, host_nodes.tolist(), parents, self.vocab_size)

        return self._thread.submit(job)

    def advance_runs(self, rows: list[int], tokens: torch.Tensor, accepted: torch.Tensor) -> None:
        """EAGLE: row i committed tokens[i, :accepted[i] + 1] (both on the device), into its matcher."""
        host_tokens, host_accepted = to_host(tokens), to_host(accepted)
        ready = make_event(self.device)
        ready.set_here()

        def job():
            ready.synchronize()
            for row, run, a in zip(rows, host_tokens.tolist(), host_accepted.tolist()):
                for token in run[: a + 1]:
                    grammar.advance(self._matchers.get(row), token)

        self._submit(job)

    def _submit(self, job) -> None:
        """A job nobody waits for: its failure is logged (a row left without its matcher stays unmasked)."""

        def logged():
            try:
                job()
            except Exception:
                logger.exception("grammar job failed")

        self._thread.submit(logged)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class VerifyMask:
    """One EAGLE verify's grammar work for its batch's constrained lanes: the masks of their draft
    nodes (asked for before the verify forward, filled on the grammar thread while it runs), applied
    to the verify logits after penalties and bias, and the committed run of each lane into its
    matcher afterwards. `of` gives None for a batch without a constrained lane (nothing queued)."""

    def __init__(self, matchers: GrammarMatchers, lanes: list[int], rows: list[int], nodes, parent):
        m, device = nodes.shape[1], nodes.device
        self.matchers, self.rows = matchers, rows
        self.lanes = to_device(lanes, device)
        self.node_rows = to_device([lane * m + j for lane in lanes for j in range(m)], device)
        sub_parent = parent.index_select(0, self.lanes) if parent is not None else None
        self.mask = matchers.fill_tree(rows, nodes.index_select(0, self.lanes), sub_parent)

    @classmethod
    def of(cls, matchers, batch, nodes: torch.Tensor, parent: torch.Tensor | None = None) -> VerifyMask | None:
        """nodes [B, M] (node 0 the pending bonus), parent [B, M] or None for a chain."""
        lanes = batch.sampling.constrained if matchers is not None else []
        if not lanes:
            return None
        return cls(matchers, lanes, [batch.req_pool_indices_cpu[i] for i in lanes], nodes, parent)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B * M, V] -> a copy with the constrained lanes' nodes masked (waits for the fill)."""
        return grammar.apply_bitmask(logits, self.node_rows, self.mask.result())

    def advance(self, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
        """tokens [B, S + 1], accepted [B] (the step's output): each lane's committed run to its matcher."""
        self.matchers.advance_runs(self.rows, tokens.index_select(0, self.lanes), accepted.index_select(0, self.lanes))


def check_request(worker, params):
    """The scheduler's submit check of a constrained request (on the caller's thread, before anything
    is queued): its grammar compiles (EAGLE masks each draft node: VerifyMask). Returns the compiled
    grammar (None without a constraint), which the request keeps: the scheduler's thread never compiles.
    Raises InvalidRequest naming the field."""
    try:
        constraint = params.constraint
        if constraint is None:
            return
        if not hasattr(worker, "grammar_compiler"):
            raise grammar.GrammarError(f"{constraint[0]}: this worker serves no grammars")
        return worker.grammar_compiler().compile(constraint)
    except grammar.GrammarBusy as e:
        raise Overloaded(str(e)) from None
    except grammar.GrammarError as e:
        raise InvalidRequest(str(e)) from None


def check_outputs(req, outputs: list[int], firsts=()) -> None:
    """A prefill replica's tokens against the request's grammar, on the scheduler's thread before
    anything of the record is submitted: `outputs` (committed) and then each of `firsts` (the first
    token of each sample) must be accepted, else GrammarError (a ValueError: that request's error,
    never the grammar thread's). A fresh matcher per check: tens of microseconds, from the grammar the
    request keeps since its submit check (`DecodeReq.grammar`), never a compile here."""
    compiled, constraint = req.grammar, req.params.constraint
    if compiled is None:
        return
    matcher = grammar.new_matcher(compiled, outputs)
    for token in firsts:
        if not matcher.accept_token(int(token)):
            raise grammar.GrammarError(f"first token {token} is not allowed by the request's {constraint[0]}")
        matcher.rollback(1)


async def compile_off_loop(worker, params) -> None:
    """The front door's wait for a request's grammar, without blocking its event loop (the compile
    pool works, the loop serves other calls); InvalidRequest naming the field when it does not compile."""
    constraint = params.constraint
    if constraint is None or not hasattr(worker, "grammar_compiler"):
        return  # submit() says what is wrong, if anything
    try:
        compiler = worker.grammar_compiler()
        fut = compiler.compile_async(constraint)
        await asyncio.shield(asyncio.wrap_future(fut))  # bounded by the pool: a wait, then a compile
    except grammar.GrammarBusy as e:
        raise Overloaded(str(e)) from None
    except grammar.GrammarError as e:
        raise InvalidRequest(str(e)) from None
    except Exception as e:
        raise InvalidRequest(f"{constraint[0]} does not compile: {str(e).strip().splitlines()[0][:300]}") from None
