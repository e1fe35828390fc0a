"""The HTTP side of ``ggpipe serve``: an OpenAI-compatible FastAPI app.

Runs in uvicorn's thread on the head rank. It validates every request
(pydantic models, strict types; anything wrong is a 4xx with an OpenAI-style
``{"error": {"message", "type", "param", "code"}}`` body), tokenizes it,
checks that it fits the context and puts a :class:`Job` on the queue that the
head's main thread works through one request at a time (see
ggpipe.frontends.serve). Text comes back through the job's asyncio queue and
is sent as one JSON response or as server-sent events in OpenAI's chunk
format, ending with ``data: [DONE]``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from ggpipe.frontends.http_guard import Access, host_allowed, is_json_content_type, origin_allowed
from ggpipe.frontends.request_limits import ROLES, STOP_MAX, TEMPERATURE_MAX, template_role
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from ggpipe.sampling import SamplingParams

SCHEDULING = "one request at a time through the pipeline; further requests wait in a FIFO queue"


def scheduling(parallel: int, n_ctx_slot: int) -> str:
    """How the server schedules requests, for ``/v1/models``'s ``meta``."""
    if parallel <= 1:
        return SCHEDULING
    return (f"continuous batching: up to {parallel} requests at once, each in a slot of {n_ctx_slot} KV cells; "
            "further requests wait in a FIFO queue")


# -- errors ------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        if self.code == "queue_full":
            headers = {"Retry-After": "1"}   # a slot frees as soon as any request ends
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# -- request bodies ------------------------------------------------------------------------

PosInt = Annotated[StrictInt, Field(ge=1)]


class _Body(BaseModel):
    # strict: "0.5" is not a temperature; unknown OpenAI fields are ignored
    model_config = ConfigDict(strict=True, extra="ignore")

    model: StrictStr | None = None
    max_tokens: PosInt | None = None
    temperature: Annotated[float, Field(ge=0, le=TEMPERATURE_MAX, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None
    stop: StrictStr | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=STOP_MAX)] | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    logprobs: Any = None
    echo: StrictBool = False

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            if not self.stop:
                raise APIError(400, "stop must be a non-empty string or a list of them", param="stop")
            return [self.stop]
        return list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: StrictStr | list[TextPart]

    def as_template_message(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": template_role(self.role), "content": text}


class ChatBody(_Body):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PosInt | None = None


class CompletionBody(_Body):
    # text, a list of one text, or token ids
    prompt: StrictStr | list[StrictStr] | list[Annotated[StrictInt, Field(ge=0)]]


# -- shared state ----------------------------------------------------------------------------


class ServeMetrics:
    """Prometheus metrics of one server (its own registry)."""

    def __init__(self, queue_depth: Callable[[], float], running: Callable[[], float], n_slots: int = 1,
                 tokens_per_s: Callable[[], float] | None = None):
        disable_created_metrics()  # no *_created series: they only add noise here
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ggpipe_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ggpipe_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.reused_tokens = Counter("ggpipe_prompt_tokens_reused", "Prompt tokens whose KV cells were reused",
                                     registry=r)
        self.gen_tokens = Counter("ggpipe_generated_tokens", "Generated tokens", registry=r)
        self.gen_seconds = Counter("ggpipe_generation_seconds", "Seconds spent generating (after the prompt)",
                                   registry=r)
        self.tokens_per_s = Gauge("ggpipe_tokens_per_second", "Generation speed of the last finished request",
                                  registry=r)
        self.ttft = Histogram("ggpipe_time_to_first_token_seconds",
                              "From the start of a request's generation to its first token (queue wait excluded)",
                              buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.queue_wait = Histogram("ggpipe_queue_wait_seconds", "Time a request waited in the queue",
                                    buckets=(.01, .1, .5, 1, 5, 10, 30, 60, 300), registry=r)
        self.duration = Histogram("ggpipe_request_duration_seconds", "Generation time of a request (queue excluded)",
                                  buckets=(.1, .5, 1, 2.5, 5, 10, 30, 60, 300), registry=r)
        itl = (.005, .01, .02, .03, .05, .075, .1, .15, .25, .5, 1)
        self.itl_p50 = Histogram("ggpipe_inter_token_latency_p50_seconds",
                                 "Median gap between a finished request's accepted tokens", buckets=itl, registry=r)
        self.itl_p90 = Histogram("ggpipe_inter_token_latency_p90_seconds",
                                 "90th percentile gap between a finished request's accepted tokens", buckets=itl,
                                 registry=r)
        self.drafted = Counter("ggpipe_draft_tokens", "Draft tokens proposed (speculative modes)", registry=r)
        self.accepted = Counter("ggpipe_draft_tokens_accepted", "Draft tokens accepted (speculative modes)",
                                registry=r)
        self.acceptance = Gauge("ggpipe_acceptance_rate", "Accepted / drafted tokens since start (speculative modes; "
                                "NaN before any draft)", registry=r)
        self.acceptance.set(float("nan"))
        g = Gauge("ggpipe_queue_depth", "Requests waiting in the queue (not counting the running one)", registry=r)
        g.set_function(queue_depth)
        g = Gauge("ggpipe_requests_running", "Requests being generated now (= slots busy)", registry=r)
        g.set_function(running)
        g = Gauge("ggpipe_slots_busy", "Slots holding a request (--parallel)", registry=r)
        g.set_function(running)
        Gauge("ggpipe_slots", "Slots: requests that can run at once (--parallel)", registry=r).set(n_slots)
        g = Gauge("ggpipe_aggregate_tokens_per_second", "Tokens generated per second over the last 10 s, all "
                  "requests together", registry=r)
        if tokens_per_s is not None:
            g.set_function(tokens_per_s)
        self._drafted = self._accepted = 0.0

    def finished(self, done, queue_wait_s: float) -> None:
        """Record a finished request (``done``: a Completion)."""
        m = done.metrics
        self.prompt_tokens.inc(done.n_prompt)
        self.reused_tokens.inc(done.n_reused)
        self.gen_tokens.inc(len(done.tokens))
        self.queue_wait.observe(queue_wait_s)
        if m.get("gen_s"):
            self.gen_seconds.inc(m["gen_s"])
        if m.get("tokens_per_s"):
            self.tokens_per_s.set(m["tokens_per_s"])
        if m.get("ttft_wall_s") is not None:
            self.ttft.observe(m["ttft_wall_s"])
        if m.get("total_s") is not None:
            self.duration.observe(m["total_s"])
        if m.get("itl_p50_s") is not None:
            self.itl_p50.observe(m["itl_p50_s"])
            self.itl_p90.observe(m["itl_p90_s"])
        d = done.decoder
        if d.get("drafted"):
            self.drafted.inc(d["drafted"])
            self.accepted.inc(d.get("draft_accepted") or 0)
            self._drafted += d["drafted"]
            self._accepted += d.get("draft_accepted") or 0
            self.acceptance.set(self._accepted / self._drafted)


@dataclass
class Job:
    """One request on its way through the queue. The main thread reports
    through :meth:`push`: ("text", str), ("done", Completion) or ("error",
    APIError); ``cancelled`` is set when the client went away."""

    tokens: np.ndarray
    n_predict: int
    sampling: SamplingParams
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    t_queued: float = field(default_factory=time.monotonic)
    finished: bool = False

    def push(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody listens any more
            self.cancelled.set()


@dataclass
class ServerState:
    """What the app needs from the head: model facts, defaults, the queue.

    Attributes:
        tokenize: (prompt | None, messages | None) -> token ids; thread-safe.
        model_id: the name clients see (``/v1/models``, ``model`` fields).
        n_ctx, n_vocab: the context size and vocabulary size (tokens).
        n_predict: default max_tokens; sampling: default sampling settings.
        api_key: required bearer token, or None.
        access: Host / Origin allow-lists and the body size limit (http_guard).
        max_queue: most requests waiting; more get 503.
        info: extra ``/v1/models`` metadata (mode, ranks, ...).
        parallel: slots (``--parallel``); n_ctx is then one slot's cells.
        slots: -> the ``/slots`` view (one dict per slot), or None.
        tokens_per_s: -> tokens generated per second lately, all requests together.
    """

    tokenize: Callable[[str | None, list | None], np.ndarray]
    model_id: str
    n_ctx: int
    n_vocab: int
    n_predict: int
    sampling: SamplingParams
    api_key: str | None = None
    access: Access = field(default_factory=Access)
    max_queue: int = 64
    info: dict = field(default_factory=dict)
    jobs: queue.Queue = field(default_factory=queue.Queue)
    stopping: threading.Event = field(default_factory=threading.Event)
    failed: str | None = None  # why the pipeline is gone (a rank died): /health says so
    running: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServeMetrics | None = None
    parallel: int = 1
    slots: Callable[[], list[dict]] | None = None
    tokens_per_s: Callable[[], float] | None = None

    def __post_init__(self):
        self.metrics = ServeMetrics(lambda: self.jobs.qsize(), lambda: self.running, self.parallel, self.tokens_per_s)


# -- the app -----------------------------------------------------------------------------------

FINISH = {"stop": "stop", "length": "length", "interrupted": "length"}
_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/slots"}


def _error_message(exc: ValidationError) -> tuple[str, str | None]:
    """One line about the first problem pydantic found, and the field it names."""
    errs = exc.errors(include_url=False)
    if not errs:
        return "invalid request body", None
    # With a union (stop: str | list[str]), pydantic reports every branch; the
    # branch whose type matched says what is wrong ("at most 16 items", ">= 0"),
    # not "Input should be a valid string": prefer constraint errors, then the
    # deepest location (the branch that got furthest into the value).
    constraint = [x for x in errs if not str(x.get("type", "")).endswith("_type")]
    e = constraint[0] if constraint else max(errs, key=lambda x: len(x.get("loc", ())))
    # drop pydantic's union-branch names ("str", "list[...]", "constrained-str") from the location
    loc = [str(x) for x in e.get("loc", ()) if not (isinstance(x, str) and (x in ("str", "int", "float", "bool")
                                                                               or "[" in x or "-" in x))]
    where = ".".join(loc)
    if e.get("type") == "missing":
        return f"missing required field {where!r}", where or None
    return (f"{where}: {e.get('msg')}" if where else str(e.get("msg"))), where or None


async def parse_body(request: Request, model: type[BaseModel]):
    """The request's JSON body validated as ``model`` (any content type).

    Raises:
        APIError: 400 for a body that is not JSON, not an object, or not valid.
    """
    raw = bytearray()
    async for chunk in request.stream():  # bounded, also when no Content-Length was sent (chunked)
        raw += chunk
        if len(raw) > state_of(request).access.max_body_bytes:
            raise _too_large(state_of(request))
    try:
        obj = json.loads(bytes(raw))
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        msg, param = _error_message(e)
        raise APIError(400, msg, param=param) from None


def _refuse(request: Request, state: ServerState) -> APIError | None:
    """The Host / Origin / Content-Type / size checks (ggpipe.frontends.http_guard)."""
    if not host_allowed(request.headers.get("host"), state.access.allowed_hosts):
        return APIError(403, f"Host {request.headers.get('host')!r} is not allowed (a DNS-rebinding guard): "
                        f"connect by IP address or localhost, or start ggpipe serve with --allowed-hosts NAME",
                        code="host_not_allowed")
    if not origin_allowed(request.headers.get("origin"), state.access.allowed_origins):
        return APIError(403, f"cross-origin requests from {request.headers.get('origin')!r} are refused: start "
                        f"ggpipe serve with --allowed-origins ORIGIN to allow a web page", code="origin_not_allowed")
    if request.method == "POST":
        if not is_json_content_type(request.headers.get("content-type")):
            return APIError(415, "the request body must be sent as Content-Type: application/json",
                            code="unsupported_media_type")
        length = request.headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > state.access.max_body_bytes:
            return _too_large(state)
    return None


def _too_large(state: ServerState) -> APIError:
    return APIError(413, f"the request body is larger than {state.access.max_body_bytes} bytes (--max-body-bytes)",
                    code="request_too_large")


def state_of(request: Request) -> ServerState:
    """The ServerState of the app serving ``request``."""
    return request.app.state.ggpipe


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving ``state`` (see the module docstring)."""
    app = FastAPI(title="ggpipe", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ggpipe = state
    # outermost: answers browsers' preflight requests, for the configured origins only
    app.add_middleware(CORSMiddleware, allow_origins=list(state.access.allowed_origins), allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):  # noqa: ARG001
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        msg = {404: f"unknown endpoint {request.url.path}", 405: f"method {request.method} not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
        return APIError(exc.status_code, msg, code=None).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):  # noqa: ARG001
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()

    @app.middleware("http")
    async def _count(request: Request, call_next):
        path = request.url.path
        refused = _refuse(request, state)
        if refused is not None:
            response = refused.response()
        elif state.api_key and path != "/health" and not _authorized(request, state.api_key):
            response = APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                                code="invalid_api_key").response()
        else:
            response = await call_next(request)
        state.metrics.requests.labels(path if path in _ENDPOINTS else "other", str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        if state.failed:
            return JSONResponse({"status": "failed", "error": state.failed}, status_code=503)
        if state.stopping.is_set():
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return {"status": "ok", "queue_depth": state.jobs.qsize(), "running": state.running}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/slots")
    async def slots():
        """llama-server's view of the slots: what each one holds now."""
        if state.slots is None:
            return [{"id": 0, "n_ctx": state.n_ctx, "is_processing": bool(state.running)}]
        return state.slots()

    @app.get("/v1/models")
    async def models():
        meta = dict(state.info, n_ctx=state.n_ctx, scheduling=scheduling(state.parallel, state.n_ctx),
                    parallel=state.parallel, queue_depth=state.jobs.qsize(), max_queue=state.max_queue)
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.created,
                                            "owned_by": "ggpipe", "meta": meta}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatBody)
        messages = [m.as_template_message() for m in body.messages]
        n = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        tokens = await _tokenize(state, None, messages)
        job = _enqueue(state, body, tokens, n)
        if body.stream:
            return _stream(state, job, request, "chat", body.include_usage())
        return await _complete(state, job, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionBody)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        p = body.prompt
        if isinstance(p, list) and len(p) != 1 and (not p or isinstance(p[0], str)):
            raise APIError(400, "prompt: give one prompt (a string); for several prompts send one request each",
                           param="prompt")
        if p == "" or p == [""]:
            raise APIError(400, "the prompt is empty", param="prompt")
        if isinstance(p, list) and isinstance(p[0], int):
            bad = next((t for t in p if t >= state.n_vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt token {bad} is outside the vocabulary (0..{state.n_vocab - 1})",
                               param="prompt")
            tokens = np.asarray(p, dtype=np.int32)
        else:
            tokens = await _tokenize(state, p if isinstance(p, str) else p[0], None)
        job = _enqueue(state, body, tokens, body.max_tokens)
        if body.stream:
            return _stream(state, job, request, "text", body.include_usage())
        return await _complete(state, job, request, "text")

    return app


def _authorized(request: Request, key: str) -> bool:
    got = request.headers.get("authorization", "")
    scheme, _, token = got.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


async def _tokenize(state: ServerState, prompt: str | None, messages: list | None) -> np.ndarray:
    try:
        return await run_in_threadpool(state.tokenize, prompt, messages)
    except Exception as e:  # noqa: BLE001 (a template that refuses these messages, no template, ...)
        raise APIError(400, f"cannot render the prompt: {' '.join(str(e).split()) or type(e).__name__}",
                       param="messages" if messages is not None else "prompt") from None


def _enqueue(state: ServerState, body: _Body, tokens: np.ndarray, max_tokens: int | None) -> Job:
    if body.logprobs not in (None, False, 0):
        raise APIError(400, "logprobs are not supported", param="logprobs")
    n_prompt = int(tokens.shape[0])
    if n_prompt == 0:
        raise APIError(400, "the prompt is empty", param="prompt")
    room = state.n_ctx - n_prompt
    if max_tokens is None:
        if room < 1:
            raise APIError(400, f"the prompt has {n_prompt} tokens but the context holds {state.n_ctx}",
                           param="messages", code="context_length_exceeded")
        max_tokens = min(state.n_predict, room)
    elif n_prompt + max_tokens > state.n_ctx:
        raise APIError(400, f"this model's context holds {state.n_ctx} tokens, but {n_prompt} prompt tokens + "
                       f"max_tokens {max_tokens} = {n_prompt + max_tokens}: lower max_tokens or shorten the prompt",
                       param="max_tokens", code="context_length_exceeded")
    d = state.sampling
    sampling = SamplingParams(temperature=d.temperature if body.temperature is None else body.temperature,
                              top_k=d.top_k if body.top_k is None else body.top_k,
                              top_p=d.top_p if body.top_p is None else body.top_p,
                              seed=d.seed if body.seed is None else body.seed)
    if state.stopping.is_set():
        raise APIError(503, "the server is shutting down", "server_error")
    if state.jobs.qsize() >= state.max_queue:
        raise APIError(503, f"the queue is full ({state.max_queue} requests waiting); retry later", "server_error",
                       code="queue_full")
    loop = asyncio.get_running_loop()
    job = Job(tokens, max_tokens, sampling, body.stops(), loop, asyncio.Queue())
    state.jobs.put(job)
    return job


def _usage(done) -> dict:
    return {"prompt_tokens": done.n_prompt, "completion_tokens": len(done.tokens),
            "total_tokens": done.n_prompt + len(done.tokens)}


async def _next(job: Job, request: Request | None):
    """The job's next event; cancels the job when the client disconnects."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=1.0)
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                job.cancelled.set()
                raise asyncio.CancelledError from None


async def _complete(state: ServerState, job: Job, request: Request, kind: str) -> JSONResponse:
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    while True:
        ev, value = await _next(job, request)
        if ev == "error":
            raise value
        if ev == "done":
            break
    done = value
    base = {"id": rid, "created": int(time.time()), "model": state.model_id, "usage": _usage(done),
            "ggpipe": {"tokens": done.tokens, "n_reused": done.n_reused, "metrics": done.metrics,
                       "decoder": done.decoder}}
    reason = FINISH[done.finish_reason]
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": done.text}, "logprobs": None,
                  "finish_reason": reason}
        return JSONResponse({"object": "chat.completion", "choices": [choice], **base})
    choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": reason}
    return JSONResponse({"object": "text_completion", "choices": [choice], **base})


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def _stream(state: ServerState, job: Job, request: Request, kind: str, include_usage: bool) -> StreamingResponse:
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(text: str | None, reason: str | None, first: bool = False) -> dict:
        if kind == "chat":
            delta = {} if text is None else ({"role": "assistant", "content": text} if first else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return {"id": rid, "object": obj, "created": created, "model": state.model_id, "choices": [choice]}

    async def events():
        try:
            if kind == "chat":
                yield _sse(chunk("", None, first=True))
            while True:
                ev, value = await _next(job, request)
                if ev == "text":
                    yield _sse(chunk(value, None))
                elif ev == "error":
                    yield _sse(value.body())
                    break
                else:
                    yield _sse(chunk(None, FINISH[value.finish_reason]))
                    if include_usage:
                        yield _sse({"id": rid, "object": obj, "created": created, "model": state.model_id,
                                    "choices": [], "usage": _usage(value)})
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not job.finished:
                job.cancelled.set()  # the client went away: stop generating for it

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
