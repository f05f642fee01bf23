"""The seam's types: what the worker tells of its model (WorkerInfo), what the scheduler hands it
(WorkerBatch) and what it gets back (BatchResult).

SGLang's ScheduleBatch -> ModelWorkerBatch -> ForwardBatch: the scheduler keeps a ScheduleBatch
(schedule_batch.py), freezes what one step's forward needs into a WorkerBatch, and the worker
(worker.py) turns it into the ForwardBatches its model reads. A WorkerBatch is never mutated: an
in-flight forward may still read it while the scheduler builds the next one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from common.engine.logprobs import StepLogprobs
from common.engine.sampling import SamplingBatch
from common.engine.spec_sampling import SpecDraws

if TYPE_CHECKING:  # the draft runner loads models; the scheduler side never imports it
    from common.engine.draft_runner import SpecArgs


class Lane(NamedTuple):
    """One request's place in a batch, as tests that plant drafts see it."""

    rid: str
    prompt_len: int


@dataclass(frozen=True)
class WorkerBatch:
    """One decode step's input. Row i of every field is request i of the batch."""

    step: int
    req_pool_indices: torch.Tensor  # [B] int64 on the device: the FutureMap rows (invariant 1)
    req_pool_indices_cpu: list[int]
    # [B] int64 on the device: each request's tokens whose KV is committed, before this step's pending
    # token (SGLang's Req.kv_committed_len; the ScheduleBatch mirror). The ForwardBatch's `seq_lens` is
    # the KV length after the forward instead.
    kv_committed_lens: torch.Tensor
    kv_committed_lens_cpu: list[int]
    sampling: SamplingBatch
    output_indices: list[int]  # plain decode: the output index each lane samples (random draws, min_new_tokens)
    lanes: tuple[Lane, ...]
    draws: SpecDraws | None = None  # EAGLE: the lanes with temperature > 0 and their uniforms
    fence: object = None  # EAGLE: this step's publish_ready, armed by the worker at submit (invariant 3)

    def __len__(self) -> int:
        return len(self.req_pool_indices_cpu)


@dataclass
class BatchResult:
    """One launched step's output. The worker fills the host copies on its stream, then sets
    `results_ready`; the scheduler reads them only after `worker.wait(result)` returned."""

    step: int
    results_ready: object  # an event (common/engine/streams.py)
    tokens_cpu: torch.Tensor | None = None  # [B], or EAGLE's [B, S+1]
    accepted_cpu: torch.Tensor | None = None  # EAGLE: accepted drafts per request [B]
    logprobs_cpu: StepLogprobs | None = None  # the rows that ask for logprobs (common/engine/logprobs.py)


@dataclass(frozen=True)
class WorkerInfo:
    """What the scheduler needs to know about the model behind the worker."""

    device: torch.device
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    num_layers: int  # the target's (a handoff's KV must cover them)
    hidden_size: int  # the target's (an EAGLE draft seed's hidden is this wide)
    spec: SpecArgs | None  # EAGLE settings, None without a draft head
