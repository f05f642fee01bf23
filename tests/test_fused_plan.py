"""fused_plan.choose: per decode row bucket, the layout table's mix against the same with its unfused linears in
panels, timed as whole steps; the faster kept (by MIN_GAIN), the rest of every plan untouched."""

from types import SimpleNamespace

from common.models import fused_plan
from common.models.packed_linear import ROW_BUCKETS, bucket_index

MIX = ("rowblock", "rowblock", "rowblock", "panels", "onednn", "panels", "mkl", "onednn")


class _Linear:  # a LinearWeight's plan and panels copy (hashed by identity, as LinearWeight is)
    def __init__(self, plan: tuple, panels: bool):
        self.plan, self.panels = plan, object() if panels else None


def _stack(plans: list[tuple], panels: bool = True) -> SimpleNamespace:
    return SimpleNamespace(linears=[_Linear(p, panels) for p in plans])


def _fused(stack, batch: int) -> bool:
    return all(lw.plan[bucket_index(batch)] in fused_plan.FUSED for lw in stack.linears)


def test_the_fused_plan_is_kept_where_its_steps_are_faster_and_only_there():
    stack = _stack([MIX, MIX[:4] + ("panels",) * 4])
    timed = []

    def step(batch):  # the fused stack twice as fast at 16 rows, slower at 64
        timed.append((batch, _fused(stack, batch)))
        return {16: 1.0, 64: 2.0}[batch] if _fused(stack, batch) else 1.5

    lines = fused_plan.choose(stack, step, max_batch=64)
    assert {b for b, _ in timed} == {16, 64}  # the buckets whose mix left the stack unfused (32: all panels)
    assert sum(fused for b, fused in timed if b == 16) == 1 + fused_plan.ROUNDS  # one untimed, then the rounds
    assert stack.linears[0].plan == MIX[:4] + ("panels", "panels", "mkl", "onednn")  # 16 fused, 64 as the table
    assert stack.linears[1].plan == MIX[:4] + ("panels",) * 4
    assert [line.split(":")[0].strip() for line in lines] == ["16 rows", "64 rows"]
    assert "fused kept" in lines[0] and "table kept" in lines[1]


def test_a_gain_within_the_noise_keeps_the_table_and_a_missing_copy_times_nothing():
    stack = _stack([MIX])
    lines = fused_plan.choose(stack, lambda b: 1.0 if _fused(stack, b) else 1.0 + fused_plan.MIN_GAIN / 2, 64)
    assert stack.linears[0].plan == MIX and all("table kept" in line for line in lines)
    bare = _stack([MIX], panels=False)  # its plan used no panels: the copy is gone, so the stack cannot fuse

    def never(batch):
        raise AssertionError("timed a plan the stack cannot run")

    assert fused_plan.choose(bare, never, 64) == [] and bare.linears[0].plan == MIX


def test_only_buckets_up_to_the_largest_batch_are_timed_at_that_batch():
    stack = _stack([("onednn",) * len(ROW_BUCKETS)])
    timed = []
    fused_plan.choose(stack, lambda b: timed.append(b) or (1.0 if _fused(stack, b) else 2.0), max_batch=5)
    assert sorted(set(timed)) == [1, 2, 4, 5]  # 5 requests: the 8-row bucket, timed at 5; none beyond
    assert stack.linears[0].plan == ("panels",) * 4 + ("onednn",) * 4
