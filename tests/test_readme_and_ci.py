"""The README's set-up block and .ci/run stay in step; the main job runs and answers."""

from __future__ import annotations

import os
import re

from common.tools import demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _first_block() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"```[^\n]*\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_has_exactly_two_one_line_commands():
    lines = _first_block()
    assert len(lines) == 2
    main_job, tests = lines
    assert "common.tools.demo" in main_job and "pytest" in tests
    assert "-m ruff format --check ." in tests and "-m ruff check ." in tests  # format and lint gate the tests
    for line in lines:
        assert line.startswith("bash .ci/setup && .venv/bin/python -m ")


def test_ci_run_executes_the_readme_test_command():
    script = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "sed -n 2p" in script and 'eval "$cmd"' in script
    assert script.index('eval "$cmd"') < script.index("pytest -q -m drill")  # then the drill tier
    setup = open(os.path.join(ROOT, ".ci", "setup")).read()
    assert "torch==2.13.0" in setup and setup.index("torch==2.13.0") < setup.index("-e '.[dev")


def test_demo_generates_text(capsys):
    text = demo.main(["--tiny", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert "[demo] answer:" in out and "8 tokens (length)" in out
    assert isinstance(text, str)


def test_demo_answers_the_france_question_with_the_real_model(capsys):
    """README line 1's main job: SmolLM2-135M-Instruct (converted once) answers in real text."""
    text = demo.main(["--max-new-tokens", "24"])
    out = capsys.readouterr().out
    assert "Paris" in text and "TTFT" in out and "tokens/s" in out, out
