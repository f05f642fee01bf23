"""Grammars (xgrammar): a request's constraint, its compilation and the token mask it gives.

A request may carry one constraint (SamplingParams: `json_schema`, `regex`, `ebnf_grammar` or
`structural_tag`, as smg's GenerateRequest oneof). `GrammarCompiler` compiles it with xgrammar for
one model's tokenizer, in the process's pool of compile workers (compile_pool.py: child processes),
once per distinct constraint (an LRU of futures, so concurrent requests with one schema compile it
once, bounded by count and by the compiled grammars' bytes; xgrammar's own cache is off), within a
time bound; a constraint that does not compile, or not in time, is a `GrammarError` (a ValueError
naming the field: the front doors answer INVALID_ARGUMENT before anything is reserved). What it would
expand to is bounded before it compiles (grammar_limits.py), and at most MAX_PENDING distinct
constraints compile or wait for a worker at once: past that a new one is `GrammarBusy`
(RESOURCE_EXHAUSTED: retry later), as is one that found no free worker before its deadline. A compile
past its deadline is ended (its worker process killed): it holds no CPU, no worker and no queue after.
`compiler_for(path, vocab_size, stop_ids, any_whitespace)` is one compiler per model folder in a
process (prefill and decode in one process share it). `--constrained-json-disable-any-whitespace`
(SGLang's flag, RunnerArgs) compiles JSON schemas with xgrammar's any_whitespace=False: no free
whitespace between JSON tokens; both services must take the same value (prefill masks the first
token with its compiler, decode the rest with its own).

The mask (docs/architecture.md, "The order of logits processing"): after penalties and logit_bias,
before temperature and filters, for the constrained rows only: a bitmask per row filled from its `xgr.GrammarMatcher`
(`fill_next_token_bitmask`), applied with `xgr.apply_token_bitmask_inplace` (`apply_bitmask`). The
matcher's stop tokens are the model's EOS ids: a grammar ends only by accepting one of them, and it
allows one only where the grammar may end.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future

import torch

from common.engine import compile_pool, grammar_limits
from common.forward.host_copy import to_device

logger = logging.getLogger(__name__)

CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf_grammar", "structural_tag")
MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema or grammar longer than this is refused before compiling
COMPILE_TIMEOUT_S = 10.0
MAX_CACHED = 256  # distinct compiled constraints kept per model ...
MAX_CACHED_BYTES = 512 << 20  # ... and their bytes (a ~39 KB regex compiled to ~26 MiB for SmolLM2)
MAX_PENDING = 8  # distinct constraints compiling or queued at once


_keys = itertools.count(1)


class GrammarError(ValueError):
    """A constraint that cannot be served: malformed, too long, too slow to compile, or not here."""


class GrammarBusy(GrammarError):
    """MAX_PENDING constraints are compiling already: this one is refused for now, not for what it is."""


def constraint_of(params) -> tuple[str, str] | None:
    """(field, text) of a request's constraint, or None; GrammarError when more than one is set."""
    set_ = [(f, getattr(params, f)) for f in CONSTRAINT_FIELDS if getattr(params, f, None) is not None]
    if len(set_) > 1:
        raise GrammarError(f"at most one constraint may be set, got {', '.join(f for f, _ in set_)}")
    return set_[0] if set_ else None


def check_constraint(params) -> None:
    """Checks that need no compiler (SamplingParams.validate): one constraint, of bounded length."""
    c = constraint_of(params)
    if c is not None and len(c[1]) > MAX_CONSTRAINT_CHARS:
        raise GrammarError(f"{c[0]} is {len(c[1])} characters long; at most {MAX_CONSTRAINT_CHARS} are allowed")
    if c is not None and not c[1].strip():
        raise GrammarError(f"{c[0]} is empty")
    if c is not None:  # what it would expand to (common/engine/grammar_limits.py), before any compile
        try:
            grammar_limits.check(*c)
        except grammar_limits.LimitError as e:
            raise GrammarError(f"{c[0]}: {e}") from None


def structural_tag_args(text: str) -> tuple:
    """xgrammar's arguments for a structural_tag: its JSON as is, or for the OpenAI / SGLang legacy
    form ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}) the tags and triggers."""
    import xgrammar as xgr

    try:
        obj = json.loads(text)
    except ValueError:
        raise GrammarError("structural_tag is not valid JSON") from None
    if isinstance(obj, dict) and "structures" in obj:
        try:
            tags = [
                xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                for s in obj["structures"]
            ]
            return tags, list(obj["triggers"])
        except (KeyError, TypeError) as e:
            raise GrammarError(f"structural_tag: a structure or its triggers are malformed ({e!r})") from None
    return (text,)


def tokenizer_info(path: str, vocab_size: int, stop_token_ids):
    """xgrammar's TokenizerInfo of the tokenizer in `path` (EOS: `stop_token_ids`)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer, with a bounded cache and a time bound (see the module)."""

    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        timeout_s: float = COMPILE_TIMEOUT_S,
        max_cached: int = MAX_CACHED,
        any_whitespace: bool = True,
        max_cached_bytes: int = MAX_CACHED_BYTES,
        max_pending: int = MAX_PENDING,
        pool: compile_pool.CompilePool | None = None,
    ):
        self.tokenizer_path, self.vocab_size, self.stop_token_ids = tokenizer_path, vocab_size, tuple(stop_token_ids)
        self.timeout_s, self.max_cached, self.any_whitespace = timeout_s, max_cached, any_whitespace
        self.max_cached_bytes, self.max_pending = max_cached_bytes, max_pending
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}  # compiled bytes of the cached, compiled ones
        self.cached_bytes, self.pending = 0, 0
        self.pool = pool if pool is not None else compile_pool.shared_pool()
        self._key = next(_keys)  # this tokenizer's name in the pool's workers
        self._info = self._info_json = None
        self._tokenizer_ready = threading.Lock()
        self._local = None  # an in-process xgrammar compiler, for unbounded compiles only
        self.pool.warm()

    def _tokenizer(self):
        """xgrammar's TokenizerInfo and its JSON, made once (loading the tokenizer takes a moment: on
        first use); the workers compile with the JSON, this process deserializes what they return."""
        with self._tokenizer_ready:
            return self._tokenizer_unlocked()

    def _tokenizer_unlocked(self):
        if self._info is None:
            info = tokenizer_info(self.tokenizer_path, self.vocab_size, self.stop_token_ids)
            self._info, self._info_json = info, info.serialize_json()
        return self._info, self._info_json

    def compile_async(self, constraint: tuple[str, str], bounded: bool = True) -> Future:
        """A future of the compiled grammar (one per distinct constraint while it stays cached); a new
        one past MAX_PENDING compiling is GrammarBusy unless `bounded` is False (a TP follower's compile
        of what rank 0 compiled already: it must not fail where rank 0's did not)."""
        with self._lock:
            fut = self._cache.get(constraint)
            if fut is not None:
                self._cache.move_to_end(constraint)
                return fut
            if bounded and self.pending >= self.max_pending:
                raise GrammarBusy(f"{self.pending} constraints are compiling already: try again shortly")
            self.pending += 1
            fut = self._start(constraint, bounded)
            self._cache[constraint] = fut
            self._evict()
        fut.add_done_callback(lambda f: self._done(constraint, f))
        return fut

    def _start(self, constraint, bounded: bool) -> Future:
        """The compile in the pool's worker processes (compile_pool.py): one past its deadline is
        killed there, so it holds no CPU and no queue; the future ends in the grammar or a GrammarError.
        An unbounded compile (a TP follower's of what rank 0 compiled in time, inside a step) runs on a
        thread of this process instead: no worker to start, no deadline to keep."""
        field = constraint[0]
        fut: Future = Future()
        if not bounded:
            threading.Thread(target=self._compile_here, args=(constraint, fut), daemon=True).start()
            return fut
        job = self.pool.submit(
            self._key, lambda: self._tokenizer()[1], self.any_whitespace, *constraint, self.timeout_s
        )

        def finish(job: Future) -> None:
            try:
                fut.set_result(self._load(job.result()))
            except compile_pool.CompileTimedOut:
                fut.set_exception(GrammarError(f"{field} did not compile within {self.timeout_s:g} s"))
            except compile_pool.NoWorkerFree as e:
                fut.set_exception(GrammarBusy(f"{field}: no grammar compile started in time ({e}): try again shortly"))
            except Exception as e:  # noqa: BLE001 (CompileFailed, or a reply that does not deserialize)
                fut.set_exception(GrammarError(f"{field} does not compile: {e}"))

        job.add_done_callback(finish)
        return fut

    def _compile_here(self, constraint, fut: Future) -> None:
        import xgrammar as xgr

        from common.engine.grammar_worker import compile_with

        try:
            with self._tokenizer_ready:
                if self._local is None:
                    self._local = xgr.GrammarCompiler(self._tokenizer_unlocked()[0], max_threads=1, cache_enabled=False)
            fut.set_result(compile_with(self._local, *constraint, self.any_whitespace))
        except Exception as e:  # noqa: BLE001 (the caller's, through the future)
            fut.set_exception(GrammarError(f"{constraint[0]} does not compile: {e}"))

    def _load(self, compiled_json: str):
        """A worker's compiled grammar, deserialized for this process's matchers."""
        import xgrammar as xgr

        return xgr.CompiledGrammar.deserialize_json(compiled_json, self._tokenizer()[0])

    def _done(self, constraint, fut) -> None:
        failed = fut.cancelled() or fut.exception() is not None
        size = 0 if failed else int(getattr(fut.result(), "memory_size_bytes", 0))
        with self._lock:
            self.pending -= 1
            if self._cache.get(constraint) is not fut:
                return  # evicted (or forgotten) while it compiled
            if failed:
                del self._cache[constraint]
                return
            self._sizes[constraint] = size
            self.cached_bytes += size
            self._evict()

    def _evict(self) -> None:
        """Oldest first, until the cache is within its count and bytes (the newest always stays)."""
        while len(self._cache) > 1 and (
            len(self._cache) > self.max_cached or self.cached_bytes > self.max_cached_bytes
        ):
            old, _ = self._cache.popitem(last=False)
            self.cached_bytes -= self._sizes.pop(old, 0)

    def compile(self, constraint: tuple[str, str]):
        """The compiled grammar; GrammarError naming the field when it does not compile in time
        (GrammarBusy when no worker was free in time)."""
        return self.compile_async(constraint).result()

    def close(self) -> None:
        """Nothing of its own to stop: the pool's workers are shared by the process's compilers."""


_compilers: dict[tuple, GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(path: str, vocab_size: int, stop_token_ids, any_whitespace: bool = True) -> GrammarCompiler:
    """This process's compiler for the tokenizer in `path` (one per folder, vocabulary, stop ids and
    JSON whitespace rule)."""
    key = (path, vocab_size, tuple(stop_token_ids), any_whitespace)
    with _compilers_lock:
        if key not in _compilers:
            _compilers[key] = GrammarCompiler(path, vocab_size, tuple(stop_token_ids), any_whitespace=any_whitespace)
        return _compilers[key]


def runner_compiler(runner) -> GrammarCompiler:
    """The compiler of a ModelRunner's model (under tensor parallelism every rank has its own: each
    samples the same tokens, so each masks alike)."""
    cfg = runner.config
    any_ws = not getattr(runner.args, "constrained_json_disable_any_whitespace", False)
    return compiler_for(runner.args.model_path, cfg.vocab_size, tuple(cfg.eos_token_ids), any_ws)


def compiled_on_rank(compiler: GrammarCompiler, constraint: tuple[str, str]):
    """The compiled grammar for stream work, with no time bound: the front door compiled it within
    one already (here it comes from the cache), and on a tensor-parallel follower rank this is its
    first compile, which must not fail where rank 0's succeeded (every rank masks alike)."""
    return compiler.compile_async(constraint, bounded=False).result()


def new_matcher(compiled, tokens: list[int] = ()):
    """A matcher at the grammar's start, advanced by `tokens` (outputs already committed)."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiled)
    for t in tokens:
        if not m.accept_token(int(t)):
            raise GrammarError(f"committed token {t} is not allowed by the grammar")
    return m


def fill_bitmask(matchers: list, vocab_size: int) -> torch.Tensor:
    """A bitmask [len(matchers), ceil(V/32)] (host int32): each live matcher's allowed next tokens;
    None or terminated matchers leave their row all-allowed."""
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for i, m in enumerate(matchers):
        if m is not None and not m.is_terminated():
            m.fill_next_token_bitmask(mask, i)
    return mask


def fill_tree_bitmask(matchers: list, tokens: list[list[int]], parents: list[list[int]] | None, vocab_size: int):
    """EAGLE's verify: a bitmask [len(matchers) * M, W] (host int32), row r * M + i the allowed next
    tokens after the path from node 0 (committed: the matcher stands after it) to node i of request
    r's draft tree; `tokens[r]` the M node tokens, `parents[r]` each node's parent (None: a chain, node
    i's parent is i - 1). Each path is accepted into the matcher and rolled back, so the matcher ends
    where it began. A node whose path the grammar refuses (it can never be accepted: its parent's mask
    excludes it) or ends (after a stop token) keeps its row all-allowed, as a None matcher's rows."""
    import xgrammar as xgr

    m_nodes = len(tokens[0]) if tokens else 0
    mask = xgr.allocate_token_bitmask(len(matchers) * m_nodes, vocab_size)
    for r, m in enumerate(matchers):
        if m is None or m.is_terminated():
            continue
        for i in range(m_nodes):
            path, j = [], i
            while j != 0:
                path.append(tokens[r][j])
                j = parents[r][j] if parents is not None else j - 1
            taken = 0
            for t in reversed(path):
                if m.is_terminated() or not m.accept_token(int(t)):
                    break
                taken += 1
            if taken == len(path) and not m.is_terminated():
                m.fill_next_token_bitmask(mask, r * m_nodes + i)
            if taken:
                m.rollback(taken)
    return mask


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> a copy whose `rows` (device int64 [R]) are masked by `mask` [R, W] (host)."""
    import xgrammar as xgr

    sub = logits.index_select(0, rows).float()
    if sub.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(sub, mask, vocab_size=sub.shape[-1])
    else:  # through pinned memory, non-blocking (host_copy.to_device): the host does not wait for the device
        xgr.apply_token_bitmask_inplace(sub, to_device(mask, sub.device), vocab_size=sub.shape[-1])
    return logits.float().index_copy(0, rows, sub)


def advance(matcher, token: int) -> None:
    """A committed token into its matcher (a token the mask did not allow is logged, never raised:
    e.g. every candidate masked by min_new_tokens and the grammar together)."""
    if matcher is None or matcher.is_terminated():
        return
    if not matcher.accept_token(int(token)):
        logger.warning("grammar matcher refused committed token %d; its row stays where it was", token)


def mask_first_tokens(runner, requests: list, lanes: list[int], logits: torch.Tensor) -> torch.Tensor:
    """Prefill: logits [N, V] with the rows `lanes` (of `requests`, HandoffRequests with a constraint)
    masked by their grammar at the first token sampled here (after a retry's resent outputs)."""
    compiler = runner_compiler(runner)
    matchers = []
    for r in requests:
        start = len(r.prompt_ids) - r.first_position
        matchers.append(new_matcher(compiled_on_rank(compiler, r.params.constraint), r.prompt_ids[start:]))
    mask = fill_bitmask(matchers, runner.config.vocab_size)
    return apply_bitmask(logits, to_device(lanes, logits.device), mask)
