"""Ids to text for the OpenAI API: incremental detokenization, the stop rules, logprob entries.

`Detokenizer` decodes only the tokens since the last call and the one step before them (prefix and
read offsets, as vLLM's), so a long stream costs the same per token at its end as at its start, and
holds back text that ends in an incomplete UTF-8 sequence (U+FFFD) until the next token completes
it: no character is ever split across chunks. The non-streaming answer goes through the same object
fed at once, so streamed deltas add up to the non-streamed text.

Stops (OpenAI's semantics; the engine ends decoding at them): the text ends before a matched stop
string, and a matched stop token (EOS, stop_token_ids) adds no text; `include_stop_str_in_output`
keeps either. While streaming, the last len(longest stop) - 1 characters wait until the answer is
known not to end there, and a token that may be a stop token waits one token.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_at = self.read_at = 0
        self.text = ""

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: list[int], final: bool = False) -> str:
        """The text the new `ids` complete (with `final`, whatever is held back too)."""
        self.ids.extend(ids)
        before = self._decode(self.ids[self.prefix_at : self.read_at])
        text = self._decode(self.ids[self.prefix_at :])
        if (text.endswith("\ufffd") and not final) or len(text) < len(before):
            return ""
        new = text[len(before) :]
        self.prefix_at, self.read_at = self.read_at, len(self.ids)
        self.text += new
        return new


class ChoiceText:
    """One choice's text as its ids arrive, under the request's stop rules."""

    def __init__(self, tokenizer, stops: list[str], stop_ids: bool, include_stop: bool):
        self.detok = Detokenizer(tokenizer)
        self.stops = stops
        self.hold_chars = max((len(s) for s in stops), default=1) - 1  # a stop string may be starting
        self.hold_token = stop_ids and not include_stop  # the newest token may be a stop token
        self.include_stop = include_stop
        self.pending: list[int] = []
        self.sent = 0  # characters streamed so far

    def add(self, ids: list[int]) -> str:
        """The text that may be streamed now (a delta)."""
        ids = self.pending + list(ids)
        self.pending = ids[-1:] if self.hold_token and ids else []
        self.detok.add(ids[: len(ids) - len(self.pending)])
        text = self.detok.text
        safe = len(text) - self.hold_chars
        look = max(0, self.sent - self.hold_chars)  # a stop completed by these ids (its finish comes next)
        for s in self.stops:
            at = text.find(s, look)
            if at >= 0:
                safe = min(safe, at)
        if safe <= self.sent:
            return ""
        delta, self.sent = self.detok.text[self.sent : safe], safe
        return delta

    def finish(self, matched_token: bool, matched_str: str | None) -> str:
        """The rest of the text once the answer ended (the delta after the last `add`)."""
        keep = self.pending if not matched_token or self.include_stop else []
        self.detok.add(keep, final=True)
        text = self.detok.text
        if matched_str:
            at = text.find(matched_str)
            if at >= 0:
                text = text[: at + (len(matched_str) if self.include_stop else 0)]
        delta, self.sent = text[self.sent :], len(text)
        self.detok.text = text
        return delta


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer, ids, values, tops) -> list[dict]:
    """OpenAI chat's logprobs.content entries: (ids, their logprobs, their top candidates)."""

    def entry(t, v):
        s = token_text(tokenizer, t)
        return {"token": s, "logprob": v, "bytes": list(s.encode())}

    out = []
    for t, v, top in zip(ids, values, tops):
        out.append(dict(entry(t, v), top_logprobs=[entry(tt, tv) for tt, tv in top]))
    return out


def completion_logprobs(tokenizer, ids, values, tops, offset: int) -> dict:
    """OpenAI completions' logprobs object: tokens, token_logprobs, top_logprobs, text_offset (from
    `offset`, the characters before the first of these tokens)."""
    tokens = [token_text(tokenizer, t) for t in ids]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    top = [None if c is None else {token_text(tokenizer, t): v for t, v in c} for c in tops]
    return {"tokens": tokens, "token_logprobs": list(values), "top_logprobs": top, "text_offset": offsets}
