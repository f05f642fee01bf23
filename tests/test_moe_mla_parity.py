"""Qwen3-MoE and DeepSeek-V3 (with and without q_lora_rank) token-exact with HF generate: the model
over the paged / latent pool, the colocated engine, the decode engine with in-process prefill and
the two services over real gRPC, overlap on and off."""

from __future__ import annotations

from concurrent import futures

import pytest
import torch

from common.engine.colocated import ColocatedLoop
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams
from common.forward.forward_batch import ForwardBatch
from tests.decode_harness import Pair
from tests.grpc_harness import GrpcPair, needs_mooncake
from tests.oracle import hf_greedy, hf_logits
from tests.test_model_parity import _reserve, _runner

VARIANTS = ["qwen3-moe", "deepseek-v3", "deepseek-v3-nolora"]
CHUNK = 16
NEW = 20


def _prompts(n: int, seed: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 5, 13, 3 * CHUNK + 5, 9, 27, 2, 40][:n]
    return [torch.randint(3, 384, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("variant", VARIANTS)
def test_extend_logits_match_hf(checkpoint, variant):
    path = checkpoint(variant)
    runner = _runner(path)
    prompts = _prompts(4)
    rows = [_reserve(runner, len(p)) for p in prompts]
    table = runner.req_to_token_pool.req_to_token
    logits, _ = runner.forward(ForwardBatch.extend(table, rows, [0] * len(prompts), prompts, all_logits=True))
    torch.testing.assert_close(logits, torch.cat([hf_logits(path, p) for p in prompts]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["qwen3-moe", "deepseek-v3"])
def test_chunked_extend_continues_from_pool(checkpoint, variant):
    path = checkpoint(variant)
    runner = _runner(path)
    prompt = _prompts(4)[3]
    row = _reserve(runner, len(prompt))
    pieces, start = [], 0
    for end in (7, 8, 30, len(prompt)):
        batch = ForwardBatch.extend(runner.req_to_token_pool.req_to_token, [row], [start], [prompt[start:end]], True)
        pieces.append(runner.forward(batch)[0])
        start = end
    torch.testing.assert_close(torch.cat(pieces), hf_logits(path, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_colocated_greedy_tokens_match_hf_generate(checkpoint, variant):
    path = checkpoint(variant)
    runner = _runner(path)
    prompts = _prompts(4)
    reqs = ColocatedLoop(runner, chunk_size=CHUNK).generate(
        prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    )
    for prompt, req in zip(prompts, reqs):
        assert req.output == hf_greedy(path, prompt, NEW), f"prompt of length {len(prompt)}"
    assert len({t for r in reqs for t in r.output}) > 4, "degenerate outputs make a weak oracle check"
    runner.kv_allocator.check_integrity(holders=[])


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_engine_matches_hf_with_and_without_overlap(checkpoint, variant):
    """In-process prefill hands each prompt's KV (the latent, for DeepSeek) to the decode scheduler;
    later requests arrive while earlier ones decode."""
    path = checkpoint(variant)
    prompts = _prompts(8)
    refs = [hf_greedy(path, p, NEW) for p in prompts]
    for overlap in (True, False):
        pair = Pair(path, overlap=overlap)
        try:
            for i, p in enumerate(prompts):
                if i in (3, 6):
                    pair.wait_tokens(str(i - 1), 3)
                pair.submit(str(i), p, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
            pair.wait([str(i) for i in range(len(prompts))])
        finally:
            pair.close()
        for i, ref in enumerate(refs):
            assert pair.out.tokens[str(i)] == ref, f"overlap={overlap} request {i}"


GRPC_CASES = [(v, "grpc") for v in VARIANTS] + [
    ("qwen3-moe", "shm"),
    ("deepseek-v3", "shm"),
    pytest.param("qwen3-moe", "mooncake", marks=needs_mooncake),
    pytest.param("deepseek-v3", "mooncake", marks=needs_mooncake),
]


@pytest.mark.parametrize(("variant", "transfer"), GRPC_CASES)
@pytest.mark.parametrize("overlap", [True, False])
def test_grpc_pair_matches_hf(checkpoint, variant, transfer, overlap):
    """Prefill service -> decode service over real gRPC on loopback; small chunks, so a handoff is many
    KvChunk messages (for DeepSeek: the latent as K, an empty V) or many writes by address (Mooncake,
    shm: the latent's K addresses alone)."""
    path = checkpoint(variant)
    prompts = _prompts(8, seed=5)
    pair = GrpcPair(path, overlap=overlap, prefill_kw=dict(max_chunk_bytes=4096), transfer=transfer)
    try:

        def run(i):
            return pair.collect(pair.generate(prompts[i], NEW - i, stream=i % 2 == 0, rid=f"r{i}", ignore_eos=True))

        with futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(run, range(len(prompts))))
    finally:
        pair.close()
    assert (pair.prefill.kv_notices > 0) == (transfer != "grpc")
    for i, (ids, complete) in enumerate(results):
        assert ids == hf_greedy(path, prompts[i], NEW - i), f"request {i}"
        assert complete.finish_reason == "length" and complete.prompt_tokens == len(prompts[i])


@pytest.mark.parametrize("variant", ["qwen3-moe", "deepseek-v3"])
def test_prefix_cache_hands_over_the_kv_a_cold_prefill_makes(checkpoint, variant):
    """Prefill's radix cache reuses cached KV (DeepSeek: cached latents) for a shared prefix: the
    handoff and first token equal a cold prefill's, and decoding from it stays token-exact."""
    from prefill_service.request_bounds import HandoffRequest
    from prefill_service.worker import PrefillWorker

    path = checkpoint(variant)
    system = list(range(40, 90))
    warm = PrefillWorker(ModelRunner(RunnerArgs(path, max_total_tokens=512)), chunk_size=16)
    cold = PrefillWorker(ModelRunner(RunnerArgs(path, max_total_tokens=512)), chunk_size=16, radix_cache=False)
    for i, (prompt, cached) in enumerate([(system + [5, 6], 0), (system + [7, 8, 9], 50)]):
        request = HandoffRequest(str(i), prompt, SamplingParams(max_new_tokens=4), seed=1)
        got, ref = warm.prefill([request])[0], cold.prefill([request])[0]
        assert got.cached_tokens == cached and got.first_token == ref.first_token
        for a, b in zip(got.k + got.v, ref.k + ref.v):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    pair = Pair(path)
    try:
        for i, prompt in enumerate([system + [5, 6], system + [7, 8, 9]]):
            pair.submit(str(i), prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
            pair.wait([str(i)])
            assert pair.out.tokens[str(i)] == hf_greedy(path, prompt, NEW)
    finally:
        pair.close()
