"""Structural bounds of a constraint, checked before it compiles: GrammarError naming what is too big.

xgrammar's compile time grows with what a constraint expands to, not with its length: a JSON schema
nested 400 levels deep (21.6 KB) compiled for 22 s and a 72-character regex for 13.4 s (a review,
2026-11-27), each holding a compile worker all that time. So before a compile:
- a JSON schema nests at most MAX_SCHEMA_DEPTH levels (objects and arrays of the JSON itself), its
  length and count keywords (minLength ... maxProperties) are at most MAX_REPEAT, and each of its
  regexes (`pattern`, the keys of `patternProperties`) passes the regex bound below;
- a regex, an EBNF grammar and a schema's pattern: every counted repetition ({m}, {m,}, {m,n}) counts
  at most MAX_REPEAT, and counted repetitions nested in one another multiply to at most MAX_REPEAT
  (`repetition_product`: groups, escapes, character classes and, in EBNF, quoted strings understood).
A structural tag's schemas are JSON schemas too. Measured with SmolLM2-135M's 49K-token vocabulary
(AMD EPYC, 2026-11-27, xgrammar 0.2.8): nested counts multiplying to 900 compiled in 0.1-0.6 s; a
string of maxLength 64-1000 in 1.4-4.2 s whatever the bound (any-character states cost per state, not
per count), so the compile deadline and the bound on compiles at once (grammar.py) stay the backstop.
"""

from __future__ import annotations

import json
import re

MAX_SCHEMA_DEPTH = 32  # levels of JSON nesting of a schema document
MAX_REPEAT = 1000  # one counted repetition, or nested ones multiplied
COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


class LimitError(ValueError):
    """What is too big, in words (grammar.py raises it as a GrammarError naming the field)."""


def _skip_class(text: str, i: int) -> int:
    """The index after the character class opening at text[i] == '['."""
    i += 1
    if i < len(text) and text[i] == "^":
        i += 1
    if i < len(text) and text[i] == "]":  # a leading ] is a literal
        i += 1
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _skip_string(text: str, i: int) -> int:
    """The index after the quoted string opening at text[i] (EBNF literals)."""
    quote, i = text[i], i + 1
    while i < len(text) and text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _scan(text: str, i: int, quoted: bool) -> tuple[int, int]:
    """(the largest product of counted repetitions nested in the group from i, the index after it)."""
    best, last = 1, 1  # last: what the previous atom multiplies a count after it by
    while i < len(text):
        c = text[i]
        if c == "\\":
            i, last = i + 2, 1
        elif c == "[":
            i, last = _skip_class(text, i), 1
        elif quoted and c in "\"'":
            i, last = _skip_string(text, i), 1
        elif c == "(":
            last, i = _scan(text, i + 1, quoted)
            best = max(best, last)
        elif c == ")":
            return best, i + 1
        elif c == "{" and (m := _COUNT.match(text, i)):
            low, high = int(m.group(1)), m.group(2)
            count = max(low, int(high)) if high else low  # {m,}: m copies, then a loop
            if count > MAX_REPEAT:
                raise LimitError(f"a repetition counts {count}; at most {MAX_REPEAT}")
            last *= max(count, 1)
            best = max(best, last)
            i = m.end()
        else:
            i, last = i + 1, 1
    return best, i


def repetition_product(text: str, quoted: bool = False) -> int:
    """The largest product of counted repetitions nested in a regex (`quoted`: an EBNF grammar, whose
    quoted literals are skipped); LimitError past MAX_REPEAT."""
    product, _ = _scan(text, 0, quoted)
    if product > MAX_REPEAT:
        raise LimitError(f"nested repetitions multiply to {product}; at most {MAX_REPEAT}")
    return product


def check_regex(text: str, quoted: bool = False) -> None:
    repetition_product(text, quoted)


def _check_schema_node(node, depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise LimitError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(node, list):
        for item in node:
            _check_schema_node(item, depth + 1)
        return
    if not isinstance(node, dict):
        return
    for key in COUNT_KEYWORDS:
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_REPEAT:
            raise LimitError(f"{key} is {value}; at most {MAX_REPEAT}")
    if isinstance(node.get("pattern"), str):
        check_regex(node["pattern"])
    if isinstance(node.get("patternProperties"), dict):
        for pattern in node["patternProperties"]:
            check_regex(pattern)
    for value in node.values():
        _check_schema_node(value, depth + 1)


def check_schema(text: str, what: str = "the schema") -> None:
    """A JSON schema's bounds, or each schema's inside a structural tag (a document that is not JSON is
    left to the compiler to refuse)."""
    try:
        doc = json.loads(text)
    except RecursionError:
        raise LimitError(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    except ValueError:
        return
    _check_schema_node(doc, 1)


def check(field: str, text: str) -> None:
    """LimitError when the constraint (`field` as in grammar.CONSTRAINT_FIELDS) is too big to compile."""
    if field == "json_schema":
        check_schema(text)
    elif field == "regex":
        check_regex(text)
    elif field == "ebnf_grammar":
        check_regex(text, quoted=True)
    elif field == "structural_tag":
        check_schema(text, "the structural tag")
