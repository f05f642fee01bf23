"""bench.spec_bench's measuring loop on a tiny fixture: plain and EAGLE runs over several prompts,
a few at a time, on runners loaded once, count every decoded token and report the accept length."""

from __future__ import annotations

from bench.spec_bench import run
from common.engine.draft_runner import SpecArgs
from common.tools.eagle_checkpoint import build as build_head


def test_spec_bench_runs_plain_and_eagle_over_prompt_rounds(checkpoint, tmp_path):
    target = checkpoint("llama")
    prompts = [[5, 6, 7, 8, 9], list(range(10, 30)), [3, 4], list(range(40, 52)), [60]]
    rate, length = run(target, prompts, 2, 6, SpecArgs(), 0.0, True)
    assert rate > 0 and length == 1.0
    spec = SpecArgs("EAGLE", build_head(target, "EAGLE", str(tmp_path / "head")), 3, 1, 4)
    rate, length = run(target, prompts, 2, 6, spec, 0.0, True)
    assert rate > 0 and 1.0 <= length <= 4.0
