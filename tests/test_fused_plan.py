"""fused_plan.choose: per decode row bucket, the layout table's plan against the ways the fused stack runs it,
timed as whole steps, each candidate by its ratio to the table's in the same round; the fastest kept where it
gains MIN_GAIN, the rest of every plan untouched."""

from types import SimpleNamespace

import pytest

from common.models import fused_plan
from common.models.packed_linear import ROW_BUCKETS, bucket_index

MIX = ("rowblock", "rowblock", "rowblock", "panels", "onednn", "panels", "mkl", "onednn")


class _Linear:  # a LinearWeight's plan and panels copy (hashed by identity, as LinearWeight is)
    def __init__(self, plan: tuple, panels: bool):
        self.plan, self.panels = plan, object() if panels else None


class _Ops:  # the fused ops' gemv streams at one row: row_streams(n) sets n, row_streams(0) asks
    def __init__(self, streams: int):
        self.streams = streams

    def row_streams(self, n: int) -> int:
        if n:
            self.streams = n
        return self.streams


def _stack(plans: list[tuple], panels: bool = True, streams: int = 1, lm_head: tuple | None = None) -> SimpleNamespace:
    head = None if lm_head is None else _Linear(lm_head, panels)
    return SimpleNamespace(linears=[_Linear(p, panels) for p in plans], ops=_Ops(streams), lm_head=head)


def _fused(stack, batch: int) -> bool:
    return all(lw.plan[bucket_index(batch)] in fused_plan.FUSED for lw in stack.linears)


def _one_row(stack) -> str:
    """How the stack's one-row step runs: 'gemv xN', 'panels' or 'mixed'."""
    layouts = {lw.plan[0] for lw in stack.linears}
    if layouts == {"rowblock"}:
        return f"gemv x{stack.ops.streams}"
    return "panels" if layouts == {"panels"} else "mixed"


def test_the_fused_plan_is_kept_where_its_steps_are_faster_and_only_there():
    stack = _stack([MIX, MIX[:4] + ("panels",) * 4])
    timed = []

    def step(batch):  # the fused stack twice as fast at 16 rows, slower at 64; one and two rows: every way alike
        timed.append((batch, _fused(stack, batch)))
        return 1.0 if batch < 16 else {16: 1.0, 64: 2.0}[batch] if _fused(stack, batch) else 1.5

    lines = fused_plan.choose(stack, step, max_batch=64)
    assert {b for b, _ in timed} == {1, 2, 16, 64}  # one and two rows, and the buckets whose mix left it unfused
    assert sum(fused for b, fused in timed if b == 16) == 1 + fused_plan.ROUNDS  # one untimed, then the rounds
    assert stack.linears[0].plan == MIX[:4] + ("panels", "panels", "mkl", "onednn")  # 16 fused, 64 as the table
    assert stack.linears[1].plan == MIX[:4] + ("panels",) * 4
    assert [line.split(":")[0].strip() for line in lines] == ["1 row", "2 rows", "16 rows", "64 rows"]
    assert "the table's kept" in lines[1] and "fused kept" in lines[2] and "the table's kept" in lines[3]


def _by_one_row(stack, cost: dict, runs: list):
    """A step timer: cost[how the stack runs one row], each call's way appended to runs."""

    def step(batch: int) -> float:
        runs.append(_one_row(stack))
        return cost[runs[-1]]

    return step


@pytest.mark.parametrize("table, streams", [(MIX, 1), (("panels",) + MIX[1:], 4)])
def test_at_one_row_the_fastest_of_the_gemvs_streams_and_panels_is_kept_with_its_streams(table, streams):
    cost = {"gemv x1": 1.0, "gemv x2": 0.9, "gemv x4": 0.95, "panels": 1.2, "mixed": 1.1}
    stack, runs = _stack([table, MIX], streams=streams), []
    lines = fused_plan.choose(stack, _by_one_row(stack, cost, runs), 1)
    assert _one_row(stack) == "gemv x2" and stack.linears[1].plan == MIX, lines
    assert stack.linears[0].plan[1:] == table[1:]  # only the one-row bucket moved
    assert "gemv x2 kept" in lines[0]
    assert runs.count(f"gemv x{streams}") == 1 + fused_plan.ROUNDS  # the same as the table's: timed once a round


def test_at_one_row_ways_within_min_gain_and_not_ahead_in_every_round_keep_the_tables_plan_and_streams():
    stack, runs = _stack([MIX], streams=4), []

    def step(batch):  # the others half MIN_GAIN ahead, but each behind in its third timed round
        runs.append(_one_row(stack))
        if runs[-1] == "gemv x4":
            return 1.0
        ahead = runs.count(runs[-1]) != 4  # (its untimed first step, then one a round)
        return 1.0 - fused_plan.MIN_GAIN / 2 * (1 if ahead else -1)

    fused_plan.choose(stack, step, 1)
    assert _one_row(stack) == "gemv x4"


def test_a_clear_loser_drops_out_after_the_first_rounds_and_a_missing_copy_is_not_timed():
    stack, runs = _stack([MIX], streams=1), []
    cost = {"gemv x1": 1.0, "gemv x2": 1.0, "gemv x4": 1.0, "panels": 1.0 + 2 * (fused_plan.PRUNE - 1)}
    lines = fused_plan.choose(stack, _by_one_row(stack, cost, runs), 1)
    assert runs.count("panels") == 1 + fused_plan.PRUNE_AFTER and runs.count("gemv x2") == 1 + fused_plan.ROUNDS
    assert "dropped" in lines[0] and _one_row(stack) == "gemv x1"
    bare = _stack([MIX], panels=False)  # its plan used no panels: the copy is gone, so nothing is timed in them
    runs.clear()
    lines = fused_plan.choose(bare, _by_one_row(bare, dict.fromkeys(("gemv x1", "gemv x2", "gemv x4"), 1.0), runs), 64)
    assert "panels" not in runs and [line.split(":")[0].strip() for line in lines] == ["1 row"]
    assert bare.linears[0].plan == MIX


def test_each_round_compares_within_itself_so_a_faster_host_moment_does_not_decide():
    """The host's memory speeds up 1.6x in the middle round, between the fused plan's sample and the table's (it
    moved 27 <-> 42 GB/s within seconds on a 2-core Zen 4): by median whole times the table's would look faster
    (1.0 against 1.44); by its ratio in each round the fused plan is 0.9 of the table's in all but that one."""
    stack = _stack([MIX])
    calls = []

    def step(batch):
        if batch != 16:
            return 1.0
        calls.append(1)  # two untimed, then rounds of two: the middle round (the 4th) runs the fused plan first
        slow = 1.6 if len(calls) <= 2 + 2 * (fused_plan.ROUNDS // 2) + 1 else 1.0
        return slow * (0.9 if _fused(stack, batch) else 1.0)

    lines = fused_plan.choose(stack, step, 16)
    assert _fused(stack, 16) and "fused kept" in lines[-1]


def test_only_buckets_up_to_the_largest_batch_are_timed_at_that_batch():
    stack = _stack([("onednn",) * len(ROW_BUCKETS)])
    timed = []
    fused_plan.choose(stack, lambda b: timed.append(b) or (1.0 if _fused(stack, b) else 2.0), max_batch=5)
    assert sorted(set(timed)) == [1, 2, 4, 5]  # 5 requests: the 8-row bucket, timed at 5; none beyond
    assert stack.linears[0].plan[2:] == ("panels",) * 2 + ("onednn",) * 4
    assert set(stack.linears[0].plan[:2]) <= set(fused_plan.FUSED)  # one and two rows: the stack's ways only


@pytest.mark.parametrize("rows", [1, 2])
def test_at_one_and_two_rows_the_lm_head_moves_with_the_stack(rows):
    """A greedy step finds its token inside the call only with the lm_head in the gemv (an lm_head in panels at
    one row ran SmolLM2's steps 16% longer on a 2-core Zen 4): the table's panels there lose to the gemv."""
    i = rows - 1
    plan = tuple("panels" if j == i else layout for j, layout in enumerate(MIX))
    stack = _stack([MIX], lm_head=plan)

    def step(batch):
        return 1.0 if stack.lm_head.plan[i] == "rowblock" else 1.2

    lines = fused_plan.choose(stack, step, rows)
    assert stack.lm_head.plan[i] == "rowblock" and stack.linears[0].plan == MIX, lines
    assert stack.lm_head.plan[:i] + stack.lm_head.plan[i + 1 :] == plan[:i] + plan[i + 1 :]


def test_an_alternative_faster_in_every_round_is_kept_even_under_min_gain():
    """In the host's slower memory state a way 10-16% faster in the faster state came 1-5% ahead: faster in every
    round, it is kept; ahead by as little but slower in one round, the table's plan stays."""
    gain = fused_plan.MIN_GAIN / 3
    for slower_once, kept in ((False, "gemv x2"), (True, "gemv x1")):
        stack, runs = _stack([MIX], streams=1), []

        def step(batch, stack=stack, runs=runs, slower_once=slower_once):
            runs.append(_one_row(stack))
            if runs[-1] != "gemv x2":
                return 1.0
            timed = runs.count("gemv x2") - 1  # its untimed first step, then one a round
            return 1.0 + gain if slower_once and timed == 4 else 1.0 - gain

        fused_plan.choose(stack, step, 1)
        assert _one_row(stack) == kept, (slower_once, runs)
