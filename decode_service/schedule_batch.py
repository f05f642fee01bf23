"""ScheduleBatch: the scheduler's view of the running batch, with CPU values and device mirrors.

`kv_committed_lens` (device) always mirrors `kv_committed_lens_cpu`: per request, the tokens whose KV
is committed (a pending token excluded; SGLang's Req.kv_committed_len). Every change makes new
tensors (bump, filter, merge): an in-flight forward may still read the old ones, and the forward
never writes them (speculative changes go to the ForwardBatch, whose `seq_lens` is the KV length
after the forward). `kv_committed_lens_sum` is always derived from `kv_committed_lens_cpu` by one
helper, never kept as a separate number that can go stale.
Sampling parameters live on the batch (`sampling`), built once per membership, not per step.
"""

from __future__ import annotations

import torch

from common.engine.sampling import SamplingBatch
from common.engine.spec_sampling import SpecDraws
from common.forward.host_copy import to_device
from decode_service.req import DecodeReq, ReqState
from decode_service.worker_batch import Lane, WorkerBatch


class ScheduleBatch:
    def __init__(self, reqs: list[DecodeReq], committed_cpu: torch.Tensor, device: torch.device):
        self.reqs = reqs
        self.device = device
        self.req_pool_indices_cpu = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        self.req_pool_indices = to_device(self.req_pool_indices_cpu, device)
        self.kv_committed_lens_cpu = committed_cpu.to(torch.int64)
        self.kv_committed_lens = to_device(self.kv_committed_lens_cpu, device)

    @classmethod
    def empty(cls, device: torch.device) -> ScheduleBatch:
        return cls([], torch.empty(0, dtype=torch.int64), device)

    @classmethod
    def prebuilt(cls, reqs: list[DecodeReq], kv_committed_lens: list[int], device: torch.device) -> ScheduleBatch:
        """A prebuilt batch: the committed lengths are the handed-over KV's (prompt, plus tokens resent on
        a retry)."""
        return cls(reqs, torch.tensor(kv_committed_lens, dtype=torch.int64), device)

    def __len__(self) -> int:
        return len(self.reqs)

    @property
    def sampling(self) -> SamplingBatch:
        """The batch's sampling inputs, made once per membership (filter/merge make new batches)."""
        if "_sampling" not in self.__dict__:
            self._sampling = SamplingBatch([r.params for r in self.reqs], [r.seed for r in self.reqs])
        return self._sampling

    def get_worker_batch(self, step: int, spec_steps: int, vocab_size: int) -> WorkerBatch:
        """Step `step`'s frozen input (SGLang's get_model_worker_batch); `spec_steps`: EAGLE's
        num_steps (0 without EAGLE), for the draws of lanes with temperature > 0."""
        committed = self.kv_committed_lens_cpu.tolist()
        sampling = self.sampling
        output_indices = []  # the output index each lane samples (random draws and the min_new_tokens mask)
        if not sampling.all_greedy or sampling.holds_back:
            output_indices = [n - r.prompt_len + 1 for n, r in zip(committed, self.reqs)]
        draws = None
        if spec_steps and not sampling.all_greedy:  # the lanes with temperature > 0 and their uniforms
            outputs_so_far = [n - r.prompt_len for n, r in zip(committed, self.reqs)]
            draws = SpecDraws.build(sampling.params, sampling.seeds, outputs_so_far, spec_steps, vocab_size)
        return WorkerBatch(
            step=step,
            req_pool_indices=self.req_pool_indices,
            req_pool_indices_cpu=self.req_pool_indices_cpu.tolist(),
            kv_committed_lens=self.kv_committed_lens,
            kv_committed_lens_cpu=committed,
            sampling=sampling,
            output_indices=output_indices,
            lanes=tuple(Lane(r.rid, r.prompt_len) for r in self.reqs),
            draws=draws,
        )

    @property
    def kv_committed_lens_sum(self) -> int:
        return int(self.kv_committed_lens_cpu.sum())

    def set_kv_committed_lens(self, committed_cpu: torch.Tensor) -> None:
        """EAGLE: the lengths resolved from the last step's publish (new tensors; never in place)."""
        self.kv_committed_lens_cpu = committed_cpu.to(torch.int64)
        self.kv_committed_lens = to_device(self.kv_committed_lens_cpu, self.device)

    def bump(self) -> None:
        """Every request committed one more token (new tensors; never in place; on CPU one serves both)."""
        same = self.kv_committed_lens is self.kv_committed_lens_cpu
        self.kv_committed_lens_cpu = self.kv_committed_lens_cpu + 1
        self.kv_committed_lens = self.kv_committed_lens_cpu if same else self.kv_committed_lens + 1

    def filter_unfinished(self, ending: frozenset[int] = frozenset()) -> ScheduleBatch:
        """The batch less its finished requests, those retracted meanwhile (no longer RUNNING) and those
        in `ending` (ids of requests whose last token the step in flight computes)."""
        keep = [
            i for i, r in enumerate(self.reqs) if not r.finished and r.state == ReqState.RUNNING and id(r) not in ending
        ]
        if len(keep) == len(self.reqs):
            return self
        out = ScheduleBatch.__new__(ScheduleBatch)
        idx = torch.tensor(keep, dtype=torch.int64)
        out.reqs = [self.reqs[i] for i in keep]
        out.device = self.device
        out.req_pool_indices_cpu = self.req_pool_indices_cpu[idx]
        out.req_pool_indices = self.req_pool_indices[to_device(idx, self.device)]
        out.kv_committed_lens_cpu = self.kv_committed_lens_cpu[idx]
        out.kv_committed_lens = self.kv_committed_lens[to_device(idx, self.device)]
        return out

    def merge(self, other: ScheduleBatch) -> ScheduleBatch:
        if not len(other):
            return self
        out = ScheduleBatch.__new__(ScheduleBatch)
        out.reqs = self.reqs + other.reqs
        out.device = self.device
        out.req_pool_indices_cpu = torch.cat([self.req_pool_indices_cpu, other.req_pool_indices_cpu])
        out.req_pool_indices = torch.cat([self.req_pool_indices, other.req_pool_indices])
        out.kv_committed_lens_cpu = torch.cat([self.kv_committed_lens_cpu, other.kv_committed_lens_cpu])
        out.kv_committed_lens = torch.cat([self.kv_committed_lens, other.kv_committed_lens])
        return out

    def check_mirror(self) -> None:
        """Debug: the device kv_committed_lens equal the CPU ones (a host sync)."""
        if not torch.equal(self.kv_committed_lens.cpu(), self.kv_committed_lens_cpu):
            device, host = self.kv_committed_lens.tolist(), self.kv_committed_lens_cpu.tolist()
            raise AssertionError(f"kv_committed_lens mirror diverged: {device} vs {host}")
