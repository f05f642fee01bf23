"""The OpenAI request bodies this API takes (pydantic), and its error.

Fields follow OpenAI's chat and completions APIs, plus the extensions SGLang and vLLM serve (top_k,
min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos, include_stop_str_in_output, regex,
ebnf, continue_final_message, chat_template_kwargs). Unknown fields are refused by name
(`extra="forbid"`): a field this engine cannot honour is never silently dropped. `user` is accepted
and ignored, as OpenAI's own servers treat it (an end-user id for abuse monitoring).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128  # the engine's bound on samples of one prompt (decode_service/request_validation.py)


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP status, message, type, and the offending parameter where one is."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}  # fmt: skip

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "internal_server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class Sampling(BaseModel):
    """What chat and completions share: sampling, stops, constraints, streaming."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    regex: str | None = None  # SGLang's
    ebnf: str | None = None  # SGLang's
    user: str | None = None  # accepted, ignored

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())


class ChatRequest(Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
