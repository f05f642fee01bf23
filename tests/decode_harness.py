"""Wire a prefill worker and a decode scheduler in one process for tests.

`Pair` runs the scheduler thread with an in-process prefill thread (the realistic shape).
`ManualPair` steps the scheduler by hand and holds prefill requests until the test releases them,
so a test can act at an exact stage of a request's life.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common.engine.draft_runner import SpecArgs
from common.engine.model_runner import ModelRunner, RunnerArgs
from decode_service.hooks import DecodeHooks
from decode_service.inbox import Inbox
from decode_service.output import Finish, RequestOutput
from decode_service.scheduler import DecodeScheduler
from decode_service.worker import DecodeWorker
from prefill_service.inprocess import InProcessPrefill
from prefill_service.worker import PrefillWorker


class Hooks(DecodeHooks):
    """Test hooks of a HookedWorker from plain callables (None: not called): the worker's planting hooks
    (decode_service/hooks.py) and two seams of the step loop."""

    def __init__(self, before_forward=None, after_launch=None, propose=None, propose_tree=None, retract=None):
        self.before_forward: Callable[[int], object] | None = before_forward  # on the stream, before step N's forward
        self.after_launch: Callable[[int], object] | None = after_launch  # scheduler thread, once step N is submitted
        self._chain: Callable | None = propose  # (lanes, committed lengths, drafts [B, S]) -> drafts to verify
        self._tree: Callable | None = propose_tree  # (lanes, committed lengths, tokens, parent, depth) -> tokens
        self._retract: Callable | None = retract  # (step, DecodeReqs) -> those to retract before it launches

    def propose(self, lanes, committed_lens, drafts):
        return drafts if self._chain is None else self._chain(lanes, committed_lens, drafts)

    def propose_tree(self, lanes, committed_lens, tokens, parent, depth):
        return tokens if self._tree is None else self._tree(lanes, committed_lens, tokens, parent, depth)

    def retract(self, step, reqs):
        return [] if self._retract is None else self._retract(step, reqs)


class HookedWorker(DecodeWorker):
    """The real worker with the step loop's test seams; drafts are planted through its hooks."""

    def __init__(self, runner: ModelRunner, hooks: Hooks | None = None):
        super().__init__(runner, debug=True, hooks=hooks or Hooks())

    def run_batch(self, batch):
        result = super().run_batch(batch)
        if self.hooks.after_launch:
            self.hooks.after_launch(batch.step)
        return result

    def forward(self, batch):
        if self.hooks.before_forward:
            self.hooks.before_forward(batch.step)
        return super().forward(batch)


class Outputs:
    """Collects RequestOutputs: ids per request, and each finished request's reason and Finish."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}
        self.finishes: dict[str, Finish] = {}
        self.logprobs: dict[str, list] = {}  # the requests that asked: one TokenLogprobs per id

    def __call__(self, out: RequestOutput):
        assert out.rid not in self.reasons, f"{out.rid}: output after finish"
        self.tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        if out.logprobs is not None:
            self.logprobs.setdefault(out.rid, []).extend(out.logprobs)
        if out.finish is not None:
            self.reasons[out.rid] = out.finish.reason
            self.finishes[out.rid] = out.finish


def runners(
    path: str,
    decode_tokens: int = 2048,
    decode_reqs: int = 16,
    spec: SpecArgs | None = None,
    device: str = "cpu",
    dtype: str = "auto",
    attention_backend: str = "batched",
    static_decode_buffers: bool = False,
    cuda_graph: bool = False,
    greedy_head: str = "auto",
    linear_layout: str = "auto",
    torch_compile_max_bs: int = 0,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
):
    spec = spec or SpecArgs()
    kw = dict(spec=spec, device=device, dtype=dtype, attention_backend=attention_backend, greedy_head=greedy_head)
    kw.update(linear_layout=linear_layout, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    prefill = ModelRunner(RunnerArgs(path, max_total_tokens=1024, max_running_requests=8, **kw))
    decode = ModelRunner(
        RunnerArgs(
            path,
            max_total_tokens=decode_tokens,
            max_running_requests=decode_reqs,
            static_decode_buffers=static_decode_buffers,
            cuda_graph=cuda_graph,
            torch_compile_max_bs=torch_compile_max_bs,
            **kw,
        )
    )
    if cuda_graph or torch_compile_max_bs:
        decode.warmup()  # captures the decode graphs / compiles the decode steps
    return prefill, decode


def check_idle_books(sched) -> None:
    """An idle decode scheduler's books balance: every KV slot free or its prefix cache's (held once,
    by the tree, with every lock dropped), every request slot free."""
    sched.check_integrity()
    cache = sched.books.cache
    assert sched.worker.kv_allocator.num_used == (cache.tree.tree_size if cache is not None else 0)
    assert cache is None or cache.tree.locked_size == 0
    assert sched.worker.req_to_token_pool.allocator.num_used == 0


class Pair:
    def __init__(
        self,
        path: str,
        overlap: bool = True,
        chunk_size: int = 16,
        hooks: Hooks | None = None,
        kv_reservation: str = "on-demand",
        kv_grow_tokens: int = 32,
        prefix_cache: bool = False,
        **sizes,
    ):  # sizes: runners()' keywords
        prefill, decode = runners(path, **sizes)
        self.out = Outputs()
        self.inbox = Inbox()
        self.link = InProcessPrefill(
            PrefillWorker(prefill, chunk_size), self.inbox.deliver_handoff, self.inbox.fail_handoff
        )
        self.worker = HookedWorker(decode, hooks)
        self.scheduler = DecodeScheduler(
            self.worker,
            self.link,
            self.inbox,
            overlap=overlap,
            debug=True,
            kv_reservation=kv_reservation,
            kv_grow_tokens=kv_grow_tokens,
            prefix_cache=prefix_cache,
        )
        self.scheduler.start()

    def submit(self, rid, prompt, params):
        self.scheduler.submit(rid, prompt, params, self.out)

    def run(self, prompts, params) -> dict:
        """Submit each prompt as request str(i) (`params`: one SamplingParams, or one per prompt), wait for all;
        the output tokens by request id."""
        for i, p in enumerate(prompts):
            self.submit(str(i), p, params[i] if isinstance(params, list) else params)
        self.wait([str(i) for i in range(len(prompts))])
        return self.out.tokens

    def wait(self, rids, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while not all(r in self.out.reasons for r in rids):
            assert time.time() < deadline, f"timed out; finished: {sorted(self.out.reasons)}"
            self.worker.raise_if_failed()
            time.sleep(0.005)

    def wait_tokens(self, rid: str, n: int, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while len(self.out.tokens.get(rid, [])) < n and rid not in self.out.reasons:
            assert time.time() < deadline, f"{rid}: fewer than {n} tokens in time"
            time.sleep(0.001)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Return once the scheduler holds no request: a finished request's output reaches the client
        before its slots are freed (and its KV joins the prefix cache), so tests that read the books
        wait for this first."""
        deadline = time.time() + timeout
        while not self.scheduler.idle:
            assert time.time() < deadline, "scheduler never went idle"
            time.sleep(0.005)
        time.sleep(0.05)

    def close(self) -> None:
        """Wait for idle, check pool integrity, stop."""
        self.wait_idle()
        check_idle_books(self.scheduler)
        self.scheduler.stop()
        self.link.close()


class ManualPair:
    """Scheduler stepped by the test; prefill requests held in `pending` until `prefill()`."""

    def __init__(
        self,
        path: str,
        overlap: bool = True,
        hooks: Hooks | None = None,
        kv_reservation: str = "on-demand",
        kv_grow_tokens: int = 32,
        **sizes,
    ):
        prefill, decode = runners(path, **sizes)
        self.prefill_worker = PrefillWorker(prefill, chunk_size=16)
        self.pending = []
        self.out = Outputs()
        self.worker = HookedWorker(decode, hooks)
        self.scheduler = DecodeScheduler(
            self.worker,
            self.pending.append,
            overlap=overlap,
            debug=True,
            kv_reservation=kv_reservation,
            kv_grow_tokens=kv_grow_tokens,
        )

    def submit(self, rid, prompt, params):
        self.scheduler.submit(rid, prompt, params, self.out)

    def prefill(self, rid=None):
        """Run and deliver the held prefill requests (or only `rid`)."""
        take = [r for r in self.pending if rid is None or r.rid == rid]
        for r in take:
            self.pending.remove(r)
        for h in self.prefill_worker.prefill(take):
            self.scheduler.inbox.deliver_handoff(h)

    def run_until_idle(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            self.scheduler.step()
            if self.scheduler.idle:
                return
        raise AssertionError("not idle")

    def close(self) -> None:
        self.run_until_idle()
        self.worker.synchronize(timeout=10)
        self.scheduler.check_integrity()
        assert self.worker.kv_allocator.num_used == 0
        self.scheduler.stop()
