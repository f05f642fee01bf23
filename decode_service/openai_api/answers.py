"""The engine's GenerateResponses (smg's proto, as gRPC clients get them) turned into OpenAI answers:
chat.completion / text_completion objects, or their streamed chunks.

A response holds prompts x n choices (completions may send several prompts): choice p * n + j is
sample j of prompt p, as OpenAI numbers them. Each choice's text goes through text.ChoiceText (stops,
UTF-8 boundaries); a tool choice other than `none` makes the choice's answer wait for its end, to be
read as calls (chat.py), and come as one delta. Usage counts every prompt once and every choice's
tokens; `prompt_tokens_details.cached_tokens` is the larger of what prefill's prefix cache held (not
computed) and what decode's held (not handed off).
"""

from __future__ import annotations

import time

from decode_service.openai_api import chat, text
from decode_service.openai_api.protocol import ChatRequest, CompletionRequest


def _logprobs(msg) -> tuple[list[float], list[list[tuple[int, float]]]]:
    tops = [list(zip(t.token_ids, t.values)) for t in msg.top_logprobs]
    return list(msg.token_logprobs), tops + [[] for _ in range(len(msg.token_logprobs) - len(tops))]


class Choice:
    def __init__(self, index: int, tokenizer, req, tools):
        self.index = index
        self.text = text.ChoiceText(tokenizer, req.stops(), bool(req.stop_token_ids), req.include_stop_str_in_output)
        self.ids: list[int] = []
        self.values: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None
        self.matched_stop = None
        self.tools = tools  # (mode, parser, named function) of a chat request
        self.buffered = tools is not None and tools[0] != "none"

    def add(self, ids, logprobs) -> str:
        self.ids.extend(ids)
        if logprobs is not None:
            values, tops = _logprobs(logprobs)
            self.values += values
            self.tops += tops
        return self.text.add(list(ids))

    def finish(self, complete) -> str:
        matched_token = complete.HasField("matched_token_id")
        matched_str = complete.matched_stop_str if complete.HasField("matched_stop_str") else None
        self.finish_reason = complete.finish_reason
        self.matched_stop = complete.matched_token_id if matched_token else matched_str
        return self.text.finish(matched_token, matched_str)

    def message(self) -> dict:
        """The chat message of a finished choice (tool calls read from its text)."""
        content = self.text.detok.text
        mode, parser, named = self.tools or ("none", None, None)
        calls = None
        if mode in ("required", "named"):
            calls = chat.forced_calls(mode, content, named)
        elif mode == "auto":
            content, calls = chat.parse_calls(parser, content)
        if calls:
            self.finish_reason = "tool_calls" if self.finish_reason == "stop" else self.finish_reason
            return {"role": "assistant", "content": content if mode == "auto" else None, "tool_calls": calls}
        return {"role": "assistant", "content": content}


class Answer:
    """The choices of one request, fed the engine's responses of each of its prompts."""

    def __init__(self, rid: str, model: str, tokenizer, req: ChatRequest | CompletionRequest, prompts, tools=None):
        self.rid, self.model, self.tokenizer, self.req = rid, model, tokenizer, req
        self.created = int(time.time())
        self.chat = isinstance(req, ChatRequest)
        self.prompts = prompts  # (prompt ids, prompt text or None) per prompt
        self.choices = [Choice(i, tokenizer, req, tools) for i in range(len(prompts) * req.n)]
        self.prompt_logprobs: dict[int, tuple[list, list]] = {}
        self.cached = [0] * len(prompts)
        self.open = len(self.choices)

    def feed(self, p: int, response) -> list[dict]:
        """Take one engine response of prompt `p`; the stream chunks it makes (empty when not streaming)."""
        if response.HasField("chunk"):
            r = response.chunk
            c = self.choices[p * self.req.n + r.index]
            if r.HasField("input_logprobs"):
                self.prompt_logprobs[p] = r.input_logprobs
            before = len(c.ids)
            delta = c.add(r.token_ids, r.output_logprobs if r.HasField("output_logprobs") else None)
            return self._chunks(c, delta, before, finished=False)
        r = response.complete
        c = self.choices[p * self.req.n + r.index]
        before = len(c.ids)
        if not self.req.stream:
            c.add(r.output_ids, r.output_logprobs if r.HasField("output_logprobs") else None)
            if r.HasField("input_logprobs"):
                self.prompt_logprobs[p] = r.input_logprobs
        if r.index == 0:
            self.cached[p] = r.cached_tokens
        delta = c.finish(r)
        self.open -= 1
        return self._chunks(c, delta, before, finished=True) if self.req.stream else []

    # ---- streaming -------------------------------------------------------------------------------
    def _chunk(self, choice: dict) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        out = {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}
        opts = self.req.stream_options
        if opts is not None and opts.include_usage and opts.continuous_usage_stats:
            out["usage"] = self.usage()
        return out

    def first_chunks(self) -> list[dict]:
        """Chat streams open every choice with the assistant's role; completions with echo with the prompt."""
        if not self.chat:
            if not self.req.echo:
                return []
            return [self._chunk({"index": c.index, "text": self._echo(c.index // self.req.n, c)[0], "logprobs": None,
                                 "finish_reason": None}) for c in self.choices]  # fmt: skip
        return [self._chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for c in self.choices]  # fmt: skip

    def _chunks(self, c: Choice, delta: str, before: int, finished: bool) -> list[dict]:
        if not self.req.stream:
            return []
        logprobs = None
        if self._wants_logprobs() and len(c.values) > before:
            logprobs = self._logprobs(c, before, len(c.values), streamed=len(c.text.detok.text) - len(delta))
        if c.buffered:
            if not finished:
                return []
            message = c.message()
            delta_msg = {k: v for k, v in message.items() if k != "role" and v is not None}
            for i, call in enumerate(delta_msg.get("tool_calls", ())):
                call["index"] = i
            return [self._chunk({"index": c.index, "delta": delta_msg, "logprobs": logprobs,
                                 "finish_reason": c.finish_reason})]  # fmt: skip
        if not delta and logprobs is None and not finished:
            return []
        reason = c.finish_reason if finished else None
        if self.chat:
            body = {"index": c.index, "delta": {"content": delta} if delta else {}, "logprobs": logprobs}
        else:
            body = {"index": c.index, "text": delta, "logprobs": logprobs}
        return [self._chunk(dict(body, finish_reason=reason))]

    def usage_chunk(self) -> dict | None:
        opts = self.req.stream_options
        if opts is None or not opts.include_usage:
            return None
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage()}  # fmt: skip

    # ---- the whole answer ------------------------------------------------------------------------
    def usage(self) -> dict:
        prompt = sum(len(ids) for ids, _ in self.prompts)
        completion = sum(len(c.ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached)}}  # fmt: skip

    def _wants_logprobs(self) -> bool:
        return bool(self.req.logprobs) if self.chat else self.req.logprobs is not None

    def _logprobs(self, c: Choice, start: int, end: int, streamed: int = 0):
        ids, values, tops = c.ids[start:end], c.values[start:end], c.tops[start:end]
        if self.chat:
            return {"content": text.chat_logprobs(self.tokenizer, ids, values, tops)}
        return text.completion_logprobs(self.tokenizer, ids, values, tops, streamed)

    def _echo(self, p: int, c: Choice) -> tuple[str, dict | None]:
        """Completions' echo: the prompt's text before the choice's, and its logprobs before the choice's."""
        ids, given = self.prompts[p]
        prompt_text = given if given is not None else self.tokenizer.decode(ids, skip_special_tokens=True)
        if not self._wants_logprobs() or self.req.stream:
            return prompt_text, None
        msg = self.prompt_logprobs.get(p)
        values = [e.value if e.HasField("value") else None for e in msg.token_logprobs] if msg else [None] * len(ids)
        tops = [list(zip(t.token_ids, t.values)) or None for t in msg.top_logprobs] if msg else [None] * len(ids)
        tops += [None] * (len(values) - len(tops))
        head = text.completion_logprobs(self.tokenizer, ids, values, tops, 0)
        tail = self._logprobs(c, 0, len(c.values), streamed=len(prompt_text))
        return prompt_text, {k: head[k] + tail[k] for k in head}

    def body(self) -> dict:
        choices = []
        for c in self.choices:
            logprobs = self._logprobs(c, 0, len(c.values)) if self._wants_logprobs() else None
            if self.chat:
                message = c.message()
                choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "matched_stop": c.matched_stop})  # fmt: skip
                continue
            out = c.text.detok.text
            if self.req.echo:
                prompt_text, echoed = self._echo(c.index // self.req.n, c)
                out, logprobs = prompt_text + out, echoed if echoed is not None else logprobs
            choices.append({"index": c.index, "text": out, "logprobs": logprobs, "finish_reason": c.finish_reason,
                            "matched_stop": c.matched_stop})  # fmt: skip
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage()}  # fmt: skip
