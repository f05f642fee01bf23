"""Grammars with a bounded cost (common/engine/grammar_limits.py, grammar.py): what a constraint would
expand to is refused by name before it compiles (a schema nested 400 deep compiled for 22 s, a
72-character regex for 13.4 s in a review); at most MAX_PENDING distinct constraints compile at once
(past it a new one is GrammarBusy, RESOURCE_EXHAUSTED at the front door) while cached ones keep being
served; the cache is bounded by the compiled grammars' bytes as well as their count."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import grpc
import pytest

from common.engine import grammar, grammar_limits
from common.engine.grammar import GrammarBusy, GrammarCompiler, GrammarError, check_constraint
from common.engine.sampling import SamplingParams
from tests.gated_pool import GatedPool
from tests.grpc_harness import GrpcPair


def _nested(depth: int) -> str:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return json.dumps(schema)


REFUSED = [  # (field, text, words the error names)
    ("json_schema", _nested(400), "nests deeper than 32"),
    ("json_schema", json.dumps({"type": "string", "maxLength": 5000}), "maxLength is 5000"),
    ("json_schema", json.dumps({"type": "string", "pattern": "(a{40}){40}"}), "multiply to 1600"),
    ("json_schema", json.dumps({"type": "object", "patternProperties": {"x{2000}": {}}}), "counts 2000"),
    ("json_schema", "[" * 60000 + "]" * 4000, "nests deeper"),  # too deep for the parser itself
    ("regex", "[a-z]{1,2000}", "counts 2000"),
    ("regex", "((ab){10}c){120}d{6}", "multiply to 1200"),  # nested counts multiply, d{6} beside them does not
    ("ebnf_grammar", 'root ::= ("x" [0-9]{30}){40}', "multiply to 1200"),
    (
        "structural_tag",
        json.dumps(
            {"structures": [{"begin": "<a>", "schema": json.loads(_nested(40)), "end": "</a>"}], "triggers": ["<a>"]}
        ),
        "nests deeper",
    ),  # fmt: skip
]
ACCEPTED = [
    ("json_schema", _nested(8)),
    ("json_schema", json.dumps({"type": "string", "maxLength": 1000, "pattern": "[a-z]{2,8}(-[0-9]{1,4}){0,3}"})),
    ("regex", r"\{5000}[{]{1,3}\d{1,1000}"),  # an escaped brace and a class hold no count; 1000 is allowed
    ("ebnf_grammar", 'root ::= "a{5000}" ("b" | "c"){1,100}'),  # a quoted literal holds no count
]


@pytest.mark.parametrize("field,text,words", REFUSED)
def test_what_a_constraint_would_expand_to_is_refused_by_name(field, text, words):
    with pytest.raises(GrammarError, match=words) as err:
        check_constraint(SamplingParams(**{field: text}))
    assert str(err.value).startswith(field)


@pytest.mark.parametrize("field,text", ACCEPTED)
def test_ordinary_constraints_pass_the_bounds(field, text):
    check_constraint(SamplingParams(**{field: text}))
    assert grammar_limits.repetition_product("(a{10}){10}b{5}") == 100


class _HeldPool:
    """A compile pool whose compiles answer when the test sets `release` (those named "slow": `gate`),
    each with its text as the "compiled" payload."""

    def __init__(self):
        self.release, self.gate, self.started = threading.Event(), threading.Event(), []

    def warm(self):
        pass

    def submit(self, key, tokenizer, any_ws, field, text, timeout_s):
        fut = Future()

        def run():
            self.started.append(text)
            assert (self.gate if "slow" in text else self.release).wait(30)
            fut.set_result(text)

        threading.Thread(target=run, daemon=True).start()
        return fut


class _Slow(GrammarCompiler):
    """A compiler on a _HeldPool whose grammars are stand-ins of `size` bytes (the text's number
    before its colon)."""

    def __init__(self, **kw):
        self.held = _HeldPool()
        super().__init__("unused", 10, (), pool=self.held, **kw)
        self.release, self.gate = self.held.release, self.held.gate

    def _load(self, text):
        return SimpleNamespace(memory_size_bytes=int(text.split(":")[0]))

    def _compile_here(self, constraint, fut):  # an unbounded (TP follower's) compile: in process, at once
        fut.set_result(self._load(constraint[1]))


def test_at_most_max_pending_compile_at_once_and_cached_ones_are_still_served():
    c = _Slow(max_pending=2)
    first = c.compile_async(("regex", "1:a"))
    c.release.set()
    first.result(5)
    c.release.clear()
    slow = [c.compile_async(("regex", f"1:{x}")) for x in "bc"]  # two compiles in flight
    with pytest.raises(GrammarBusy, match="2 constraints are compiling"):
        c.compile_async(("regex", "1:d"))
    assert c.compile_async(("regex", "1:a")) is first  # cached: served whatever compiles
    assert c.compile_async(("regex", "1:e"), bounded=False) is not None  # a TP follower's is never refused
    c.release.set()
    for f in slow:
        f.result(5)
    c.compile_async(("regex", "1:d")).result(5)  # room again
    assert c.pending == 0
    c.close()


def test_the_cache_is_bounded_by_bytes():
    c = _Slow(max_cached_bytes=100)
    c.release.set()
    for text in ("60:a", "30:b", "50:c"):  # 60 + 30 + 50 > 100: the oldest goes
        c.compile_async(("regex", text)).result(5)
    assert list(c._cache) == [("regex", "30:b"), ("regex", "50:c")] and c.cached_bytes == 80
    c.compile_async(("regex", "500:d")).result(5)  # larger than the bound alone: only it stays
    assert list(c._cache) == [("regex", "500:d")] and c.cached_bytes == 500
    c.close()


def test_the_front_door_answers_resource_exhausted_while_max_pending_compile(checkpoint):
    pair = GrpcPair(checkpoint("llama"))
    try:
        compiler = pair.decode.scheduler.worker.grammar_compiler()
        compiler.pool = GatedPool(compiler.pool)
        gate = compiler.pool.gate
        held = [compiler.compile_async(("regex", f"[a-z]{{{i}}}")) for i in range(1, grammar.MAX_PENDING + 1)]
        with pytest.raises(grpc.RpcError) as err:
            pair.collect(pair.generate([5, 6, 7], 4, regex="(cat|dog)s?"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "compiling" in err.value.details()
        gate.set()
        for f in held:
            f.result(30)
        ids, _ = pair.collect(pair.generate([5, 6, 7], 4, regex="(cat|dog)s?"))  # served once they are done
        assert ids
    finally:
        pair.close()
