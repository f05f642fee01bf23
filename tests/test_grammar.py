"""Grammars through xgrammar (issue 43): regex, EBNF and JSON schema constraints, greedy output
token-exact against HF generate with xgrammar's own HF logits processor
(`xgr.contrib.hf.LogitsProcessor`, the same compiled grammar) in-process with overlap on and off
and over the gRPC pair (prefill masks the first token, decode advances its matcher from the
handoff's first token), also with --constrained-json-disable-any-whitespace on both services; a
grammar's end is "stop"; malformed constraints are INVALID_ARGUMENT naming the field (EAGLE:
tests/test_grammar_eagle.py); a first token the grammar refuses (a hostile or
buggy prefill replica) fails its own request only."""

import dataclasses
import json
import re

import pytest
import torch

from common.engine import grammar
from common.engine.sampling import SamplingParams
from common.request_rules import InvalidRequest
from decode_service.grammar_state import check_request
from tests.decode_harness import ManualPair, Pair
from tests.grpc_harness import GrpcPair, assert_invalid_fields
from tests.oracle import hf_model

N = 24
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 30)), [3, 4, 3, 4, 3], [7, 7, 8]]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
    "required": ["a", "b"],
}
TAG = {  # xgrammar's structural tag: a fixed prefix, then an integer
    "type": "structural_tag",
    "format": {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": "n="},
            {"type": "json_schema", "json_schema": {"type": "integer"}},
        ],
    },
}
CONSTRAINTS = [
    ("regex", r"(cat|dog)s? [0-9]{2,4}"),
    ("ebnf_grammar", 'root ::= "yes" | "no" | "maybe " [a-z]+ "!"'),
    ("json_schema", json.dumps(SCHEMA)),
    ("structural_tag", json.dumps(TAG)),
]


def compiler(path: str) -> grammar.GrammarCompiler:
    from common.models.config import load_model_config

    cfg = load_model_config(path)
    return grammar.compiler_for(path, cfg.vocab_size, tuple(cfg.eos_token_ids))


@torch.inference_mode()
def hf_constrained(path: str, prompt: list[int], constraint, max_new: int = N, any_whitespace=True) -> list[int]:
    """HF greedy with xgrammar's HF processor, stopping at the model's EOS ids (the grammar's stops)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from common.models.config import load_model_config

    cfg = load_model_config(path)
    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(path), vocab_size=cfg.vocab_size, stop_token_ids=list(cfg.eos_token_ids)
    )
    c = xgr.GrammarCompiler(info)
    field, text = constraint
    compiled = {
        "regex": c.compile_regex,
        "ebnf_grammar": c.compile_grammar,
        "json_schema": lambda s: c.compile_json_schema(s, any_whitespace=any_whitespace),
        "structural_tag": c.compile_structural_tag,
    }[field](text)
    out = hf_model(path).generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=list(cfg.eos_token_ids),
        pad_token_id=0,
        logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)],
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def cases(checkpoint):
    path = checkpoint("llama")
    want = [hf_constrained(path, p, c) for p, c in zip(PROMPTS, CONSTRAINTS)]
    from transformers import AutoTokenizer

    text = [AutoTokenizer.from_pretrained(path).decode(w, skip_special_tokens=True) for w in want]
    assert re.fullmatch(r"(cat|dog)s? [0-9]{0,4}", text[0]) and text[3].startswith("n="), text  # constrained
    return path, want


def params_of(constraint, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=N, **{constraint[0]: constraint[1]}, **kw)


def test_compiled_once_per_distinct_constraint_and_malformed_ones_name_their_field(checkpoint):
    c = compiler(checkpoint("llama"))
    a = c.compile(("regex", "[ab]+c"))
    assert c.compile(("regex", "[ab]+c")) is a  # cached
    malformed = [("json_schema", "{not json"), ("regex", "(unclosed"), ("ebnf_grammar", "root ::= ")]
    malformed += [("structural_tag", "{"), ("structural_tag", '{"structures": [{"begin": "<a>"}], "triggers": []}')]
    for field, text in malformed:
        with pytest.raises(grammar.GrammarError, match=field):
            c.compile((field, text))
    with pytest.raises(ValueError, match="at most one constraint"):
        SamplingParams(regex="a", json_schema="{}").validate()


def test_a_worker_without_grammars_refuses_constrained_requests():
    with pytest.raises(InvalidRequest, match="serves no grammars"):
        check_request(object(), params_of(CONSTRAINTS[0]))


@pytest.mark.parametrize("overlap", [True, False])
def test_grammars_match_hf_in_process(cases, overlap):
    path, want = cases
    pair = Pair(path, overlap=overlap)
    try:
        pair.submit("first", PROMPTS[0], SamplingParams(max_new_tokens=4))
        pair.wait(["first"])
        assert pair.worker.grammar is None, "an unconstrained batch made grammar state"
        for i, (p, c) in enumerate(zip(PROMPTS, CONSTRAINTS)):
            pair.submit(str(i), p, params_of(c))
        pair.submit("plain", PROMPTS[0], SamplingParams(max_new_tokens=N, ignore_eos=True))  # shares the batch
        pair.wait([str(i) for i in range(len(PROMPTS))] + ["plain"])
        for i in range(len(PROMPTS)):
            assert pair.out.tokens[str(i)] == want[i], f"{CONSTRAINTS[i][0]}"
            ended = want[i][-1] in (2, 4) or len(want[i]) < N
            assert pair.out.finishes[str(i)].reason == ("stop" if ended else "length")
        assert any(len(w) < N for w in want), "no grammar ended: termination untested"
        assert len(pair.out.tokens["plain"]) == N
        # ignore_eos does not outlive the grammar: it ends where the grammar does
        short = next(i for i, w in enumerate(want) if len(w) < N)
        pair.submit("ign", PROMPTS[short], params_of(CONSTRAINTS[short], ignore_eos=True))
        pair.wait(["ign"])
        assert pair.out.tokens["ign"] == want[short] and pair.out.finishes["ign"].reason == "stop"
    finally:
        pair.close()


def test_grammars_over_grpc_match_hf(cases):
    path, want = cases
    pair = GrpcPair(path)
    try:
        for i, (p, (field, text)) in enumerate(zip(PROMPTS, CONSTRAINTS)):
            ids, complete = pair.collect(pair.generate(p, N, stream=i % 2 == 0, rid=f"g{i}", **{field: text}))
            assert ids == want[i], field
        # a prefix-cache hit on prefill changes nothing about the mask of the first token or after it
        ids, complete = pair.collect(pair.generate(PROMPTS[1], N, rid="again", **dict([CONSTRAINTS[1]])))
        assert ids == want[1] and complete.cached_tokens > 0
        bad = [
            ({"json_schema": '{"type": "object", "properties": '}, "json_schema"),
            ({"regex": "(unclosed"}, "regex"),
            ({"ebnf_grammar": "root ::= missing_rule"}, "ebnf_grammar"),
        ]
        assert_invalid_fields(pair, PROMPTS[0], bad)
    finally:
        pair.close()


def test_sampled_grammar_output_is_the_same_with_and_without_overlap_and_matches(checkpoint):
    """temperature > 0 with a seed and a top-k: the grammar holds for sampled tokens too, and the
    overlap (the mask of step N+1 waits for step N's token) changes nothing."""
    from transformers import AutoTokenizer

    path = checkpoint("llama")
    regex = r"[a-z]{3,6}( [a-z]{2,5}){1,3}\."
    sp = [
        SamplingParams(max_new_tokens=40, temperature=t, top_k=50, seed=7 + i, regex=regex)
        for i, t in enumerate((0.8, 1.5))
    ]
    got = []
    for overlap in (True, False):
        pair = Pair(path, overlap=overlap)
        try:
            for i, p in enumerate(sp):
                pair.submit(f"s{i}", PROMPTS[i], p)
            pair.wait([f"s{i}" for i in range(len(sp))])
            got.append([pair.out.tokens[f"s{i}"] for i in range(len(sp))])
            assert all(pair.out.finishes[f"s{i}"].reason == "stop" for i in range(len(sp)))
        finally:
            pair.close()
    assert got[0] == got[1]
    tok = AutoTokenizer.from_pretrained(path)
    for ids in got[0]:
        assert ids[-1] in (2, 4) and re.fullmatch(regex, tok.decode(ids[:-1])), tok.decode(ids)


def test_json_without_free_whitespace_matches_hf_over_grpc(cases):
    """--constrained-json-disable-any-whitespace on both services: their compilers refuse a
    whitespace token after "{" that the default accepts, and the answers are HF's with the schema
    compiled any_whitespace=False (the tiny model picks whitespace wherever it may: they differ)."""
    from transformers import AutoTokenizer

    path, want = cases
    schema = CONSTRAINTS[2]
    tok = AutoTokenizer.from_pretrained(path)
    brace, space = tok.encode("{", add_special_tokens=False), tok.encode(" ", add_special_tokens=False)
    strict = [hf_constrained(path, p, schema, any_whitespace=False) for p in PROMPTS]
    loose = [hf_constrained(path, p, schema) for p in PROMPTS]
    assert strict != loose
    flag = dict(constrained_json_disable_any_whitespace=True)
    pair = GrpcPair(path, prefill_kw=flag, decode_kw=flag)
    try:
        for runner in (pair.prefill.runner, pair.decode.scheduler.worker.runner):
            m = grammar.new_matcher(grammar.runner_compiler(runner).compile(schema), brace)
            assert len(space) == 1 and not m.accept_token(space[0]), "the strict compiler took a space"
        m = grammar.new_matcher(compiler(path).compile(schema), brace)  # the default compiler does
        assert m.accept_token(space[0])
        for i, p in enumerate(PROMPTS):
            ids, _ = pair.collect(pair.generate(p, N, stream=i % 2 == 0, rid=f"w{i}", json_schema=schema[1]))
            assert ids == strict[i], tok.decode(ids)
            if ids[-1] in (2, 4):  # the grammar ended: the text is the JSON
                assert isinstance(json.loads(tok.decode(ids, skip_special_tokens=True)), dict)
    finally:
        pair.close()


def refused_first_token(path: str, constraint) -> int:
    """A token the grammar refuses at its start."""
    m = grammar.new_matcher(compiler(path).compile(constraint))
    return next(t for t in range(3, 384) if not m.accept_token(t))


@pytest.mark.parametrize("where", ["in the record", "streamed", "of the second sample"])
def test_a_first_token_the_grammar_refuses_fails_its_request_alone(cases, where):
    """A hostile or buggy prefill replica sends a first token the grammar does not allow: that request
    ends with an error (checked on the scheduler's thread before anything of it is submitted, so no
    matcher is seeded with it), its slots are freed once, and a constrained sibling is HF's exactly."""
    path, want = cases
    bad_constraint = CONSTRAINTS[0]
    refused = refused_first_token(path, bad_constraint)
    pair = ManualPair(path)
    try:
        n = 2 if where == "of the second sample" else 1
        pair.submit("bad", PROMPTS[0], params_of(bad_constraint, n=n))
        pair.submit("good", PROMPTS[2], params_of(CONSTRAINTS[2]))
        pair.scheduler.step()  # admission: both reserved
        handoffs = {h.rid: h for h in pair.prefill_worker.prefill(pair.pending)}
        pair.pending.clear()
        bad = handoffs["bad"]
        if where == "in the record":
            bad = dataclasses.replace(bad, first_token=refused)
        elif where == "streamed":
            pair.scheduler.inbox.deliver_first_token("bad", refused)  # before the (sound) record
        else:
            bad = dataclasses.replace(bad, more_first_tokens=(refused,))
        for h in (bad, handoffs["good"]):
            pair.scheduler.inbox.deliver_handoff(h)
    finally:
        pair.close()  # runs to idle (a scheduler-fatal error raises here), checks integrity and the pools
    samples = {f"bad/{i}": "error" for i in range(1, n)}  # n > 1 never forked: each sample's answer ends with it
    assert pair.scheduler.alive and pair.out.reasons == {"bad": "error", **samples, "good": pair.out.reasons["good"]}
    assert f"token {refused} is not allowed" in pair.out.finishes["bad"].error
    assert refused not in pair.out.tokens.get("bad", [])  # never streamed
    assert pair.out.tokens["good"] == want[2] and pair.out.reasons["good"] in ("stop", "length")
