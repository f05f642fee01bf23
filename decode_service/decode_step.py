"""One plain decode step, run as work on the forward stream: gather each request's pending token from
the FutureMap rows, one target forward (one token per request), sample, stash the sampled tokens
back at the rows for the next step. Returns the tokens on the device, and the logprobs of the rows
that ask for them (common/engine/logprobs.py).
Rows with a penalty or a logit bias count their pending token in the FutureMap's penalty state (on
this stream, from the gathered token: no host value) and have their logits processed before sampling."""

from __future__ import annotations

import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.logprobs import StepLogprobs
from decode_service.worker_batch import WorkerBatch


def decode_step(runner, fm, batch: WorkerBatch) -> tuple[torch.Tensor, StepLogprobs | None]:
    indices = batch.req_pool_indices
    input_ids = fm.gather_tokens(indices)
    fb = ForwardBatch.decode(
        runner.req_to_token_pool.req_to_token,
        indices,
        batch.kv_committed_lens_cpu,
        input_ids,
        batch.kv_committed_lens,
        req_pool_indices_cpu=batch.req_pool_indices_cpu,
    )
    procs = batch.sampling.processors(indices.device)
    if procs is not None:  # the pending token is an output token from now on
        fm.penalties.add(indices[procs.rows], input_ids[procs.rows])
    if batch.sampling.argmax_only:  # the greedy head may skip the fp32 logits (common/models/greedy_head.py)
        tokens, _ = runner.forward(fb, greedy=True)
    else:
        raw, _ = runner.forward(fb)
        logits = raw
        if procs is not None:
            logits = procs.apply(raw, *fm.penalties.gather(indices[procs.rows]))
        tokens = batch.sampling.sample(logits, batch.output_indices, runner.config.eos_token_ids)
    fm.stash_tokens(indices, tokens)
    asking = batch.sampling.logprob_rows(indices.device)  # never with the greedy head: it needs the logits
    return tokens, (asking.compute(raw, tokens) if asking is not None else None)
