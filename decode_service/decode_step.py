"""One plain decode step, run as work on the forward stream: gather each request's pending token from
the FutureMap rows, one target forward (one token per request), sample, stash the sampled tokens
back at the rows for the next step. Returns the tokens on the device."""

from __future__ import annotations

import torch

from common.engine.forward_batch import ForwardBatch
from decode_service.worker_batch import WorkerBatch


def decode_step(runner, fm, batch: WorkerBatch) -> torch.Tensor:
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
    if batch.sampling.argmax_only:  # the greedy head may skip the fp32 logits (common/models/greedy_head.py)
        tokens, _ = runner.forward(fb, greedy=True)
    else:
        logits, _ = runner.forward(fb)
        tokens = batch.sampling.sample(logits, batch.output_indices, runner.config.eos_token_ids)
    fm.stash_tokens(indices, tokens)
    return tokens
