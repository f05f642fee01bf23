"""Offline generation through both services' schedulers and workers in one process: a list of prompts
in, their outputs out.

The decode scheduler (continuous batching, overlap, EAGLE when the runner has a head) with the
prefill worker on a thread (InProcessPrefill), all requests submitted at once: the scheduler admits
them as request and KV slots free, so the batch stays full until the last prompts. Used to measure
a head's accept length and by the benchmarks (which tap each token's arrival).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from common.engine.model_runner import ModelRunner
from common.engine.sampling import SamplingParams
from decode_service.inbox import Inbox
from decode_service.output import RequestOutput
from decode_service.scheduler import DecodeScheduler
from decode_service.worker import DecodeWorker
from prefill_service.inprocess import InProcessPrefill
from prefill_service.worker import PrefillWorker


def generate(
    decode_runner: ModelRunner,
    prefill_runner: ModelRunner,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    progress: str | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    overlap: bool = True,
    chunk_size: int = 2048,
) -> tuple[list[list[int]], tuple[int, int]]:
    """(every prompt's output ids, in order; (drafts accepted, drafts proposed) when speculative).
    `params` is one for all or one per prompt. With `progress`, prints a line with that label as
    outputs complete (about every 10%); `on_tokens(i, new_ids)` sees prompt i's tokens as they come
    (on the scheduler thread). A request that ends in error or abort raises after the run."""
    outputs: list[list[int]] = [[] for _ in prompts]
    failed: list[str] = []
    lock, done, finished, start = threading.Lock(), threading.Event(), [0], time.monotonic()

    def on_output(out: RequestOutput):
        rid, tokens = out.rid, out.new_token_ids
        outputs[int(rid)].extend(tokens)
        if on_tokens is not None and tokens:
            on_tokens(int(rid), tokens)
        if out.finish is None:
            return
        reason = out.finish.reason
        with lock:
            if reason not in ("stop", "length"):
                failed.append(f"{rid}: {reason}")
            finished[0] += 1
            if progress and (finished[0] % max(1, len(prompts) // 10) == 0 or finished[0] == len(prompts)):
                print(
                    f"[{progress}] {finished[0]}/{len(prompts)} ({time.monotonic() - start:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
            if finished[0] == len(prompts):
                done.set()

    params = params if isinstance(params, list) else [params] * len(prompts)
    inbox = Inbox()
    max_batch = decode_runner.req_to_token_pool.allocator.num_free
    worker = PrefillWorker(prefill_runner, chunk_size=chunk_size)
    peer = InProcessPrefill(
        worker,
        inbox.deliver_handoff,
        inbox.fail_handoff,
        max_batch=max_batch,
    )
    sched = DecodeScheduler(DecodeWorker(decode_runner), peer, inbox, overlap=overlap)
    sched.start()
    try:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            sched.submit(str(i), p, sp, on_output)
        if prompts and not done.wait(timeout=24 * 3600):
            raise TimeoutError("offline generation did not finish")
    finally:
        sched.stop()
        peer.close()
        if worker.cache is not None:  # the runner outlives this worker: its prefix cache's slots go back
            worker.cache.reset()
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    return outputs, tuple(sched.spec_stats)
