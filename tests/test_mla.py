"""DeepSeek-V3's latent attention (common/models/mla.py, common/attention/latent.py): YaRN and the
interleaved rope against transformers, the latent pool against HF's own latent cache, the absorbed
attention against per-head K/V built from the same latents, and the latent's handoff as bytes."""

from __future__ import annotations

import pytest
import torch

from common.attention.latent import latent_attention
from common.engine.kv_pool import KVPool, bytes_per_slot
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.req_to_token_pool import ReqToTokenPool
from common.forward.forward_batch import ForwardBatch
from common.kv_transfer import shm_files
from common.models.config import load_model_config
from common.models.mla import deinterleave
from common.models.rope import RotaryEmbedding, apply_rotary, attention_factor, inv_frequencies
from common.wire import kv_chunks
from tests.grpc_harness import GrpcPair
from tests.oracle import hf_model


@pytest.mark.parametrize("mscale_all_dim", [0.8, 1.0, None])
def test_yarn_frequencies_and_attention_factor_match_transformers(checkpoint, mscale_all_dim):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = AutoConfig.from_pretrained(checkpoint("deepseek-v3"))
    if mscale_all_dim is None:
        hf.rope_parameters.pop("mscale_all_dim")
    else:
        hf.rope_parameters["mscale_all_dim"] = mscale_all_dim
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    rope = dict(hf.rope_parameters)
    torch.testing.assert_close(inv_frequencies(rope, hf.qk_rope_head_dim), ref_inv, atol=0, rtol=0)
    assert attention_factor(rope) == pytest.approx(ref_factor)
    assert (ref_factor != 1.0) == (mscale_all_dim != 1.0)  # mscale 1 over mscale_all_dim, or mscale(factor)


def test_deinterleaved_rotation_is_hf_interleaved_rope():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    rotary = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, 8)
    positions = torch.arange(5)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    freqs = positions[:, None].float() * inv_frequencies({"rope_theta": 10000.0}, 8)[None]
    hf_cos, hf_sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    q, k = torch.randn(1, 3, 5, 8), torch.randn(1, 1, 5, 8)  # HF: [batch, heads, seq, d]
    ref_q, ref_k = apply_rotary_pos_emb_interleave(q, k, hf_cos[None], hf_sin[None])
    ours_q = apply_rotary(deinterleave(q[0].transpose(0, 1)), cos, sin)  # ours: [seq, heads, d]
    ours_k = apply_rotary(deinterleave(k[0].transpose(0, 1)), cos, sin)
    torch.testing.assert_close(ours_q, ref_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours_k, ref_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variant", ["deepseek-v3", "deepseek-v3-nolora"])
def test_latent_pool_holds_what_hf_caches(checkpoint, variant):
    """Per token and layer the pool keeps one latent head: HF's cached normed c_kv and rotated k_pe."""
    path = checkpoint(variant)
    runner = ModelRunner(RunnerArgs(path, max_total_tokens=256, max_running_requests=2))
    cfg = runner.config
    pool = runner.kv_pool
    latent = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.v_dim) == (1, latent, 0)
    assert tuple(pool.k_all.shape) == (cfg.num_layers, 257, 1, latent) and pool.v_all.shape[-1] == 0
    prompt = list(range(5, 25))
    row = runner.req_to_token_pool.alloc()
    slots = runner.kv_allocator.alloc(len(prompt))
    runner.req_to_token_pool.write(row, 0, slots)
    runner.forward(ForwardBatch.extend(runner.req_to_token_pool.req_to_token, [row], [0], [prompt]))
    with torch.inference_mode():
        cache = hf_model(path)(torch.tensor([prompt]), use_cache=True).past_key_values
    loc = torch.as_tensor(slots)
    for layer in range(cfg.num_layers):
        ours = pool.k[layer][loc][:, 0]
        ref = torch.cat((cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]), dim=-1)
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_absorbed_attention_equals_per_head_k_and_v():
    """Scores against [q W_UK, q_pe] . latent and W_UV (sum p c) give what per-head keys and values
    W_UK c, W_UV c (the unabsorbed form) give."""
    g = torch.Generator().manual_seed(0)
    heads, rank, rope, nope, vd, n = 4, 16, 8, 12, 10, 9
    pool = KVPool(32, 1, 1, rank + rope, torch.float32, v_head_dim=0)
    table = ReqToTokenPool(2, 32, "cpu")
    row = table.alloc()
    table.write(row, 0, torch.arange(3, 3 + n))

    class Backend:
        kv_pool, req_to_token_pool = pool, table

    latent = torch.randn(n, 1, rank + rope, generator=g)
    w_uk, w_uv = torch.randn(heads, nope, rank, generator=g), torch.randn(heads, vd, rank, generator=g)
    q_nope, q_pe = torch.randn(n, heads, nope, generator=g), torch.randn(n, heads, rope, generator=g)
    query = torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe), dim=-1)
    batch = ForwardBatch.extend(table.req_to_token, [row], [0], [[1] * n])
    out = latent_attention(Backend(), query, latent, rank, 0, batch, 0.3)
    absorbed = torch.einsum("thr,hvr->thv", out, w_uv)
    c, k_pe = latent[:, 0, :rank], latent[:, 0, rank:]
    keys = torch.cat((torch.einsum("hnr,sr->shn", w_uk, c), k_pe[:, None].expand(-1, heads, -1)), dim=-1)
    values = torch.einsum("hvr,sr->shv", w_uv, c)
    scores = torch.einsum("qhd,khd->hqk", torch.cat((q_nope, q_pe), -1), keys) * 0.3
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khv->qhv", scores.softmax(-1), values)
    torch.testing.assert_close(absorbed, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(pool.k[0][3 : 3 + n], latent)  # this forward's latents were written


def test_latent_handoff_chunks_carry_the_latent_alone(checkpoint):
    """Over grpc bytes a chunk's K is the latent and its V empty: bytes per token and layer are the
    latent's, against K and V per KV head for the same attention built as GQA."""
    cfg = load_model_config(checkpoint("deepseek-v3"))
    tokens, layers = 7, cfg.num_layers
    k = [torch.randn(tokens, 1, cfg.head_dim) for _ in range(layers)]
    v = [torch.empty(tokens, 1, 0) for _ in range(layers)]
    chunks = list(kv_chunks.split(k, v, max_bytes=1024))
    assembler = kv_chunks.KvAssembler(tokens, layers, 1, cfg.head_dim, v_dim=0)
    sent = 0
    for message in chunks:
        assembler.add(message.kv)
        sent += kv_chunks.payload_bytes(message.kv)
    got_k, got_v = assembler.finish()
    assert all(torch.equal(a, b) for a, b in zip(got_k, k)) and all(t.shape == (tokens, 1, 0) for t in got_v)
    per_token = bytes_per_slot(layers, 1, cfg.head_dim, torch.float32, v_head_dim=0)
    assert sent == tokens * per_token == tokens * layers * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 4
    m = cfg.mla
    gqa = bytes_per_slot(layers, cfg.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, torch.float32, m.v_head_dim)
    assert per_token < gqa / 2
    with pytest.raises(ValueError, match="expected"):
        kv_chunks.KvAssembler(tokens, layers, 1, cfg.head_dim, v_dim=0).add(
            next(kv_chunks.split(k, [torch.zeros(tokens, 1, cfg.head_dim)] * layers, 1 << 20)).kv
        )


def test_the_latent_lands_in_decodes_pool_as_prefill_made_it(checkpoint):
    """Over real gRPC (small chunks) each prompt token's latent in decode's pool, every layer, equals
    prefill's own pool row bit for bit: the normed c_kv and the rotated k_pe columns alike."""
    path = checkpoint("deepseek-v3")
    prompt = list(range(5, 30))
    pair = GrpcPair(path, prefill_kw=dict(max_chunk_bytes=4096))
    landed = []
    worker = pair.decode.scheduler.worker
    write = worker.write_kv_chunk

    def recorded(kv_slots, *args, **kwargs):
        landed.append(kv_slots[: len(prompt)].clone())
        return write(kv_slots, *args, **kwargs)

    worker.write_kv_chunk = recorded
    try:
        pair.collect(pair.generate(prompt, 3, rid="m", ignore_eos=True))
        pair.wait_idle()
        ours = pair.decode.runner.kv_pool.k_all[:, landed[0]]
        theirs = pair.prefill.runner.kv_pool.k_all[:, pair.prefill.worker.cache.match_prefix(prompt)[0]]
    finally:
        pair.close()
    assert len(landed) > 1 and all(torch.equal(s, landed[0]) for s in landed)  # many chunks, one reservation
    rank = load_model_config(path).mla.kv_lora_rank
    assert theirs[..., rank:].abs().min() > 0 and theirs[..., :rank].abs().amax(-1).min() > 0  # both parts hold data
    assert torch.equal(ours[..., :rank], theirs[..., :rank])
    assert torch.equal(ours[..., rank:], theirs[..., rank:])  # the rope part too


def test_a_latent_region_names_k_alone_and_only_k_is_written():
    """Mooncake and shm write by address: a latent pool's region has no V addresses, its writes are
    K's, and a region with V addresses (a GQA pool) is refused for latent KV and the other way round."""
    from common.kv_transfer import plan

    latent, gqa = KVPool(16, 2, 1, 40, torch.float32, v_head_dim=0), KVPool(16, 2, 1, 40, torch.float32)
    region = plan.kv_region(latent.k, latent.v)
    assert len(region.k_ptrs) == 2 and not region.v_ptrs and region.slot_bytes == 160
    dest = plan.prefill_pb2.KvDestination(runs=plan.slot_runs([3, 4, 5, 9]))
    plan.check_destination(dest, region, 4, 2, 160, with_v=False)
    k, v = [torch.randn(4, 1, 40) for _ in range(2)], [torch.empty(4, 1, 0) for _ in range(2)]
    srcs, dsts, lens = plan.write_plan(k, v, region, dest.runs, 0, 4, 0, 2)
    assert sum(lens) == 4 * 2 * 160 and set(dsts) <= {p + s * 160 for p in region.k_ptrs for s in (3, 9)}
    with pytest.raises(ValueError, match="V"):
        plan.check_destination(dest, plan.kv_region(gqa.k, gqa.v), 4, 2, 160, with_v=False)
    with pytest.raises(ValueError, match="V"):
        plan.check_destination(dest, region, 4, 2, 160, with_v=True)


def test_a_shared_latent_pool_is_one_file(tmp_path):
    pool = KVPool(8, 2, 1, 40, torch.float32, allocate=shm_files.allocator(str(tmp_path)), v_head_dim=0)
    assert len(pool.files) == 1 and pool.files[0][1].data_ptr() == pool.k_all.data_ptr()
    assert pool.v_all.shape == (2, 9, 1, 0)
