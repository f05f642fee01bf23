"""Grammar compiles in worker processes (common/engine/compile_pool.py): a compile past its deadline
is ended, not left running. On a thread it kept its CPU to the end (a review's four 22 s compiles made
every other constrained request fail for ~130 s); here its process is killed at the deadline, the
next compile gets a fresh worker, and a pool kept busy until a compile's deadline refuses it as busy."""

from __future__ import annotations

import os
import sys
import time

import pytest

from common.engine import compile_pool, grammar
from common.engine.compile_pool import CompilePool
from common.models.config import load_model_config

STALLING = [sys.executable, "-m", "tests.slow_grammar_worker"]  # "stall" in a constraint never compiles


def _workers() -> list[int]:
    """Pids of this process's live children running the stalling worker."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"slow_grammar_worker" in cmd:
            pids.append(int(entry))
    return pids


@pytest.fixture
def compiler(checkpoint):
    path = checkpoint("llama")
    cfg = load_model_config(path)
    pool = CompilePool(max_workers=2, keep_idle=1, command=STALLING)
    c = grammar.GrammarCompiler(path, cfg.vocab_size, tuple(cfg.eos_token_ids), timeout_s=2.0, pool=pool)
    yield c
    pool.close()


def test_a_compile_past_its_deadline_is_killed_and_the_next_one_compiles(compiler):
    pool = compiler.pool
    assert compiler.compile(("regex", "(cat|dog)s?")) is not None  # a worker is up
    before = _workers()
    with pytest.raises(grammar.GrammarError, match="did not compile within 2 s"):  # the stall never ends by itself
        compiler.compile_async(("regex", "(stall|x)+")).result(120)  # bound: a hung pool fails, not hangs
    assert pool.killed == 1
    stalled = set(before) - set(_workers())
    assert stalled, "the stalled compile's worker still runs"
    matcher = grammar.new_matcher(compiler.compile(("regex", "[ab]+c")))  # a fresh worker compiles
    assert not matcher.is_terminated()
    assert pool.alive <= pool.max_workers and len(_workers()) == pool.alive


def test_a_pool_busy_until_the_deadline_refuses_as_busy(compiler):
    pool = compiler.pool
    compiler.compile(("regex", "ready"))
    stalls = [compiler.compile_async(("regex", f"stall{i}")) for i in range(pool.max_workers)]
    deadline = time.monotonic() + 60  # a busy host may take seconds to start the second worker
    while pool._idle or pool.alive < pool.max_workers:  # until every worker is taken by a stall
        assert time.monotonic() < deadline, "the stalled compiles never took the workers"
        time.sleep(0.01)
    late = pool.submit(compiler._key, lambda: compiler._tokenizer()[1], True, "regex", "[xy]+", 0.3)
    with pytest.raises(compile_pool.NoWorkerFree):
        late.result(60)
    for f in stalls:
        with pytest.raises(grammar.GrammarError, match="did not compile within"):
            f.result(120)  # each is killed 2 s after its worker took it
    assert pool.killed == pool.max_workers and not compiler.pending
    assert compiler.compile(("regex", "[xy]+")) is not None  # served again once the stalls are ended
