"""The OpenAI HTTP API of the decode service (`--openai-port`): FastAPI on uvicorn, run on the gRPC
front door's own event loop, so an HTTP request goes through `DecodeService.generate` exactly as a
gRPC Generate does (admission, the seed, metrics, traces, abort), with no extra hop or thread.

Lifecycle of one request (/v1/chat/completions, /v1/completions):
  1. the API key (Authorization: Bearer, as the gRPC door's; /health and /v1/models' listing need it
     too, /health excepted), then the body, read up to a bound set by the model's context (413
     past it) and parsed (400 naming the first bad field; unknown fields refused by name);
  2. the model name checked (404), the prompt rendered (chat template, tools) and tokenized, one engine
     request per prompt built (engine_request.py);
  3. each runs through DecodeService.generate; its responses become the answer (answers.py), one JSON
     object or server-sent events ending in `data: [DONE]`;
  4. a client that goes away (streaming or not) cancels the generation: its slot and KV are freed
     (the same abort as a cancelled gRPC call). Refusals map to OpenAI's statuses: INVALID_ARGUMENT
     400, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, UNAUTHENTICATED 401, INTERNAL 500; a failure after
     the stream started is sent as an `error` event before [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import uuid

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from common.request_rules import MAX_REQUEST_OVERHEAD_BYTES
from decode_service.admission import Rejected
from decode_service.openai_api import chat, engine_request
from decode_service.openai_api.answers import Answer
from decode_service.openai_api.protocol import ApiError, ChatRequest, CompletionRequest

STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
          grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.UNAUTHENTICATED: 401}  # fmt: skip
BYTES_PER_TOKEN = 32  # a body's bound: the context's tokens as JSON text (escaped), beside the overhead


def body_bound(context_length: int) -> int:
    return BYTES_PER_TOKEN * context_length + MAX_REQUEST_OVERHEAD_BYTES


def _invalid(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    param = ".".join(str(x) for x in err["loc"]) or None
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"unsupported field: {param}", param)
    return ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param)


class OpenAIServer:
    def __init__(self, service, host: str, port: int, tool_call_parser: str | None = None):
        from common.tools.tokenizer import load_tokenizer

        self.service, self.host = service, host
        self.tool_call_parser = tool_call_parser
        self.tokenizer = load_tokenizer(service.config.model_path)
        self.model = service.served_model_name
        self.limit = body_bound(service.runner.context_length)
        key = service.config.api_key
        self._key = f"Bearer {key}".encode() if key else None
        self._sock = socket.create_server((host, port))  # bound now: a taken port fails the start
        self.port = self._sock.getsockname()[1]
        cfg = service.config
        ssl = {}
        if cfg.tls_cert_file:
            ssl = dict(ssl_certfile=cfg.tls_cert_file, ssl_keyfile=cfg.tls_key_file)
            if cfg.tls_ca_file:
                import ssl as ssl_module

                ssl.update(ssl_ca_certs=cfg.tls_ca_file, ssl_cert_reqs=ssl_module.CERT_REQUIRED)
        config = uvicorn.Config(self._app(), log_level="warning", lifespan="off", access_log=False, **ssl)
        self._server = uvicorn.Server(config)
        self._task = None

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> OpenAIServer:
        """Serve on the gRPC server's loop (a task of it); returns once the socket accepts."""
        loop = self.service.server.loop

        async def begin():
            self._task = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
            while not self._server.started and not self._task.done():
                await asyncio.sleep(0.01)
            if self._task.done():
                self._task.result()  # raises what stopped it

        asyncio.run_coroutine_threadsafe(begin(), loop).result(30)
        return self

    def stop(self) -> None:
        """Stop accepting; open requests are cancelled (their generations aborted) after a second."""
        loop = self.service.server.loop
        if self._task is None or not loop.is_running():
            return

        async def end():
            self._server.should_exit = True
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._task), 2.0)
            if not self._task.done():
                self._server.force_exit = True
                self._task.cancel()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(end(), loop).result(10)
        self._sock.close()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ---- the app ---------------------------------------------------------------------------------
    def _app(self) -> FastAPI:
        app = FastAPI(title="disagg-serve decode", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def api_error(request, e: ApiError):
            return JSONResponse(e.body(), status_code=e.status)

        @app.get("/health")
        async def health():
            healthy, message = self.service.health.report()
            return JSONResponse({"healthy": healthy, "message": message}, status_code=200 if healthy else 503)

        @app.get("/v1/models")
        async def models(request: Request):
            self._authorize(request)
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{name}")
        async def model(name: str, request: Request):
            self._authorize(request)
            if name != self.model:
                raise ApiError(404, f"model {name!r} is not served here (serving {self.model!r})", "model",
                               "model_not_found")  # fmt: skip
            return self._model_card()

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._serve(request, ChatRequest)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._serve(request, CompletionRequest)

        return app

    def _model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": int(self.service.started_at),
                "owned_by": "disagg-serve", "max_model_len": self.service.runner.context_length}  # fmt: skip

    def _authorize(self, request: Request) -> None:
        if self._key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, self._key):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)", None, "invalid_api_key")

    async def _read(self, request: Request, kind):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            raise ApiError(413, f"request body of {declared} bytes exceeds {self.limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.limit:
                raise ApiError(413, f"request body exceeds {self.limit} bytes")
            chunks.append(chunk)
        try:
            return kind.model_validate_json(b"".join(chunks))
        except ValidationError as e:
            raise _invalid(e) from None

    # ---- one request -----------------------------------------------------------------------------
    def _prompts(self, req) -> tuple[list[tuple[list[int], str | None]], tuple | None, str | None]:
        """(prompt ids and text per prompt, the chat's tool handling, its grammar)."""
        if isinstance(req, ChatRequest):
            mode, grammar = chat.tool_mode(req, self.tool_call_parser)
            ids = chat.render(self.tokenizer, req, with_tools=mode != "none")
            named = req.tool_choice["function"]["name"] if mode == "named" else None
            return [(ids, None)], (mode, self.tool_call_parser, named), grammar
        if req.suffix is not None:
            raise ApiError(400, "suffix needs a fill-in-the-middle template, which this model has not", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(400, "best_of is not supported (only best_of = n)", "best_of")
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise ApiError(400, "prompt is empty", "prompt")
        out = []
        for x in prompts:
            ids = self.tokenizer.encode(x) if isinstance(x, str) else list(x)
            out.append((ids, x if isinstance(x, str) else None))
        return out, None, None

    async def _serve(self, request: Request, kind):
        self._authorize(request)
        req = await self._read(request, kind)
        if req.model != self.model:
            raise ApiError(404, f"model {req.model!r} is not served here (serving {self.model!r})", "model",
                           "model_not_found")  # fmt: skip
        prompts, tools, grammar = self._prompts(req)
        rid = f"{'chatcmpl' if isinstance(req, ChatRequest) else 'cmpl'}-{uuid.uuid4().hex}"
        if isinstance(req, ChatRequest):
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            logprobs, top = req.logprobs, (req.top_logprobs or 0) if req.logprobs else 0
            prompt_logprobs = False
        else:
            max_tokens, logprobs, top = req.max_tokens, req.logprobs is not None, req.logprobs or 0
            prompt_logprobs = req.echo and req.logprobs is not None and not req.stream
        engine = [engine_request.build(req, f"{rid}-{i}", ids, max_tokens, logprobs, top, prompt_logprobs, grammar)
                  for i, (ids, _) in enumerate(prompts)]  # fmt: skip
        answer = Answer(rid, self.model, self.tokenizer, req, prompts, tools)
        metadata = list(request.headers.items())
        if req.stream:
            events = self._events(answer, engine, metadata, req)
            try:  # refusals before the first byte are plain HTTP errors
                first = await self._until_disconnected(request, events.__anext__())
            except BaseException:
                await events.aclose()
                raise
            if first is None:
                await events.aclose()
                return JSONResponse({})
            return StreamingResponse(_prepend(first, events), media_type="text/event-stream")
        return JSONResponse(await self._until_disconnected(request, self._collect(answer, engine, metadata, req)))

    async def _responses(self, engine, metadata, seed):
        """(prompt index, response) of every prompt's generation, as they come."""
        if len(engine) == 1:
            async with contextlib.aclosing(self.service.generate(engine[0], metadata, seed)) as gen:
                async for r in gen:
                    yield 0, r
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def run(p, msg):
            try:
                async with contextlib.aclosing(self.service.generate(msg, metadata, seed)) as gen:
                    async for r in gen:
                        queue.put_nowait((p, r, None))
                queue.put_nowait((p, None, None))
            except Exception as e:
                queue.put_nowait((p, None, e))

        tasks = [asyncio.ensure_future(run(p, msg)) for p, msg in enumerate(engine)]
        try:
            left = len(tasks)
            while left:
                p, r, error = await queue.get()
                if error is not None:
                    raise error
                if r is None:
                    left -= 1
                    continue
                yield p, r
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(self, answer: Answer, engine, metadata, req) -> dict:
        try:
            async with contextlib.aclosing(self._responses(engine, metadata, req.seed)) as responses:
                async for p, r in responses:
                    answer.feed(p, r)
        except Rejected as e:
            raise ApiError(STATUS.get(e.code, 500), e.detail) from None
        return answer.body()

    async def _events(self, answer: Answer, engine, metadata, req):
        """The SSE lines of a streamed answer; the first comes only once the engine took the request."""
        responses = self._responses(engine, metadata, req.seed)
        try:
            first = await responses.__anext__()
        except Rejected as e:
            await responses.aclose()
            raise ApiError(STATUS.get(e.code, 500), e.detail) from None
        except StopAsyncIteration:
            first = None
        yield "".join(_sse(c) for c in answer.first_chunks())
        async with contextlib.aclosing(responses):
            try:
                if first is not None:
                    for c in answer.feed(*first):
                        yield _sse(c)
                    async for p, r in responses:
                        for c in answer.feed(p, r):
                            yield _sse(c)
            except Rejected as e:
                yield _sse(ApiError(STATUS.get(e.code, 500), e.detail).body())
        usage = answer.usage_chunk()
        if usage is not None:
            yield _sse(usage)
        yield "data: [DONE]\n\n"

    async def _until_disconnected(self, request: Request, work):
        """`work`'s result, or its cancellation (the generation aborted) once the client goes away."""
        task = asyncio.ensure_future(work)
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
        return task.result()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _prepend(first, rest):
    yield first
    async with contextlib.aclosing(rest):
        async for x in rest:
            yield x
