"""One plain decode step, run as work on the forward stream: gather each request's pending token from
the FutureMap rows, one target forward (one token per request), sample, stash the sampled tokens
back at the rows for the next step (where the model takes a greedy step in one call, ModelRunner.greedy_step,
that call does all four on the FutureMap's token buffer). Returns the tokens on the device, and the logprobs of the rows
that ask for them (common/engine/logprobs.py).
Rows with a penalty or a logit bias count their pending token in the FutureMap's penalty state (on
this stream, from the gathered token: no host value) and have their logits processed before sampling.
Constrained rows (a grammar) ask the grammar thread for their bitmask before the forward, so it is
filled while the forward runs; their sampling waits for it (after penalties and bias, before
temperature), and their sampled tokens go to the matchers (decode_service/grammar_state.py)."""

from __future__ import annotations

import torch

from common.engine.grammar import apply_bitmask
from common.engine.logprobs import StepLogprobs
from common.forward.forward_batch import ForwardBatch
from common.forward.host_copy import to_device
from decode_service.worker_batch import WorkerBatch


def decode_step(runner, fm, batch: WorkerBatch, grammar=None) -> tuple[torch.Tensor, StepLogprobs | None]:
    indices = batch.req_pool_indices
    if batch.sampling.argmax_only:  # gather, forward, argmax and stash in one call where the model has it (CPU)
        buffer = fm.tokens_in_place(indices)
        tokens = runner.greedy_step(buffer, indices, batch.kv_committed_lens, batch.kv_committed_lens_cpu)
        if tokens is not None:
            return tokens, None
    lanes = batch.sampling.constrained if grammar is not None else []
    rows = [batch.req_pool_indices_cpu[i] for i in lanes]
    mask = grammar.fill(rows) if lanes else None  # filled on the grammar thread while the forward runs
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
        if mask is not None:  # waits for step N's tokens in the matchers (an unconstrained batch never does)
            lane_idx = to_device(lanes, indices.device)
            logits = apply_bitmask(logits, lane_idx, mask.result())
        tokens = batch.sampling.sample(logits, batch.output_indices, runner.config.eos_token_ids)
        if lanes:
            grammar.advance(rows, tokens.index_select(0, lane_idx))
    fm.stash_tokens(indices, tokens)
    asking = batch.sampling.logprob_rows(indices.device)  # never with the greedy head: it needs the logits
    return tokens, (asking.compute(raw, tokens) if asking is not None else None)
