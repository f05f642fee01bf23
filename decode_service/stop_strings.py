"""Stop strings (SamplingParams.stop_strings, GenerateRequest's `stop`): the decode scheduler
detokenizes each such request's output as tokens arrive and finishes it at the first token whose text
completes one (finish "stop", `matched_stop_str`); its ids keep that token (smg, or the client, trims
the text unless no_stop_trim). Only the text a new token added, plus the longest stop string's
length before it, is searched, so a stop is found once, at the token that completes it. Text that
ends in an incomplete UTF-8 sequence (U+FFFD) waits for the next token before it is searched.

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
    how much of its output text was searched (`DecodeReq.stop_searched`)."""

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
        stops = req.params.stop_strings
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=False)
        if text.endswith("\ufffd"):
            return None  # an incomplete character: search once it is whole
        start = max(0, req.stop_searched - max(len(s) for s in stops) + 1)
        req.stop_searched = len(text)
        found = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
        return min(found)[1] if found else None
