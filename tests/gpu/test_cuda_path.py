"""The CUDA path: bf16 against our fp32 path, the decode scheduler with overlap on and off on real
streams, EAGLE and the gRPC pair on CUDA, the FutureMap's publish/resolve on CUDA streams, and no
host sync inside a decode step's launch. Tests marked `gpu` skip without CUDA; the bf16 parity
logic also runs on CPU."""

from __future__ import annotations

import pytest
import torch

from common.engine.draft_runner import SpecArgs
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams
from common.forward.forward_batch import ForwardBatch
from common.tools.eagle_checkpoint import build as build_head
from tests.decode_harness import Pair
from tests.oracle import hf_greedy

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3], list(range(60, 80)), list(range(100, 160))]
GAP = 0.1  # an argmax may flip only where fp32's top-2 logits are closer than this


def teacher_forced(path: str, device: str, dtype: str, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] (float32, CPU) of one teacher-forced pass through our runner."""
    runner = ModelRunner(
        RunnerArgs(path, device=device, dtype=dtype, max_total_tokens=len(ids) + 8, max_running_requests=1)
    )
    row = runner.req_to_token_pool.alloc()
    runner.req_to_token_pool.write(row, 0, runner.kv_allocator.alloc(len(ids)))
    fb = ForwardBatch.extend(runner.req_to_token_pool.req_to_token, [row], [0], [ids], all_logits=True)
    return runner.forward(fb)[0].float().cpu()


def flip_report(ref: torch.Tensor, low: torch.Tensor) -> tuple[int, int]:
    """(argmax flips, flips where fp32's top-2 gap is >= GAP: not explained by rounding)."""
    top2 = ref.topk(2, dim=-1).values
    flips = ref.argmax(-1) != low.argmax(-1)
    return int(flips.sum()), int((flips & (top2[:, 0] - top2[:, 1] >= GAP)).sum())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_teacher_forced_against_fp32(checkpoint, device):
    path = checkpoint("llama")
    ids = [(7 * i + 3) % 380 + 2 for i in range(300)]
    ref = teacher_forced(path, "cpu", "float32", ids)
    flips, unexplained = flip_report(ref, teacher_forced(path, device, "bfloat16", ids))
    print(f"bf16 on {device}: {flips} argmax flips in {len(ids)} positions, {unexplained} with a top-2 gap >= {GAP}")
    assert unexplained == 0


def test_flip_report_counts_only_close_calls():
    ref = torch.tensor([[5.0, 4.95, 0.0], [5.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    low = torch.tensor([[4.9, 5.0, 0.0], [1.0, 5.0, 0.0], [0.0, 3.0, 1.0]])
    assert flip_report(ref, low) == (2, 1)


def _run(pair: Pair, params) -> dict:
    for i, p in enumerate(PROMPTS):
        pair.submit(str(i), p, params[i])
    pair.wait([str(i) for i in range(len(PROMPTS))])
    return dict(pair.out.tokens)


@pytest.mark.gpu
def test_overlap_on_and_off_give_identical_tokens_on_cuda(checkpoint):
    path = checkpoint("llama")
    params = [
        SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8 if i == 3 else 0.0, seed=i)
        for i in range(len(PROMPTS))
    ]
    outs = []
    for overlap in (True, False):
        pair = Pair(path, overlap=overlap, device="cuda", dtype="float32")
        outs.append(_run(pair, params))
        pair.close()
    assert outs[0] == outs[1]
    for i, p in enumerate(PROMPTS):
        if params[i].greedy:
            assert outs[0][str(i)] == hf_greedy(path, p, 24), f"prompt {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("topk,steps,nodes", [(1, 3, 4), (4, 3, 8)])
def test_eagle_on_cuda_matches_hf_greedy(checkpoint, tmp_path, topk, steps, nodes):
    path = checkpoint("llama")
    spec = SpecArgs("EAGLE3", build_head(path, "EAGLE3", str(tmp_path / "head")), steps, topk, nodes)
    pair = Pair(path, device="cuda", dtype="float32", spec=spec)
    out = _run(pair, [SamplingParams(max_new_tokens=20, ignore_eos=True)] * len(PROMPTS))
    for i, p in enumerate(PROMPTS):
        assert out[str(i)] == hf_greedy(path, p, 20), f"prompt {i}"
    pair.close()


@pytest.mark.gpu
def test_grpc_pair_on_cuda(checkpoint):
    from tests.grpc_harness import GrpcPair

    path = checkpoint("llama")
    kw = dict(device="cuda", dtype="float32")
    pair = GrpcPair(path, prefill_kw=kw, decode_kw=kw)
    try:
        pair.check_against_oracle(path, PROMPTS, 12, rid="c")
    finally:
        pair.close()


@pytest.mark.gpu
def test_future_map_resolve_waits_for_the_publish_on_cuda_streams():
    from common.engine.streams import make_event, make_stream
    from decode_service.future_map import FutureMap

    device = torch.device("cuda")
    stream = make_stream(device)
    fm = FutureMap(8, device, lambda: make_event(device), debug=True)
    rows = torch.tensor([1, 3], device=device)
    fence = fm.arm_publish(stream)

    def forward():  # a long kernel, then the publish: resolve must not read before it
        torch.cuda._sleep(50_000_000)
        fm.publish_kv_committed_lens(rows, torch.tensor([17, 29], device=device), fence)

    stream.submit(forward)
    assert fm.resolve_kv_committed_lens_cpu(rows, timeout=30).tolist() == [17, 29]
    stream.close()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode,backend,graphs,processed",
    [
        ("plain", "batched", False, False),
        ("plain", "triton", True, False),
        ("chain", "batched", False, False),
        ("tree", "batched", False, False),
        ("plain", "batched", False, True),
        ("tree", "batched", False, True),
    ],
)
def test_decode_step_launch_has_no_host_sync(checkpoint, tmp_path, mode, backend, graphs, processed):
    """Once every request is decoding, launching a step (and any other stream work: a finished
    request's row release) must not wait for the device: plain decode eager and replayed, EAGLE chain
    and tree; `processed`: every other request asks for penalties, a logit bias and top-5 logprobs
    (counts updated and logprobs gathered on the stream)."""
    import traceback

    path = checkpoint("llama")
    spec = None
    if mode != "plain":
        topk, nodes = (1, 4) if mode == "chain" else (4, 8)
        spec = SpecArgs("EAGLE3", build_head(path, "EAGLE3", str(tmp_path / "head")), 3, topk, nodes)
    pair = Pair(path, device="cuda", dtype="float32", spec=spec, attention_backend=backend, cuda_graph=graphs)
    stream, errors, checking, checked = pair.worker.stream, [], [False], [0]
    real_submit = stream.submit

    def checked_submit(fn):
        def run():
            if not checking[0]:
                return fn()
            checked[0] += 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn()
            except RuntimeError:
                errors.append(traceback.format_exc())
                raise
            finally:
                torch.cuda.set_sync_debug_mode("default")

        real_submit(run)

    stream.submit = checked_submit
    for i, p in enumerate(PROMPTS):
        extra = {}
        if processed and i % 2:
            extra = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, logit_bias={5: 1.0},
                         return_logprob=True, top_logprobs_num=5)  # fmt: skip
        pair.submit(str(i), p, SamplingParams(max_new_tokens=[40, 60, 80, 100, 120][i], ignore_eos=True, **extra))
    for i in range(len(PROMPTS)):
        pair.wait_tokens(str(i), 3)  # every request is past its handoff
    checking[0] = True
    pair.wait([str(i) for i in range(len(PROMPTS))])
    checking[0] = False
    for e in errors[:1]:
        print(e)
    assert not errors, errors[0][-1500:]
    assert checked[0] >= 20, checked[0]  # the checked window really held decode steps (>= 40 tokens each)
    assert all(len(pair.out.tokens[str(i)]) == [40, 60, 80, 100, 120][i] for i in range(len(PROMPTS)))
    pair.close()


@pytest.mark.gpu
def test_host_copies_go_through_pinned_memory():
    from common.forward.host_copy import to_device, to_host

    d = to_device([1, 2, 3], "cuda", torch.int64)
    assert d.is_cuda and d.tolist() == [1, 2, 3]
    h = to_host(d * 2)
    torch.cuda.synchronize()
    assert h.is_pinned() and h.tolist() == [2, 4, 6]
