"""On CUDA: the fused Triton ops (common/models/cuda_fused.py) compiled, rounding bf16 where the torch
ops round, with no host sync; the GEMV (common/models/cuda_gemv.py) against cuBLAS, captured and
tuned; MoE and latent-attention decode steps, and the MTP draft's steps,
replayed from captured CUDA graphs against HF greedy. The fp32 logic runs on CPU under the
interpreter in tests/test_cuda_fused.py; the services' default CUDA path (every other GPU test) runs
these ops too."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from common.engine.draft_runner import SpecArgs
from common.engine.sampling import SamplingParams
from common.models import cuda_fused, cuda_gemv
from common.models.decoder import RMSNorm
from common.models.rope import RotaryEmbedding, apply_rotary
from tests.decode_harness import Pair
from tests.gpu.sync_check import no_sync
from tests.oracle import hf_greedy

pytestmark = pytest.mark.gpu


def _same_rounding(got: torch.Tensor, want: torch.Tensor, name: str, scale: torch.Tensor | None = None) -> None:
    """Equal but for rare last-bit flips (a reduction's order or exp's last bit moves a value across a
    rounding boundary): at most 1 in 200 values differ, none by more than 1 bf16 ulp of the value, or
    of `scale` where given: rotary's sum of two products can cancel, and a flip in a normed input
    is then many ulps of a small output (seen on an H100 with q_norm) but one ulp of the inputs."""
    assert got.dtype == want.dtype and got.shape == want.shape, name
    differ = got != want
    ulp = want.float().abs().clamp(min=1e-30) * 2.0**-7
    if scale is not None:
        ulp = torch.maximum(ulp, scale.float() * 2.0**-7)
    assert differ.float().mean().item() <= 5e-3, f"{name}: {int(differ.sum())} of {want.numel()} differ"
    assert ((got.float() - want.float()).abs() <= ulp * 1.01).all(), f"{name}: a value off by more than 1 ulp"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_ops_round_as_the_torch_ops_without_a_sync(dtype):
    g = torch.Generator().manual_seed(0)
    ops = cuda_fused.FusedOps()
    t, width, heads, kv_heads, d = 37, 4096, 32, 8, 128
    x = torch.randn(t, width, generator=g).to("cuda", dtype)
    r = (torch.randn(t, width, generator=g) * 4).to("cuda", dtype)
    norm = RMSNorm(width, 1e-5).to("cuda", dtype)
    norm.weight.data = torch.randn(width, generator=g).to("cuda", dtype)
    gate_up = torch.randn(t, 2 * 14336, generator=g).to("cuda", dtype)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to("cuda", dtype)
    positions = torch.randint(0, 4000, (t,), generator=g).cuda()
    cos, sin = RotaryEmbedding({"rope_type": "default", "rope_theta": 500000.0}, d).cos_sin(positions, dtype)
    loc = torch.randperm(200, generator=g)[:t].cuda() + 1
    k_buf, v_buf = (torch.zeros(201, kv_heads, d, dtype=dtype, device="cuda") for _ in range(2))

    class Attn:
        num_heads, num_kv_heads, head_dim = heads, kv_heads, d

    qk = Attn()
    qk.q_norm, qk.k_norm = RMSNorm(d, 1e-6).to("cuda", dtype), RMSNorm(d, 1e-6).to("cuda", dtype)
    for n in (qk.q_norm, qk.k_norm):
        n.weight.data = torch.randn(d, generator=g).to("cuda", dtype)
    run = lambda: (  # noqa: E731
        ops.rms_norm(x, norm.weight, norm.eps),
        ops.add_rms_norm(x, r, norm.weight, norm.eps),
        ops.silu_and_mul(gate_up),
        ops.rotary_kv(qkv, cos, sin, Attn(), k_buf, v_buf, loc),
        ops.rotary_kv(qkv, cos, sin, qk, k_buf, v_buf, loc),
    )
    run()  # compiles
    with no_sync():
        normed, (added, total), silu, q, q_normed = run()
    _same_rounding(normed, norm(x), "rms_norm")
    assert torch.equal(total, r + x), "add_rms_norm: the sum"
    _same_rounding(added, norm(r + x), "add_rms_norm")
    _same_rounding(silu, F.silu(gate_up[:, :14336]) * gate_up[:, 14336:], "silu_and_mul")
    view = qkv.view(t, heads + 2 * kv_heads, d)
    _same_rounding(q, apply_rotary(view[:, :heads], cos, sin), "rotary q")
    pair = lambda x: x.float().abs() + x.float().abs().roll(d // 2, -1)  # noqa: E731 (a rotary output's inputs)
    q_in, k_in = qk.q_norm(view[:, :heads]), qk.k_norm(view[:, heads : heads + kv_heads])
    _same_rounding(q_normed, apply_rotary(q_in, cos, sin), "rotary q after q_norm", pair(q_in))
    _same_rounding(k_buf[loc], apply_rotary(k_in, cos, sin), "rotary k after k_norm, at its slots", pair(k_in))
    assert torch.equal(v_buf[loc], view[:, heads + kv_heads :]), "v written at its slots"


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.bfloat16, 0.5, 1e-2), (torch.float32, 1e-3, 1e-4)])
def test_gemv_matches_cublas_without_a_sync_and_replays_in_a_graph(dtype, atol, rtol):
    g = torch.Generator().manual_seed(1)
    for n, k, bias in [(6144, 4096, False), (4096, 14336, False), (384, 72, True)]:
        w = torch.randn(n, k, generator=g).to("cuda", dtype)
        b = torch.randn(n, generator=g).to("cuda", dtype) if bias else None
        for rows in (1, 3, 16):
            x = torch.randn(rows, k, generator=g).to("cuda", dtype)
            want = F.linear(x, w, b)
            for config in cuda_gemv.CONFIGS:
                cuda_gemv.gemv(x, w, b, config)  # compiles
                with no_sync():
                    got = cuda_gemv.gemv(x, w, b, config)
                where = f"{n}x{k}, {rows} rows, {config}"
                torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m, where=where: f"{where}: {m}")
    x = torch.zeros(2, k, dtype=dtype, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_gemv.gemv(x, w, b, "gemv32")
    x.copy_(torch.randn(2, k, generator=g).to("cuda", dtype))
    graph.replay()
    torch.testing.assert_close(out, F.linear(x, w, b), atol=atol, rtol=rtol)


def test_tune_times_each_shape_on_the_gpu():
    block = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False), torch.nn.Linear(4096, 4096, bias=False))
    block = block.to("cuda", torch.bfloat16)
    assert cuda_gemv.wrap(block) == 2
    found = cuda_gemv.tune(block)
    (plan,) = found.values()
    assert set(plan) == set(cuda_gemv.BUCKETS) and block[0].plan is block[1].plan
    for choice, us, cublas_us in plan.values():
        assert 0 < us <= cublas_us and choice in (*cuda_gemv.CONFIGS, "cublas")
    print("tuned 4096x4096 bf16:", plan)


def _serve_hf_greedy(pair: Pair, path: str, prompts: list[list[int]], new: int = 16) -> None:
    """Every prompt through the pair at once: HF's greedy tokens, token for token."""
    for i, p in enumerate(prompts):
        pair.submit(str(i), p, SamplingParams(max_new_tokens=new, ignore_eos=True))
    pair.wait([str(i) for i in range(len(prompts))])
    for i, p in enumerate(prompts):
        assert pair.out.tokens[str(i)] == hf_greedy(path, p, new), f"prompt {i}"


@pytest.mark.parametrize("variant", ["qwen3-moe", "deepseek-v3", "deepseek-v3-nolora"])
def test_moe_and_mla_decode_replays_cuda_graphs_and_matches_hf_greedy(checkpoint, variant):
    """Captured (a host sync inside would fail the capture), replayed, token-exact."""
    path = checkpoint(variant)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 47)), [3], list(range(60, 80)), list(range(100, 160))]
    pair = Pair(path, device="cuda", dtype="float32", attention_backend="triton", cuda_graph=True)
    try:
        _serve_hf_greedy(pair, path, prompts)
        graphs = pair.worker.runner.decode_graphs
        assert graphs.graphs and sum(graphs.runs.values()) > 0
    finally:
        pair.close()


def test_the_mtp_draft_steps_replay_cuda_graphs_and_match_hf_greedy(checkpoint):
    """DeepSeek-V3's MTP layer as a chain of 3: the target's decode and the draft's steps replayed (the
    latent extends, verify and draft extend, stay eager)."""
    path = checkpoint("deepseek-v3-mtp")
    prompts = [[5, 6, 7, 8, 9], list(range(10, 47)), [3]]
    spec = SpecArgs("NEXTN", None, 3, 1, 4)
    pair = Pair(path, device="cuda", dtype="float32", spec=spec, attention_backend="triton", cuda_graph=True)
    try:
        _serve_hf_greedy(pair, path, prompts)
        draft = pair.worker.runner.draft
        assert draft.decode_graphs.graphs and sum(draft.decode_graphs.runs.values()) > 0
        assert draft.extend_graphs is None and pair.worker.runner.verify_graphs is None
    finally:
        pair.close()
