"""The HTTP side of ``ggpipe serve``: an OpenAI-compatible FastAPI app.

Runs in uvicorn's thread on the head rank. It validates every request
(pydantic models, strict types; anything wrong is a 4xx with an OpenAI-style
``{"error": {"message", "type", "param", "code"}}`` body), tokenizes it,
checks that it fits the context and puts a :class:`Job` on the queue that the
head's main thread works through one request at a time (see
ggpipe.frontends.serve.server). Text comes back through the job's asyncio queue and
is sent as one JSON response or as server-sent events in OpenAI's chunk
format, ending with ``data: [DONE]``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text),
``GET /slots``.

The request bodies and their checks are in ggpipe.frontends.serve.bodies,
the state shared with the main thread (ServerState, Job) in
ggpipe.frontends.serve.state, the metrics in ggpipe.frontends.serve.metrics,
the answers (a finished request's body, or its server-sent events as the
text comes) in ggpipe.frontends.serve.replies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import uuid

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ggpipe.frontends import request_fields
from ggpipe.frontends.serve.http_guard import host_allowed, is_json_content_type, origin_allowed
from ggpipe.frontends.serve.bodies import (APIError, ChatBody, CompletionBody, _Body, internal_error,
                                           parse_body, pipeline_failed, shutting_down, too_large)
from ggpipe.frontends.serve.replies import complete, stream
from ggpipe.frontends.serve.resume import RESUME, from_front
from ggpipe.frontends.serve.state import Job, ServerState, state_of
from ggpipe.errors import ConfigError
from ggpipe.sampling_params import SamplingParams
from ggpipe.service.text import Resume

SCHEDULING = "one request at a time through the pipeline; further requests wait in a FIFO queue"


def scheduling(parallel: int, n_ctx_slot: int) -> str:
    """How the server schedules requests, for ``/v1/models``'s ``meta``."""
    if parallel <= 1:
        return SCHEDULING
    return (f"continuous batching: up to {parallel} requests at once, each in a slot of {n_ctx_slot} KV cells; "
            "further requests wait in a FIFO queue")


# -- the app -----------------------------------------------------------------------------------

_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/slots"}


#: Most characters of a client's header value an error message repeats.
SHOWN_MAX = 100


def _shown(value: str | None) -> str:
    """``value`` quoted for a message, cut to SHOWN_MAX characters (a
    5,000-character Host header is not echoed back in full)."""
    if value is None or len(value) <= SHOWN_MAX:
        return repr(value)
    return repr(value[:SHOWN_MAX]) + f"... ({len(value)} characters)"


def _refuse(request: Request, state: ServerState) -> APIError | None:
    """The Host / Origin / Content-Type / size checks (ggpipe.frontends.serve.http_guard)."""
    if not host_allowed(request.headers.get("host"), state.access.allowed_hosts):
        return APIError(403, f"Host {_shown(request.headers.get('host'))} is not allowed (a DNS-rebinding guard): "
                        f"connect by IP address or localhost, or start ggpipe serve with --allowed-hosts NAME",
                        code="host_not_allowed")
    if not origin_allowed(request.headers.get("origin"), state.access.allowed_origins):
        return APIError(403, f"cross-origin requests from {_shown(request.headers.get('origin'))} are refused: start "
                        f"ggpipe serve with --allowed-origins ORIGIN to allow a web page", code="origin_not_allowed")
    if request.method == "POST":
        if not is_json_content_type(request.headers.get("content-type")):
            return APIError(415, "the request body must be sent as Content-Type: application/json",
                            code="unsupported_media_type")
        length = request.headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > state.access.max_body_bytes:
            return too_large(state)
    return None


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving ``state`` (see the module docstring)."""
    app = FastAPI(title="ggpipe", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ggpipe = state
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _bug)
    app.middleware("http")(_guard_and_count)
    # added last, so outermost (Starlette wraps later middleware around earlier): it answers browsers'
    # preflight requests (no API key needed: a browser never sends one there) for the configured origins
    # only, and puts its headers on every answer to those origins, a 401 or 403 of the guard included
    app.add_middleware(CORSMiddleware, allow_origins=list(state.access.allowed_origins), allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"])
    app.get("/health")(health)
    app.get("/metrics")(metrics)
    app.get("/slots")(slots)
    app.get("/v1/models")(models)
    app.post("/v1/chat/completions")(chat_completions)
    app.post("/v1/completions")(completions)
    return app


# -- errors, access, counting ------------------------------------------------------------


async def _api_error(request: Request, exc: APIError):  # noqa: ARG001
    return exc.response()


async def _http_error(request: Request, exc: StarletteHTTPException):
    msg = {404: f"unknown endpoint {request.url.path}", 405: f"method {request.method} not allowed on "
           f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
    return APIError(exc.status_code, msg, code=None).response()


async def _bug(request: Request, exc: Exception):  # noqa: ARG001
    """A bug: the client gets a short reason and a request id (also in the
    ``X-Request-Id`` header); the server's log the details under that id."""
    rid = uuid.uuid4().hex[:24]
    response = internal_error(rid, exc).response()
    response.headers["X-Request-Id"] = rid
    return response


async def _guard_and_count(request: Request, call_next):
    state = state_of(request)
    path = request.url.path
    refused = _refuse(request, state)
    if refused is not None:
        response = refused.response()
    elif state.api_key and path != "/health" and not _authorized(request, state.api_key):
        response = APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                            code="invalid_api_key").response()
    else:
        try:
            response = await call_next(request)
        except Exception as e:  # noqa: BLE001 - a bug: answered here (counted, CORS headers), logged once
            response = await _bug(request, e)
    state.metrics.requests.labels(path if path in _ENDPOINTS else "other", str(response.status_code)).inc()
    return response


# -- the endpoints -------------------------------------------------------------------------


async def health(request: Request):
    """``GET /health``: ``{"status": "ok", "queue_depth", "running"}``; 503
    with ``"status": "failed"`` (and the error) once the pipeline failed, or
    ``"shutting_down"`` while the server stops."""
    state = state_of(request)
    if state.failed:
        return JSONResponse({"status": "failed", "error": state.failed}, status_code=503)
    if state.stopping.is_set():
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    return {"status": "ok", "queue_depth": state.jobs.qsize(), "running": state.running}


async def metrics(request: Request):
    """``GET /metrics``: the server's counters in the Prometheus text format."""
    return PlainTextResponse(generate_latest(state_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def slots(request: Request):
    """llama-server's view of the slots: what each one holds now."""
    state = state_of(request)
    if state.slots is None:
        return [{"id": 0, "n_ctx": state.n_ctx, "is_processing": bool(state.running),
                 "state": "generating" if state.running else "idle"}]
    return state.slots()


async def models(request: Request):
    """The model and the job's facts; a fact given as a function (the
    kernels' row probe, measured on first use and then cached) is asked in
    a worker thread, so the event loop keeps answering meanwhile."""
    state = state_of(request)
    info = {k: (await run_in_threadpool(v)) if callable(v) else v for k, v in state.info.items()}
    meta = dict(info, n_ctx=state.n_ctx, scheduling=scheduling(state.parallel, state.n_ctx),
                parallel=state.parallel, queue_depth=state.jobs.qsize(), max_queue=state.max_queue)
    return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.created,
                                        "owned_by": "ggpipe", "meta": meta}]}


async def chat_completions(request: Request):
    """``POST /v1/chat/completions``: render the messages with the model's
    chat template, queue one job per choice (``n``) and answer the OpenAI chat
    completion, or stream it as server-sent events (``stream``).

    Raises:
        APIError: 400 (an invalid body, a prompt the template refuses or the
            context cannot hold), 503 (shutting down, queue full)."""
    state = state_of(request)
    body = await parse_body(request, ChatBody)
    front = _from_front(request, state, body)
    messages = [m.as_template_message() for m in body.messages]
    n = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    tokens = await _tokenize(state, None, messages)
    jobs = await _enqueue(state, body, tokens, n, front)
    if body.stream:
        return stream(state, jobs[0], request, "chat", body.include_usage())
    return await complete(state, jobs, request, "chat")


async def completions(request: Request):
    """``POST /v1/completions``: one prompt (a string, a list of one string,
    or token ids), queued as one job per choice (``n``); the OpenAI text
    completion, or its server-sent events (``stream``).

    Raises:
        APIError: 400 (an invalid body, ``echo``, several or empty prompts, a
            token id outside the vocabulary, a prompt the context cannot hold),
            503 (shutting down, queue full)."""
    state = state_of(request)
    body = await parse_body(request, CompletionBody)
    front = _from_front(request, state, body)
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo")
    p = body.prompt
    if isinstance(p, list) and len(p) != 1 and (not p or isinstance(p[0], str)):
        raise APIError(400, "prompt: give one prompt (a string); for several prompts send one request each",
                       param="prompt")
    if p == "" or p == [""]:
        raise APIError(400, "the prompt is empty", param="prompt")
    if isinstance(p, list) and isinstance(p[0], int):
        _in_vocabulary(p, state.n_vocab, "prompt token", "prompt")
        tokens = np.asarray(p, dtype=np.int32)
    else:
        tokens = await _tokenize(state, p if isinstance(p, str) else p[0], None)
    jobs = await _enqueue(state, body, tokens, body.max_tokens, front)
    if body.stream:
        return stream(state, jobs[0], request, "text", body.include_usage())
    return await complete(state, jobs, request, "text")


# -- a request's way through the queue and back ------------------------------------------


def _authorized(request: Request, key: str) -> bool:
    got = request.headers.get("authorization", "")
    scheme, _, token = got.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def _in_vocabulary(tokens: list[int], n_vocab: int, what: str, param: str) -> None:
    """Raise APIError 400 naming the first of ``tokens`` (ids, >= 0) that
    ``n_vocab`` does not hold (``WHAT ID is outside the vocabulary``)."""
    bad = next((t for t in tokens if t >= n_vocab), None)
    if bad is not None:
        raise APIError(400, f"{what} {bad} is outside the vocabulary (0..{n_vocab - 1})", param=param)


def _from_front(request: Request, state: ServerState, body: _Body) -> bool:
    """Whether the request came from the front end of ``serve --ranks``
    (ggpipe.frontends.serve.resume); ``ggpipe_resume`` is checked here.

    Raises:
        APIError: 400: ``ggpipe_resume`` from anyone else (an unknown
            field, as to every client), without ``stream``, or naming a
            token outside the vocabulary."""
    front = from_front(request.headers, state.front_key)
    r = body.ggpipe_resume
    if r is not None:
        if not front:
            raise APIError(400, f"unknown field {RESUME!r}: ggpipe does not implement it", param=RESUME,
                           code="unsupported_parameter")
        if not body.stream:
            raise APIError(400, f"{RESUME}: a streamed reply only", param=RESUME)
        _in_vocabulary(r.tokens, state.n_vocab, f"{RESUME}: token", RESUME)
    return front


async def _tokenize(state: ServerState, prompt: str | None, messages: list | None) -> np.ndarray:
    try:
        return await run_in_threadpool(state.tokenize, prompt, messages)
    except Exception as e:  # noqa: BLE001 (a template that refuses these messages, no template, ...)
        raise APIError(400, f"cannot render the prompt: {' '.join(str(e).split()) or type(e).__name__}",
                       param="messages" if messages is not None else "prompt") from None


def request_sampling(defaults: SamplingParams, body: _Body, logprobs: int) -> SamplingParams:
    """The server's sampling settings (its command line's) with the request's
    temperature, top_k, top_p and seed where it gives them, and ``logprobs``;
    the constraint fields come on top (ggpipe.frontends.request_fields)."""
    over = {k: getattr(body, k) for k in ("temperature", "top_k", "top_p", "seed") if getattr(body, k) is not None}
    return dataclasses.replace(defaults, logprobs=logprobs, **over)


async def _enqueue(state: ServerState, body: _Body, tokens: np.ndarray, max_tokens: int | None,
                   front: bool = False) -> list[Job]:
    """Check a request against the context and the queue and put its
    ``n`` jobs (one per choice; choice i samples with seed + i) on the queue;
    ``front``: it came from the front end of ``serve --ranks`` (its stream
    carries token ids; ``ggpipe_resume`` goes on with a reply).

    Raises:
        APIError: 400 (does not fit, a refused field), 503 (stopping, queue full)."""
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
    logprobs = body.logprobs_k()
    if body.stream and (body.n > 1 or logprobs >= 0):
        name = "n" if body.n > 1 else "logprobs"
        raise APIError(400, f"{name} with stream: ggpipe does not implement it; leave stream out (or send n 1 "
                       "and no logprobs)", param=name, code="unsupported_parameter")
    sampling = request_sampling(state.sampling, body, logprobs)
    fields = {f: getattr(body, f) for f in request_fields.FIELDS}
    try:   # a JSON schema's grammar takes a moment: off the event loop
        sampling = await run_in_threadpool(request_fields.constraints, fields, sampling)
    except request_fields.FieldError as e:
        raise APIError(400, str(e), param=e.param) from None
    try:
        sampling.check_vocabulary(state.n_vocab)
    except ConfigError as e:
        raise APIError(400, str(e), param="logit_bias") from None
    if state.failed:
        raise pipeline_failed(None)
    if state.stopping.is_set():
        raise shutting_down()
    if state.jobs.qsize() + body.n > state.max_queue:
        raise APIError(503, f"the queue is full ({state.max_queue} requests waiting); retry later", "server_error",
                       code="queue_full")
    loop = asyncio.get_running_loop()
    jobs = []
    for i in range(body.n):
        s = sampling if i == 0 or sampling.seed is None else dataclasses.replace(
            sampling, seed=(sampling.seed + i) % 2**63)
        jobs.append(Job(tokens, max_tokens, s, body.stops(), loop, asyncio.Queue(), with_tokens=front and body.stream,
                        resume=None if body.ggpipe_resume is None else
                        Resume(tuple(body.ggpipe_resume.tokens), body.ggpipe_resume.sent)))
    for job in jobs:
        state.jobs.put(job)
    return jobs
