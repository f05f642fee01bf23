"""The grammar compile worker with one change for tests: a constraint whose text contains "stall"
never finishes compiling (it sleeps), so the pool's deadline has something to kill."""

from __future__ import annotations

import sys
import time
from multiprocessing.connection import Connection

from common.engine.grammar_worker import compile_with, serve


def _compile(compiler, field, text, any_ws):
    while "stall" in text:
        time.sleep(1)
    return compile_with(compiler, field, text, any_ws)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), compile_fn=_compile)
