"""One plain decode step, run as work on the forward stream: gather each request's pending token from
the FutureMap rows, one target forward (one token per request), sample, stash the sampled tokens
back at the rows for the next step. Returns the tokens on the device."""

from __future__ import annotations

import torch

from common.engine.forward_batch import ForwardBatch


def decode_step(runner, fm, indices: torch.Tensor, rows: list[int], seq_lens_cpu: list[int], seq_lens: torch.Tensor,
                sampling, positions: list[int]) -> torch.Tensor:
    input_ids = fm.gather_tokens(indices)
    fb = ForwardBatch.decode(runner.req_to_token_pool.req_to_token, indices, seq_lens_cpu, input_ids, seq_lens,
                             req_pool_indices_cpu=rows)
    logits, _ = runner.forward(fb)
    tokens = sampling.sample(logits, positions)
    fm.stash_tokens(indices, tokens)
    return tokens
