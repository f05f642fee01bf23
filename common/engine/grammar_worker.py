"""A grammar compile worker: a child process that compiles constraints for its parent (compile_pool.py).

    python -m common.engine.grammar_worker FD

FD is this end of a socket pair the parent made. It says ("ready",) once xgrammar is imported, then
answers messages (multiprocessing Connection framing, from the parent only, which started it):
- ("tokenizer", key, info_json, any_whitespace): a tokenizer's xgrammar TokenizerInfo (serialized
  by the parent, which loaded the tokenizer), kept under `key` for the compiles that name it;
- ("compile", key, field, text): one constraint -> ("ok", compiled grammar as xgrammar's JSON) or
  ("error", first line of what went wrong).
A compile cannot be cancelled inside xgrammar, so a compile past its deadline is ended by the parent
killing this process; nothing here outlives it. End of input (the parent gone) ends the process.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection


def compile_with(compiler, field: str, text: str, any_whitespace: bool):
    """One constraint compiled by an xgrammar GrammarCompiler (the field picks the kind)."""
    from common.engine.grammar import structural_tag_args

    if field == "json_schema":
        return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
    if field == "regex":
        return compiler.compile_regex(text)
    if field == "ebnf_grammar":
        return compiler.compile_grammar(text)
    return compiler.compile_structural_tag(*structural_tag_args(text))


def serve(conn: Connection, compile_fn=compile_with) -> None:
    """Answer the parent's messages until it closes the connection."""
    import xgrammar as xgr

    compilers: dict[int, tuple] = {}  # key -> (xgrammar compiler, any_whitespace)
    try:
        conn.send(("ready",))
    except OSError:
        return  # the parent is gone already (it ended while this worker started)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "tokenizer":
            _, key, info_json, any_ws = msg
            info = xgr.TokenizerInfo.deserialize_json(info_json)
            compilers[key] = (xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False), any_ws)
            continue
        _, key, field, text = msg
        try:
            compiler, any_ws = compilers[key]
            answer = ("ok", compile_fn(compiler, field, text, any_ws).serialize_json())
        except Exception as e:  # noqa: BLE001 (the constraint's fault: the parent names the field)
            lines = str(e).strip().splitlines() or [type(e).__name__]
            answer = ("error", lines[0][:300])
        try:
            conn.send(answer)
        except OSError:
            return  # the parent is gone (or gave up on this compile and closed its end)


def main(argv: list[str]) -> None:
    serve(Connection(int(argv[0])))


if __name__ == "__main__":
    main(sys.argv[1:])
