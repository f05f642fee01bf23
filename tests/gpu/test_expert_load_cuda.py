"""The experts' load counters on CUDA (common/models/expert_load.py): the count is one in-place kernel
that syncs nothing with the host and replays inside a CUDA graph; an MoE forward on CUDA counts what
the same forward counts on CPU, and a scrape's read from another thread sees it."""

from __future__ import annotations

import threading

import pytest
import torch

from common.engine.model_runner import ModelRunner, RunnerArgs
from common.forward.forward_batch import ForwardBatch
from common.models.expert_load import count_routed

pytestmark = pytest.mark.gpu


def test_the_count_syncs_nothing_and_replays_in_a_cuda_graph():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 8, (64, 2), generator=g) for _ in range(3)]
    counts = torch.zeros(8, dtype=torch.int64, device="cuda")
    ids = batches[0].cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        count_routed(counts, ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert counts.cpu().tolist() == torch.bincount(batches[0].reshape(-1), minlength=8).tolist()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as CUDA graphs want
        count_routed(counts, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        count_routed(counts, ids)
    counts.zero_()
    for b in batches:
        ids.copy_(b)
        graph.replay()
    torch.cuda.synchronize()
    want = sum(torch.bincount(b.reshape(-1), minlength=8) for b in batches)
    assert counts.cpu().tolist() == want.tolist()


@pytest.mark.parametrize("variant", ["qwen3-moe", "deepseek-v3"])
def test_a_cuda_forward_counts_what_the_cpu_forward_counts(checkpoint, variant):
    path = checkpoint(variant)
    prompt = torch.randint(3, 384, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    reads = {}
    for device in ("cpu", "cuda"):
        runner = ModelRunner(RunnerArgs(path, device=device, dtype="float32", max_total_tokens=256))
        row = runner.req_to_token_pool.alloc()
        runner.req_to_token_pool.write(row, 0, runner.kv_allocator.alloc(len(prompt)))
        runner.forward(ForwardBatch.extend(runner.req_to_token_pool.req_to_token, [row], [0], [prompt]))
        assert runner.expert_load.counts.device.type == device
        reader = threading.Thread(  # as a scrape reads: from another thread
            target=lambda load=runner.expert_load, d=device: reads.__setitem__(d, load.read())
        )
        reader.start()
        reader.join()
    k = runner.config.moe.top_k
    assert int(reads["cuda"].sum()) == len(runner.expert_load.layers) * k * len(prompt)
    assert torch.equal(reads["cuda"], reads["cpu"])
