"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over the batch engine.

Concurrency scheme: one engine thread (engine/batch.py) owns the model and runs every
generation, up to `max_batch` sequences decoded together per step, each with its own KV
cache, sampler and seed; further requests wait in a bounded queue, and a full queue answers
429. Tokens travel from the engine thread to the response through an asyncio queue; when a
client disconnects, the response sets the request's cancel flag and the engine drops the
sequence at its next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine.batch import BatchEngine
from .engine.sample import SamplingParams
from .errors import PowerInferError
from .loader import LoadedModel

ALLOWED = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
           "stop", "n", "stream", "stream_options", "user",
           "top_k", "min_p", "repetition_penalty"}  # the last three: sampling extensions, as vLLM has them
# OpenAI parameters served only at their default (the value that changes nothing): clients
# such as LangChain send e.g. presence_penalty=0 on every request, which must not fail.
DEFAULT_ONLY = {"presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": (None, {}),
                "response_format": (None, {"type": "text"}), "logprobs": (None, False), "top_logprobs": (None, 0),
                "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
                "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, True, False)}


def _is_default(value: object, defaults: tuple) -> bool:
    """Whether `value` is one of `defaults`, numbers compared by value but never a bool for
    a number (False == 0 in Python)."""
    for d in defaults:
        if value is None or d is None:
            if value is d:
                return True
        elif isinstance(value, bool) or isinstance(d, bool):
            if value is d:
                return True
        elif value == d and (type(value) is type(d) or {type(value), type(d)} <= {int, float}):
            return True
    return False


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code


def error_body(message: str, type_: str, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    include_usage: bool = False  # streaming: a last chunk with the token counts
    cancel: threading.Event = field(default_factory=threading.Event)


def _number(body: dict, key: str, default: float) -> float:
    """A number parameter (its range is checked by SamplingParams.validate, as for the CLI)."""
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise APIError(400, f"'{key}' must be a number", code="invalid_type")
    return float(v)


def prompt_ids(prompt: object, tok, vocab_size: int) -> list[int]:
    """The completion prompt's token ids. OpenAI's API takes a string or token ids, or a
    list of several prompts (one completion each), of which one is served here."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tok.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"'prompt' token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                           code="invalid_value")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "only one prompt per request is supported", code="unsupported_value")
    raise APIError(400, "'prompt' must be a string or a list of token ids", code="invalid_type")


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_messages(messages: object) -> list[dict[str, str]]:
    """The request's messages as {role, content} strings for the chat template. Content may
    be a string or a list of text parts ({"type": "text", "text": ...}, as newer OpenAI
    clients send); "developer" is the newer name of "system"."""
    shape = ("'messages' must be a non-empty list of {role, content} objects, content a string or a list of "
             "text parts")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, shape, code="invalid_type")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, shape, code="invalid_type")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise APIError(400, f"messages[{i}]: role must be one of {', '.join(ROLES)}, got {role!r}",
                           code="invalid_value")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}]: only text content parts are supported", code="invalid_value")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, shape, code="invalid_type")
        out.append({"role": ROLES[role], "content": content})
    return out


class Server:
    """The engine behind the API: admission (batch + queue) and the batch engine."""

    def __init__(self, lm: LoadedModel, model_name: str, max_batch: int = 8, queue_size: int = 16,
                 api_key: str | None = None, prefill_chunk: int | None = None, engine_thread: bool = True):
        if lm.tokenizer is None:
            raise PowerInferError(f"{lm.path}: the model has no tokenizer; it cannot be served")
        self.lm, self.model_name, self.api_key = lm, model_name, api_key
        self.max_batch, self.queue_size = max_batch, queue_size
        extra = {} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}
        self.engine = BatchEngine(lm.model, lm.tokenizer, max_batch, own_thread=engine_thread, **extra)
        self.lock = threading.Lock()
        self.admitted = 0  # running + waiting

    @property
    def active(self) -> int:
        return self.engine.active

    # -- request parsing ---------------------------------------------------------------------
    def parse(self, body: Any, chat: bool) -> tuple[Request, bool]:
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        unknown = sorted(k for k in body if k not in ALLOWED
                         and not (k in DEFAULT_ONLY and _is_default(body[k], DEFAULT_ONLY[k])))
        if unknown:
            raise APIError(400, f"unsupported parameter(s): {', '.join(unknown)}", code="unsupported_parameter")
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "'model' is required and must be a string", code="invalid_type")
        self.check_model(model)
        n = body.get("n", 1)
        if n != 1:
            raise APIError(400, "only n=1 is supported", code="unsupported_value")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens_given = max_tokens is not None
        if max_tokens is None:  # OpenAI's defaults; cut to what the context leaves
            max_tokens = 256 if chat else 16
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise APIError(400, "'max_tokens' must be an integer", code="invalid_type")
        if max_tokens < 0:
            raise APIError(400, f"'max_tokens' must be >= 0, got {max_tokens}", code="invalid_value")
        temperature = _number(body, "temperature", 1.0)
        top_p = _number(body, "top_p", 1.0)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise APIError(400, "'seed' must be an integer", code="invalid_type")
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
            raise APIError(400, "'stop' must be a string or a list of up to 4 strings", code="invalid_type")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, "'stream' must be a boolean", code="invalid_type")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(
                options.get("include_usage", False), bool):
            raise APIError(400, "'stream_options' may only hold include_usage (a boolean)", code="invalid_type")
        top_k = body.get("top_k", 0)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise APIError(400, "'top_k' must be an integer >= 0", code="invalid_value")
        min_p = _number(body, "min_p", 0.0)
        repetition_penalty = _number(body, "repetition_penalty", 1.0)
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                  repetition_penalty=repetition_penalty, seed=seed)
        try:
            sampling.validate()
        except PowerInferError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        tok = self.lm.tokenizer
        if chat:
            messages = chat_messages(body.get("messages"))
            try:
                ids = tok.encode_chat(messages)
            except PowerInferError as e:
                raise APIError(400, str(e)) from None
        else:
            try:
                ids = prompt_ids(body.get("prompt"), tok, self.lm.args.vocab_size)
            except PowerInferError as e:
                raise APIError(400, str(e)) from None
        limit = self.lm.args.max_seq_len
        if not ids:
            raise APIError(400, "the prompt is empty", code="invalid_value")
        if len(ids) >= limit:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context is {limit} tokens",
                           code="context_length_exceeded")
        if max_tokens_given and len(ids) + max_tokens > limit:  # as OpenAI: refused, not cut short
            raise APIError(400, f"this model's context is {limit} tokens; the request asks for {len(ids) + max_tokens} "
                           f"({len(ids)} in the prompt, {max_tokens} to generate)", code="context_length_exceeded")
        return Request(ids, max_tokens, sampling, stop, include_usage=options.get("include_usage", False)), stream

    def check_model(self, model: str) -> None:
        """404 unless `model` is the one this server has."""
        if model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server has '{self.model_name}'",
                           code="model_not_found")

    # -- admission and generation ------------------------------------------------------------
    def admit(self) -> None:
        with self.lock:
            if self.admitted >= self.max_batch + self.queue_size:
                raise APIError(429, "the server is busy (queue full); retry later", "rate_limit_error",
                               "queue_full")
            self.admitted += 1

    def release(self) -> None:
        with self.lock:
            self.admitted -= 1

    def launch(self, req: Request) -> asyncio.Queue:
        """Hand the request to the engine; its results arrive on the returned queue as (text,
        finish_reason, n_tokens), an Exception, then None."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item) -> None:  # on the engine thread
            if item is None:
                self.release()
            elif not isinstance(item, Exception):
                item = (item.text, item.finish_reason, item.generation_tokens)
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
                pass

        try:
            self.engine.submit(req.prompt_ids, req.max_tokens, req.sampling, req.stop, emit, req.cancel)
        except Exception:
            self.release()
            raise
        return queue

    @staticmethod
    async def drain(queue: asyncio.Queue, req: Request) -> AsyncIterator[tuple[str, str | None, int]]:
        """Results of a launched request; leaving early (a disconnect) cancels its generation."""
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, PowerInferError):  # e.g. the output became NaN: say what happened
                    raise APIError(500, f"generation failed: {item}", "server_error")
                if isinstance(item, Exception):
                    raise APIError(500, f"generation failed: {type(item).__name__}", "server_error")
                yield item
        finally:
            req.cancel.set()


async def cancel_on_disconnect(request: HTTPRequest, req: Request) -> None:
    """Cancel a non-streaming request's generation when its client goes away (a streaming
    one notices when its next chunk cannot be sent); otherwise a client that gave up would
    hold its slot until max_tokens. Waits on the ASGI receive channel, whose next message
    after the body is the disconnect: Request.is_disconnected() never turns true behind an
    HTTP middleware (starlette discussion 2094; vLLM issue 10087)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            req.cancel.set()
            return


class APIKeyCheck:
    """401 for a /v1/ request without `Authorization: Bearer KEY`. A plain ASGI middleware:
    starlette's `@app.middleware("http")` runs the route in another task and relays each
    chunk of a streamed response through a memory stream, a cost paid per token."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if given != self.expected:
                response = JSONResponse(error_body("invalid or missing API key", "authentication_error",
                                                   "invalid_api_key"), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(server: Server):
    """The FastAPI application serving `server`."""
    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        server.engine.close()  # unfinished generations end; the engine thread stops before exit

    app = FastAPI(title="powerinfer", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.type, exc.code), status_code=exc.status)

    @app.exception_handler(Exception)
    async def any_error(_, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error", None), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        return JSONResponse(error_body("invalid request", "invalid_request_error", None), status_code=400)

    if server.api_key:
        app.add_middleware(APIKeyCheck, key=server.api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok", "active": server.active, "admitted": server.admitted}

    def model_card() -> dict:
        return {"id": server.model_name, "object": "model", "created": 0, "owned_by": "powerinfer"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        server.check_model(model_id)
        return model_card()

    async def body_of(request: HTTPRequest) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None

    async def handle(request: HTTPRequest, chat: bool):
        req, stream = server.parse(await body_of(request), chat)
        server.admit()
        queue = server.launch(req)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        usage = lambda n: {"prompt_tokens": len(req.prompt_ids), "completion_tokens": n,
                           "total_tokens": len(req.prompt_ids) + n}

        def event(choices: list[dict], **extra) -> str:
            data = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                    "model": server.model_name, "choices": choices, **extra}
            return f"data: {json.dumps(data)}\n\n"

        def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
                return event([{"index": 0, "delta": delta, "finish_reason": finish}])
            return event([{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}])

        if stream:
            async def sse():
                try:
                    if chat:
                        yield chunk(None, None, first=True)
                    n = 0
                    async for text, finish, n in server.drain(queue, req):
                        if text:
                            yield chunk(text, None)
                        if finish:
                            yield chunk(None, finish)
                    if req.include_usage:  # as OpenAI: no choices, the usage of the whole request
                        yield event([], usage=usage(n))
                except APIError as e:
                    yield f"data: {json.dumps(error_body(e.message, e.type, e.code))}\n\n"
                finally:
                    req.cancel.set()
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        parts, finish, n = [], "length", 0
        watcher = asyncio.create_task(cancel_on_disconnect(request, req))
        try:
            async for text, fin, n in server.drain(queue, req):
                parts.append(text)
                if fin:
                    finish = fin
        finally:
            watcher.cancel()
        text = "".join(parts)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {"id": rid, "object": obj, "created": created, "model": server.model_name, "choices": [choice],
                "usage": usage(n)}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await handle(request, chat=True)

    return app
