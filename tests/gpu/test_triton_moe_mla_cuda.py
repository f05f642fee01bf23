"""The experts' grouped GEMM (common/models/triton_moe.py) and MLA's latent decode kernel
(common/attention/triton_latent.py) compiled on CUDA: each against its torch reference in fp32 and
bf16, with no host sync (torch.cuda.set_sync_debug_mode("error") raises on one), the grouped GEMM
replayed inside a CUDA graph with new routings, a whole sparse layer's forward sync-free, and tiny
Qwen3-MoE / DeepSeek-V3 models on the triton backend token-exact with HF."""

from __future__ import annotations

import pytest
import torch

from common.attention.latent import latent_attention
from common.attention.triton_backend import TritonBackend
from common.engine.kv_pool import KVPool
from common.engine.req_to_token_pool import ReqToTokenPool
from common.forward.forward_batch import ForwardBatch
from common.models import moe, triton_moe
from tests.gpu.sync_check import no_sync

pytestmark = pytest.mark.gpu


def _experts(tokens, k, experts, hidden, inter, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    x = torch.randn(tokens, hidden, generator=g)
    probs = torch.tensor([1.5**-e for e in range(experts)], dtype=torch.float64)  # uneven, some idle
    ids = torch.stack([torch.multinomial(probs, k, generator=g) for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    cuda = [t.cuda() for t in (x, ids, weights)] + [w.to("cuda", dtype) for w in (gate_up, down)]
    cuda[0] = cuda[0].to(dtype)
    return cuda


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize(
    "tokens,k,experts,hidden,inter", [(1, 8, 64, 2048, 768), (300, 8, 64, 2048, 768), (5, 2, 8, 64, 32)]
)
def test_grouped_gemm_on_cuda_matches_torch_without_a_sync(dtype, tol, tokens, k, experts, hidden, inter):
    x, ids, weights, gate_up, down = _experts(tokens, k, experts, hidden, inter, tokens, dtype)
    half = experts // 2  # expert parallelism: this rank's experts [half, E), pairs routed below left out

    def run():
        return (
            triton_moe.run_experts(x, ids, weights, gate_up, down),
            triton_moe.run_experts(x, ids, weights, gate_up[half:], down[half:], half),
        )

    run()  # compiles
    with no_sync():
        got, ep = run()
    want = moe.run_experts(x.float(), ids, weights, gate_up.float(), down.float())
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    want_ep = moe.run_experts(x.float(), ids, weights, gate_up[half:].float(), down[half:].float(), half)
    torch.testing.assert_close(ep.float(), want_ep, atol=tol, rtol=tol)


def test_grouped_gemm_replays_in_a_cuda_graph_with_new_routings():
    x, ids, weights, gate_up, down = _experts(16, 4, 16, 256, 128, 0, torch.float32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as CUDA graphs want
        triton_moe.run_experts(x, ids, weights, gate_up, down)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.run_experts(x, ids, weights, gate_up, down)
    for seed in (1, 2, 3):  # the same shapes, other routings: each expert's rows and tiles change
        nx, nids, nweights, _, _ = _experts(16, 4, 16, 256, 128, seed, torch.float32)
        nids = torch.where(torch.arange(16, device="cuda")[:, None] < 8, nids, nids.flip(1) % 3)  # a pile-up
        for dst, src in ((x, nx), (ids, nids), (weights, nweights)):
            dst.copy_(src)
        graph.replay()
        torch.testing.assert_close(out, moe.run_experts(x, ids, weights, gate_up, down), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["qwen3-moe", "deepseek-v3"])
def test_a_sparse_layer_forward_syncs_nothing(checkpoint, variant):
    """Router, load counter, Triton experts and shared experts: one whole SparseMoE forward."""
    from common.engine.model_runner import ModelRunner, RunnerArgs

    runner = ModelRunner(RunnerArgs(checkpoint(variant), device="cuda", dtype="float32", attention_backend="triton"))
    layer = next(m for m in runner.model.modules() if isinstance(m, moe.SparseMoE))
    assert layer.experts_kernel is not None
    x = torch.randn(9, runner.config.hidden_size, device="cuda")
    with torch.inference_mode():
        layer(x)
        with no_sync():
            got = layer(x)
        layer.experts_kernel = None
        torch.testing.assert_close(got, layer(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,rank,rope", [(16, 512, 64), (128, 512, 64), (4, 32, 8)])
def test_latent_decode_on_cuda_matches_the_torch_loop_without_a_sync(dtype, tol, heads, rank, rope):
    committed = [0, 1, 31, 255, 1000, 4097]
    g = torch.Generator().manual_seed(heads)
    slots = sum(committed) + len(committed) + 8
    pool = KVPool(slots, 1, 1, rank + rope, dtype, "cuda", v_head_dim=0)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    table = ReqToTokenPool(len(committed) + 1, max(committed) + 8, "cuda")
    free = (torch.randperm(slots, generator=g) + 1).tolist()
    rows = []
    for n in committed:
        row = table.alloc()
        table.write(row, 0, torch.tensor([free.pop() for _ in range(n + 1)]))
        rows.append(row)
    fb = ForwardBatch.decode(
        table.req_to_token, torch.tensor(rows).cuda(), committed, torch.zeros(len(rows)).cuda(), None, rows
    )
    q = torch.randn(len(rows), heads, rank + rope, generator=g).to("cuda", dtype)
    latent = torch.randn(len(rows), 1, rank + rope, generator=g).to("cuda", dtype)
    backend = TritonBackend(pool, table)
    backend.init_forward_metadata(fb)
    backend.latent_attention(q, latent, rank, 0, fb, 0.1)  # compiles
    with no_sync():
        backend.init_forward_metadata(fb)
        got = backend.latent_attention(q, latent, rank, 0, fb, 0.1)
    want = latent_attention(backend, q, latent, rank, 0, fb, 0.1)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("variant", ["qwen3-moe", "deepseek-v3", "deepseek-v3-nolora"])
def test_moe_and_mla_on_triton_match_hf_greedy_on_cuda(checkpoint, variant):
    from common.engine.colocated import ColocatedLoop
    from common.engine.model_runner import ModelRunner, RunnerArgs
    from common.engine.sampling import SamplingParams
    from tests.oracle import hf_greedy

    path = checkpoint(variant)
    runner = ModelRunner(RunnerArgs(path, device="cuda", dtype="float32", attention_backend="triton"))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 5, 40, 13)]
    reqs = ColocatedLoop(runner, chunk_size=16).generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    for prompt, req in zip(prompts, reqs):
        assert req.output == hf_greedy(path, prompt, 16), f"prompt of length {len(prompt)}"
