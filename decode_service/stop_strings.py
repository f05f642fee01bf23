"""Stop strings (SamplingParams.stop_strings, GenerateRequest's `stop`): the decode scheduler
detokenizes each such request's output as tokens arrive and finishes it at the first token whose text
completes one (finish "stop", `matched_stop_str`); its ids keep that token (smg, or the client, trims
the text unless no_stop_trim). Detokenization is incremental (as vLLM's): each check decodes only
the tokens since the previous check and the step before them (`DecodeReq.stop_scan`: prefix and read
offsets into the output ids, and the last len(longest stop) - 1 characters already searched), so a
check costs the same at token 8,000 as at token 8 (decoding the whole output at every token cost
4.8 ms per token per request at 8k tokens with 16 x 256-character stops). The new text, after that
tail, is searched, so a stop is found once, at the token that completes it. Text that ends in an
incomplete UTF-8 sequence (U+FFFD) waits for the next token before it is searched.

smg 1.13 strips `stop` from chat/completions requests and matches it in the gateway (its
StopSequenceDecoder; single-token stops arrive as stop_token_ids): only direct gRPC clients send
`stop` here. The tokenizer is the checkpoint's (common/tools/tokenizer.py), loaded on first use.
"""

from __future__ import annotations

import threading

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


def check_stop_strings(stops) -> tuple[str, ...]:
    """A request's stop strings as a tuple; ValueError naming `stop` when there are too many, or one is
    empty or too long."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for s in stops:
        if not s or len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters, got {s!r}")
    return tuple(stops)


class StopStrings:
    """The matcher of one decode service: its tokenizer (loaded once, on first use) and, per request,
    where its incremental detokenization stands (`DecodeReq.stop_scan`)."""

    def __init__(self, tokenizer_path: str):
        self.path = tokenizer_path
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                from common.tools.tokenizer import load_tokenizer

                self._tokenizer = load_tokenizer(self.path)
            return self._tokenizer

    def match(self, req) -> str | None:
        """The stop string the newest output token completed (the earliest in the text), or None."""
        stops, ids = req.params.stop_strings, req.output_ids
        prefix_at, read_at, tail = req.stop_scan
        before = self.tokenizer.decode(ids[prefix_at:read_at], skip_special_tokens=False)
        text = self.tokenizer.decode(ids[prefix_at:], skip_special_tokens=False)
        if text.endswith("\ufffd") or len(text) <= len(before):
            return None  # an incomplete character, or no text yet: search once there is
        window = tail + text[len(before) :]  # the searched tail, then what the new tokens added
        keep = max(len(s) for s in stops) - 1
        req.stop_scan = (read_at, len(ids), window[len(window) - keep :] if keep else "")
        found = [(i, s) for s in stops if (i := window.find(s)) >= 0]
        return min(found)[1] if found else None
