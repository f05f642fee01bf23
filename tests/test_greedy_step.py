"""The greedy decode step in one call (ModelRunner.greedy_step, the ops' `greedy_step`): each request's pending
token read from the decode service's token buffer at its row, the step the fused layers and head run, its argmax
written back there. Held to the step forward_logits runs from a ForwardBatch, and through the scheduler to HF."""

from __future__ import annotations

import pytest
import torch

from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams
from common.forward.forward_batch import ForwardBatch
from common.models import greedy_head
from tests.decode_harness import Pair
from tests.oracle import hf_greedy
from tests.test_cpu_fused_layer import _prefilled

PROMPTS = [[5, 17, 99, 3, 8, 1, 42], [7, 7, 2], [300, 12, 6, 9, 1]]


def _runner(checkpoint, quantization: str = "none", kv: str = "auto", head: str = "off") -> ModelRunner:
    args = RunnerArgs(checkpoint("llama"), max_total_tokens=128, max_running_requests=4, linear_layout="rowblock",
                      greedy_head=head, quantization=quantization, kv_cache_dtype=kv)  # fmt: skip
    return ModelRunner(args)


@pytest.mark.parametrize("batch", [1, 2, 3])  # one region at up to two rows, op by op at three
@pytest.mark.parametrize(
    "quantization,kv,head",
    [("none", "auto", "off"), ("none", "auto", "on"), ("w8a8", "auto", "off"), ("w8", "float32", "off")],
)
def test_the_greedy_step_is_the_forward_s_step_and_stashes_its_tokens(ops, checkpoint, batch, quantization, kv, head):
    """The one call gives the tokens forward_logits gives from a ForwardBatch of the same pending tokens, writes
    them at the rows of the buffer and nowhere else, and writes the same K and V. With the greedy head on, one or
    two rows find their tokens by its candidates in the call; three rows are not the call's (None)."""
    runner = _runner(checkpoint, quantization, kv, head)
    assert (runner.model.greedy_head is not None) == (head == "on" and greedy_head.available())  # bf16 GEMMs
    rows = _prefilled(runner, PROMPTS[:batch])
    lens = [len(p) for p in PROMPTS[:batch]]
    pending = [11, 250, 37][:batch]
    buffer = torch.full((runner.req_to_token_pool.size + 1,), 9, dtype=torch.int64)
    buffer[rows] = torch.tensor(pending)
    index, lens_t = torch.tensor(rows), torch.tensor(lens)
    pool = runner.kv_pool
    tokens = runner.greedy_step(buffer, index, lens_t, lens)
    if runner.model.greedy_head is not None and batch > 2:  # the greedy head serves outside the call
        assert tokens is None
        return
    assert tokens is not None and tokens.shape == (batch,)
    k_after, v_after = pool.k_all.clone(), pool.v_all.clone()
    table = runner.req_to_token_pool.req_to_token
    fb = ForwardBatch.decode(table, index, lens, torch.tensor(pending))
    with torch.inference_mode():
        reference, _ = runner.model.forward_logits(fb, runner.backend, greedy=True)
    assert tokens.tolist() == reference.tolist()
    assert buffer[rows].tolist() == tokens.tolist()
    others = torch.ones_like(buffer, dtype=torch.bool)
    others[rows] = False
    assert bool((buffer[others] == 9).all())  # no other row written
    assert torch.equal(pool.k_all, k_after) and torch.equal(pool.v_all, v_after)  # the same K and V written again
    assert lens_t.tolist() == lens  # the committed lengths are only read


def test_the_greedy_step_refuses_what_it_cannot_take(ops, checkpoint):
    """Out-of-range rows and pending tokens are errors of the op, naming them; where the runner's one call does
    not serve the step (a position past the rotary table so far, or more rows than the fused layers take) it
    returns None and the caller runs the forward."""
    runner = _runner(checkpoint)
    rows = _prefilled(runner, PROMPTS[:1])
    buffer = torch.zeros(runner.req_to_token_pool.size + 1, dtype=torch.int64)
    index, lens = torch.tensor(rows), torch.tensor([len(PROMPTS[0])])
    assert runner.greedy_step(buffer, index, lens, lens.tolist()) is not None
    with pytest.raises(RuntimeError, match="row out of range"):
        runner.greedy_step(buffer, torch.tensor([buffer.numel()]), lens, lens.tolist())
    buffer[rows] = -1  # a poisoned row (the FutureMap's consume-once guard)
    with pytest.raises(RuntimeError, match="pending token out of range"):
        runner.greedy_step(buffer, index, lens, lens.tolist())
    buffer[rows] = 3
    cos, _ = runner.model.rotary.table(torch.float32)
    far = torch.tensor([cos.shape[0]])
    assert runner.greedy_step(buffer, index, far, far.tolist()) is None
    many = torch.tensor(rows * 65)  # past the fused layers' rows (GEMV_ROWS)
    assert runner.greedy_step(buffer, many, lens.repeat(65), lens.tolist() * 65) is None


def _logits_call(runner, rows: list[int], lens: list[int], pending: list[int]) -> tuple:
    """decode_logits' (normed, logits, tokens) of a greedy step, called as FusedLayers.logits calls it."""
    table, model, backend = runner.req_to_token_pool.req_to_token, runner.model, runner.backend
    fb = ForwardBatch.decode(table, torch.tensor(rows), lens, torch.tensor(pending))
    with torch.inference_mode():
        x, cos, sin = model._inputs(fb, backend)
        fused = model.fused_layers
        assert fused.serves(x, cos, backend) and fused.takes_head(len(rows), True, model.greedy_head)
        return runner.cpu_fused.decode_logits(*fused._args(x, cos, sin, fb, backend), True)


class _Bound:
    """What the call reads of a GreedyHead, computed as GreedyHead computes it: its candidates' count, the bound's
    weight terms (the largest row norms of w - bf16(w) and of bf16(w)), and a plan that serves every row count.
    The call needs no oneDNN, which the GreedyHead itself does: so the candidates are held on every host."""

    def __init__(self, weight: torch.Tensor, weight_err: float | None = None):
        low = weight.to(torch.bfloat16).double()
        self.k = greedy_head.CANDIDATES
        self.weight_err = float((weight.double() - low).norm(dim=1).max()) if weight_err is None else weight_err
        self.low_norm = float(low.norm(dim=1).max())

    def used_for(self, rows: int) -> bool:
        return True


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_tokens_by_candidates_are_the_float32_head_s(ops, checkpoint, batch):
    """With the greedy head serving, a one-region step finds each row's token among the bf16 head's candidates:
    the argmax of the float32 logits, while the logits it leaves are the bf16 head's (not the float32 head's,
    within the bound); where the bound settles nothing (a weight error too large) the whole float32 head decides,
    and its logits are left."""
    for settles in (True, False):
        runner = _runner(checkpoint)
        head = _Bound(runner.model.lm_head_weight, None if settles else 1e6)
        runner.model.greedy_head = head
        rows = _prefilled(runner, PROMPTS[:batch])
        normed, logits, tokens = _logits_call(runner, rows, [len(p) for p in PROMPTS[:batch]], [11, 250][:batch])
        exact = normed @ runner.model.lm_head_weight.T
        assert tokens.tolist() == exact.argmax(dim=1).tolist()
        close = torch.allclose(logits, exact, rtol=1e-5, atol=1e-5)
        assert close != settles
        if settles:
            bound = (head.weight_err + 4 * exact.shape[1] * 2.0**-24 * head.low_norm) * normed.norm(dim=1) * 1.001
            assert bool(((logits - exact).abs().amax(dim=1) <= bound + 1e-6).all())


def test_greedy_requests_take_the_one_call_and_match_hf(ops, checkpoint):
    """Through the scheduler (overlap, debug checks on): greedy requests' steps go through the one call (all but
    the first, which makes the rotary table it reads), and their tokens are HF's."""
    path = checkpoint("llama")
    calls = []
    pair = Pair(path, linear_layout="rowblock", greedy_head="off")
    step = pair.worker.runner.greedy_step

    def counted(*args):
        out = step(*args)
        calls.append(out is not None)
        return out

    pair.worker.runner.greedy_step = counted
    try:
        pair.run(PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
    finally:
        pair.close()  # checks the pools' books too
    assert len(calls) >= 10 and all(calls[1:])  # every step but the first (its forward makes the rotary table)
    for i, p in enumerate(PROMPTS):
        assert pair.out.tokens[str(i)] == hf_greedy(path, p, 12)
