"""The HTTP side of `tunesmith serve`: OpenAI's /v1/models, /v1/chat/completions and /v1/completions on FastAPI.

Request and response bodies are pydantic models shaped as OpenAI's. Every mistake a client can make is a 4xx with
OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, checked before the request queues, so the
worker only ever sees requests it can answer. Imported only once fastapi is known to be installed (tunesmith[serve]).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from tunesmith.errors import TunesmithError
from tunesmith.generate import GenerationResponse, encode_messages, encode_prompt
from tunesmith.serve.engine import Engine, Job, QueueFull, Served

MAX_STOP = 4  # as OpenAI: up to four stop sequences


# ----------------------------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """What both endpoints take. Fields OpenAI has and this server does not use (presence_penalty, user, ...) are
    accepted and ignored, as front-ends send them by default."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(None, ge=1, le=1, description="one choice per request")
    stream: bool | None = False
    stream_options: StreamOptions | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    # the roles a chat template renders; any other (a typo, a tool turn tunesmith cannot answer) is a 400 naming them
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]


# ---------------------------------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tunesmith"
    root: str  # the model loaded (for an adapter, its folder)
    parent: str | None = None  # for an adapter, the served name of its base


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ApiError(Exception):
    """A request this server will not answer, as OpenAI words it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status,
                            headers=self.headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ------------------------------------------------------------------------------------------------------ the app


def build_app(served: Served, engine: Engine, api_key: str = "", default_max_tokens: int = 512) -> FastAPI:
    """The FastAPI app; the engine's worker starts and stops with it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.close()

    # Requests are encoded on the event loop's thread while the worker decodes on its own; a fast tokenizer used by
    # two threads at once can fail with "Already borrowed" (it borrows itself mutably to set truncation and
    # padding), so each side has its own copy.
    tokenizer = copy.deepcopy(served.tokenizer)
    app = FastAPI(title="tunesmith", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if api_key:
        app.add_middleware(BearerAuth, key=api_key)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return ApiError(400, *_validation_message(e.errors())).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {e.detail}", code=code),
                            e.status_code, headers=e.headers)

    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = [ModelCard(id=served.base_name, created=created, root=served.root)]
        cards += [ModelCard(id=name, created=created, root=path, parent=served.base_name)
                  for name, path in served.adapters.items()]
        return ModelList(data=cards)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        adapter = _adapter(served, body.model)
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, f"{body.model} has no chat template; use /v1/completions", "messages")
        try:
            ids = encode_messages(tokenizer, [_message(m) for m in body.messages])
        except TunesmithError as e:
            raise ApiError(400, str(e), "messages") from None
        job = _job(served, body, adapter, ids, body.max_completion_tokens or body.max_tokens, default_max_tokens)
        meta = dict(id=f"chatcmpl-{uuid.uuid4().hex[:24]}", created=int(time.time()), model=body.model)
        events = _submit(engine, job)
        if body.stream:
            return _sse(_chat_chunks(job, events, meta, _include_usage(body)))
        text, last = await _collect(job, events, request)
        return ChatCompletion(**meta, choices=[ChatChoice(message=ChatMessageOut(content=text),
                                                          finish_reason=last.finish_reason)], usage=_usage(last))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        adapter = _adapter(served, body.model)
        ids = _prompt_ids(tokenizer, body.prompt)
        job = _job(served, body, adapter, ids, body.max_tokens, default_max_tokens)
        meta = dict(id=f"cmpl-{uuid.uuid4().hex[:24]}", created=int(time.time()), model=body.model)
        events = _submit(engine, job)
        if body.stream:
            return _sse(_completion_chunks(job, events, meta, _include_usage(body)))
        text, last = await _collect(job, events, request)
        return Completion(**meta, choices=[CompletionChoice(text=text, finish_reason=last.finish_reason)],
                          usage=_usage(last))

    return app


class BearerAuth:
    """--api-key: every request needs `Authorization: Bearer KEY`, checked before its body is read."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                what = "No API key provided" if not given else "Incorrect API key provided"
                response = JSONResponse(error_body(f"{what}: send it as the header Authorization: Bearer KEY",
                                                   code="invalid_api_key"), 401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ------------------------------------------------------------------------------------------ checking a request


def _validation_message(errors: list[dict]) -> tuple[str, str | None, str | None]:
    """(message, param, code) for the first thing wrong in a body, as OpenAI words them."""
    e = errors[0]
    if e.get("type") == "json_invalid":
        return ("We could not parse the JSON body of your request: it is not valid JSON "
                f"({e.get('ctx', {}).get('error', e.get('msg'))})"), None, None
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    # a union reports each branch it tried (str, list[str]...): the field is what the client named
    names = [p for p in loc if not p.isdigit() and p not in ("str", "list[str]", "list[int]", "list[ContentPart]")]
    param = ".".join(names) or None
    if e.get("type") == "missing":
        return f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
    if not param:
        return f"The request body is not what this endpoint takes: {e.get('msg')}", None, None
    return f"Invalid value for '{param}': {e.get('msg')} (got {e.get('input')!r}).", param, "invalid_value"


def _adapter(served: Served, name: str) -> str | None:
    """The PEFT adapter a request's model field names (None: the base)."""
    if name == served.base_name:
        return None
    if name in served.adapters:
        return name
    known = ", ".join([served.base_name, *served.adapters])
    raise ApiError(404, f"The model '{name}' does not exist on this server; it serves: {known}", "model",
                   "model_not_found")


def _message(m: Message) -> dict:
    if isinstance(m.content, list):
        if any(p.type != "text" for p in m.content):
            raise ApiError(400, "only text content parts are supported", "messages")
        content = "".join(p.text or "" for p in m.content)
    else:
        content = m.content or ""
    return {"role": "system" if m.role == "developer" else m.role, "content": content}


def _prompt_ids(tokenizer, prompt: str | list[str] | list[int]) -> list[int]:
    """A completion's prompt as `tunesmith generate` encodes it (text), or the token ids given."""
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt) and prompt:
        if not all(0 <= p < len(tokenizer) for p in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {len(tokenizer)})", "prompt")
        return list(prompt)
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, "one prompt per request, please: this server answers a single prompt", "prompt")
        prompt = prompt[0]
    return encode_prompt(tokenizer, prompt)


def _job(served: Served, body: _Request, adapter: str | None, ids: list[int], asked: int | None,
         default_max_tokens: int) -> Job:
    """The request as the worker's Job: its lengths checked against the context, its defaults as OpenAI's."""
    if not ids:
        raise ApiError(400, "the prompt is empty", "messages" if isinstance(body, ChatRequest) else "prompt")
    room = served.context_length - len(ids)
    if room < 1 or (asked is not None and asked > room):
        raise ApiError(400, f"This model's maximum context length is {served.context_length} tokens. However, you "
                       f"requested {len(ids) + (asked or 1)} tokens ({len(ids)} in the prompt, {asked or 1} for the "
                       "completion). Please reduce the length of the prompt or of max_tokens.",
                       "messages" if isinstance(body, ChatRequest) else "prompt", "context_length_exceeded")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"at most {MAX_STOP} stop sequences, got {len(stop)}", "stop")
    return Job(
        adapter=adapter, prompt_ids=ids, max_tokens=asked or min(default_max_tokens, room),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=secrets.randbits(32) if body.seed is None else body.seed % 2**32,
        stop=stop, emit=lambda _: None,
    )


def _include_usage(body: _Request) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _usage(r: GenerationResponse) -> Usage:
    return Usage(prompt_tokens=r.prompt_tokens, completion_tokens=r.generated_tokens,
                 total_tokens=r.prompt_tokens + r.generated_tokens)


# ------------------------------------------------------------------------------------------------ answering it


RETRY_AFTER_S = 1  # a refused request's Retry-After: a slot frees as soon as any answer ends


def _submit(engine: Engine, job: Job) -> asyncio.Queue:
    """Queue the job (before any answer starts, so a full queue is still a status: 429 with Retry-After); its
    tokens arrive on the returned queue, from the worker's thread."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emit(item):
        with contextlib.suppress(RuntimeError):  # the loop closed (server stopping): nobody is listening
            loop.call_soon_threadsafe(events.put_nowait, item)

    job.emit = emit
    try:
        engine.submit(job)
    except QueueFull as e:
        raise ApiError(429, f"The server is busy: {e}. Retry after {RETRY_AFTER_S} s.", type="server_error",
                       code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    return events


async def _events(job: Job, events: asyncio.Queue, request: Request | None) -> AsyncIterator[GenerationResponse]:
    """Yield the job's tokens as the worker makes them. However this ends (the answer is done, the client went
    away, the server stops), the job is cancelled, so the worker drops it before its next step.

    A stream is cancelled by Starlette when its client disconnects; a plain request has no such watcher, so it
    asks (`request`) whenever no token has come for a while (queued behind others, say)."""
    try:
        while True:
            try:
                item = await asyncio.wait_for(events.get(), timeout=0.25)
            except TimeoutError:
                if request is not None and await request.is_disconnected():
                    return
                continue
            if item is None:
                return
            if isinstance(item, BaseException):
                raise ApiError(500, f"generation failed: {item}", type="server_error")
            yield item
    finally:
        job.cancelled.set()


async def _collect(job: Job, events: asyncio.Queue, request: Request) -> tuple[str, GenerationResponse]:
    parts, last = [], None
    async for r in _events(job, events, request):
        parts.append(r.text)
        last = r
    if last is None:  # the client left before its first token
        raise ApiError(499, "the client closed the request")
    return "".join(parts), last


def _sse(chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
    async def lines():
        try:
            async for chunk in chunks:
                yield f"data: {chunk.model_dump_json()}\n\n"
        except ApiError as e:  # the answer had begun: the error goes in the stream, as OpenAI sends it
            yield f"data: {json.dumps(error_body(e.message, e.type, e.param, e.code))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _chat_chunks(job: Job, events: asyncio.Queue, meta: dict, include_usage: bool):
    yield ChatCompletionChunk(**meta, choices=[ChatChunkChoice(delta={"role": "assistant", "content": ""})])
    last = None
    async for r in _events(job, events, None):
        last = r
        if r.text:
            yield ChatCompletionChunk(**meta, choices=[ChatChunkChoice(delta={"content": r.text})])
    if last is not None:
        yield ChatCompletionChunk(**meta, choices=[ChatChunkChoice(delta={}, finish_reason=last.finish_reason)])
        if include_usage:
            yield ChatCompletionChunk(**meta, choices=[], usage=_usage(last))


async def _completion_chunks(job: Job, events: asyncio.Queue, meta: dict, include_usage: bool):
    last = None
    async for r in _events(job, events, None):
        last = r
        if r.text or r.finish_reason:
            yield Completion(**meta, choices=[CompletionChoice(text=r.text, finish_reason=r.finish_reason)])
    if last is not None and include_usage:
        yield Completion(**meta, choices=[], usage=_usage(last))
