"""What ``ggpipe serve`` accepts: the OpenAI-style request bodies and their checks.

:class:`APIError` is the error every endpoint answers with (an OpenAI-style
``{"error": {"message", "type", "param", "code"}}`` body); the pydantic models
are the bodies of ``/v1/chat/completions`` and ``/v1/completions`` (strict
types; the constraint fields checked as batch records' are,
ggpipe.frontends.request_fields; a field ggpipe does not implement is
refused with 400 naming it, unless its value asks for nothing:
:data:`NOT_IMPLEMENTED`); :func:`parse_body` reads a request's body,
bounded by ``--max-body-bytes``, and validates it, turning pydantic's report
into one line.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Annotated, Any, Literal

from fastapi import Request
from starlette.requests import ClientDisconnect
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from ggpipe.frontends.request_limits import MESSAGES_MAX, ROLES, STOP_MAX, TEMPERATURE_MAX, template_role
from ggpipe.frontends.serve.state import Job, ServerState, state_of
from ggpipe.sampling_params import TOP_LOGPROBS_MAX

# -- errors ------------------------------------------------------------------------------

#: The status recorded (``/metrics``) for a request whose client left before
#: its answer (nginx's "client closed request"); no one receives it.
CLIENT_GONE = 499


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        """The OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The JSON response: :meth:`body` with ``status``, and
        ``WWW-Authenticate: Bearer`` on 401 or ``Retry-After: 1`` when the queue
        is full."""
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        if self.code == "queue_full":
            headers = {"Retry-After": "1"}   # a slot frees as soon as any request ends
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def log_error(rid: str, what: str, exc: BaseException | None = None) -> None:
    """Write a failed request's details to the server's log (stderr):
    ``ggpipe serve: request RID: WHAT``, and ``exc``'s traceback when given
    (an unexpected error: a bug). Clients only get a short reason and RID."""
    text = f"ggpipe serve: request {rid}: {what}\n"
    if exc is not None:
        text += "".join(traceback.format_exception(exc))
    sys.stderr.write(text)
    sys.stderr.flush()


def internal_error(rid: str, exc: BaseException) -> APIError:
    """Log an unexpected error of request ``rid`` (with its traceback) and
    return the 500 its client gets: no details, the request id."""
    log_error(rid, f"internal error: {type(exc).__name__}: {exc}", exc)
    return APIError(500, f"internal error (request {rid}; the server's log has the details)", "server_error",
                    code="internal_error")


def pipeline_failed(rid: str | None, status: int = 503) -> APIError:
    """What request ``rid``'s client gets when the pipeline failed (None: a
    request that came after): a short reason and the id; the details (ranks,
    hosts, pids, layers) go to the server's log only (the caller writes them
    once, naming the ids)."""
    which = f"request {rid}; " if rid is not None else ""
    return APIError(status, f"the pipeline failed: the server is stopping ({which}the server's log has "
                    "the details)", "server_error", code="pipeline_failed")


def shutting_down(detail: str = "") -> APIError:
    """What a request the server drops as it stops gets (a signal; the
    launcher ending the job after a lost rank is one): 503, code
    ``shutdown``, the message "the server is shutting down" + ``detail``.
    A front end (``serve --ranks``, ggpipe.frontends.serve.front) sends
    such a request to the next job unless it is stopping itself."""
    return APIError(503, "the server is shutting down" + detail, "server_error", code="shutdown")


# -- request bodies ------------------------------------------------------------------------

PosInt = Annotated[StrictInt, Field(ge=1)]

#: Request fields of the OpenAI and llama-server APIs that ggpipe does not
#: implement, with the values that ask for nothing (what clients send by
#: default; ``null`` too): such a value is accepted, any other is refused
#: with 400 naming the field, never silently ignored.
NOT_IMPLEMENTED: dict[str, tuple] = {
    "typical_p": (1,), "tfs_z": (1,), "mirostat": (0,), "best_of": (1,), "n_probs": (0,), "tools": ([],),
    "tool_choice": ("none",), "functions": ([],), "function_call": ("none",), "parallel_tool_calls": (False, True),
    "suffix": ("",),
}
#: Most choices one request may ask for (``n``): each is one more request through the pipeline.
N_MAX = 8
#: Fields accepted that do not change the output: ``user`` (OpenAI's end-user
#: id, metadata) and ``model`` (one model is served; its name is echoed).
METADATA = ("user",)


def _refuse_unless_neutral(key: str, value, neutral: tuple, where: str = "", param: str | None = None) -> None:
    """Refuse ``key`` (400 naming it, after ``where``) unless ``value`` asks
    for nothing: None or one of ``neutral``.

    Raises:
        APIError: 400, code ``unsupported_parameter``."""
    if not _neutral(value, neutral):
        shown = " or ".join(json.dumps(n) for n in neutral) or "null"
        raise APIError(400, f"{where}{key}: ggpipe does not implement it; leave it out or send {shown} "
                       f"(asks for nothing)", param=param or key, code="unsupported_parameter")


def _neutral(value, neutral: tuple) -> bool:
    return value is None or any(type(value) is type(n) and value == n or
                                (isinstance(n, int) and not isinstance(n, bool) and isinstance(value, (int, float))
                                 and not isinstance(value, bool) and value == n) for n in neutral)


class ResumeField(BaseModel):
    """``ggpipe_resume``: a streamed reply begun by a job that lost a rank
    (ggpipe.frontends.serve.resume): its token ids and the characters of
    their text already sent."""

    model_config = ConfigDict(strict=True, extra="forbid")
    tokens: list[Annotated[StrictInt, Field(ge=0)]]
    sent: Annotated[StrictInt, Field(ge=0)]


class _Body(BaseModel):
    # strict: "0.5" is not a temperature; a field ggpipe does not implement is refused by name (_check_fields)
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _check_fields(cls, data):
        """Refuse, naming it, a field ggpipe does not implement unless its
        value asks for nothing (then drop it), and any unknown field.

        Raises:
            APIError: 400 naming the field.
        """
        if not isinstance(data, dict):
            return data
        out = {}
        for k, v in data.items():
            if k in cls.model_fields:
                out[k] = v
            elif k in NOT_IMPLEMENTED:
                _refuse_unless_neutral(k, v, NOT_IMPLEMENTED[k])
            elif k in METADATA:
                if v is not None and not isinstance(v, str):
                    raise APIError(400, f"{k}: Input should be a valid string", param=k)
            else:
                raise APIError(400, f"unknown field {str(k)[:64]!r}: ggpipe does not implement it", param=str(k)[:64],
                               code="unsupported_parameter")
        return out

    model: StrictStr | None = None
    max_tokens: PosInt | None = None
    temperature: Annotated[float, Field(ge=0, le=TEMPERATURE_MAX, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None
    stop: StrictStr | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=STOP_MAX)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=N_MAX)] = 1
    echo: StrictBool = False
    # the constraints (ggpipe.frontends.request_fields checks their types and bounds, as for batch records)
    min_p: Any = None
    repeat_penalty: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repeat_last_n: Any = None
    logit_bias: Any = None
    response_format: Any = None
    json_schema: Any = None
    grammar: Any = None
    # the front end's only (ggpipe.frontends.serve.resume): an unknown field to any other client
    ggpipe_resume: ResumeField | None = None

    def logprobs_k(self) -> int:
        """Top log-probabilities per token asked for; -1: none."""
        return -1

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            if not self.stop:
                raise APIError(400, "stop must be a non-empty string or a list of them", param="stop")
            return [self.stop]
        return list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (a last chunk with the usage)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: StrictBool | None = None


class TextPart(BaseModel):
    """A text part of a chat message's content (``{"type": "text", "text": ...}``)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: StrictStr


#: Keys of a chat message (OpenAI's) that ggpipe does not implement, with the
#: values that ask for nothing: clients echo an assistant reply back with
#: them (``"refusal": null``, ``"tool_calls": []``); any other value is refused.
MESSAGE_NOT_IMPLEMENTED: dict[str, tuple] = {
    "tool_calls": ([],), "function_call": (), "refusal": (), "audio": (), "annotations": ([],)}


class ChatMessage(BaseModel):
    """One chat message: a role (system, developer, user, assistant),
    content (a string or a list of text parts) and an optional ``name``
    (metadata); another key is refused, one of
    :data:`MESSAGE_NOT_IMPLEMENTED` unless it asks for nothing."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data):
        """Drop the keys that ask for nothing; refuse the others by name.

        Raises:
            APIError: 400 naming the key."""
        if not isinstance(data, dict):
            return data
        for k, v in data.items():
            if k in MESSAGE_NOT_IMPLEMENTED:
                _refuse_unless_neutral(k, v, MESSAGE_NOT_IMPLEMENTED[k], where="messages: ", param="messages")
        return {k: v for k, v in data.items() if k not in MESSAGE_NOT_IMPLEMENTED}

    role: Literal[ROLES]  # type: ignore[valid-type]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def as_template_message(self) -> dict:
        """The message as chat templates take it: ``{"role", "content"}``, the
        text parts joined, the role mapped (``developer`` -> ``system``)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": template_role(self.role), "content": text}


class ChatBody(_Body):
    """The body of ``POST /v1/chat/completions``: 1 to ``MESSAGES_MAX``
    messages, ``max_completion_tokens`` (over ``max_tokens``), and log
    probabilities in the chat shape (``logprobs`` a switch, ``top_logprobs``
    a count)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MESSAGES_MAX)]
    max_completion_tokens: PosInt | None = None
    logprobs: StrictBool | None = None      # OpenAI's chat shape: a switch, and top_logprobs
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=TOP_LOGPROBS_MAX)] | None = None

    def logprobs_k(self) -> int:
        """``top_logprobs`` (0 when not given) with ``logprobs: true``; -1 without.

        Raises:
            APIError: 400, ``top_logprobs`` without ``logprobs: true``."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else -1


class CompletionBody(_Body):
    # text, a list of one text, or token ids
    """The body of ``POST /v1/completions``: ``prompt`` (a string, a list of
    strings, or token ids) and ``logprobs`` in the completions shape (a
    count; false or absent: none)."""

    prompt: StrictStr | list[StrictStr] | list[Annotated[StrictInt, Field(ge=0)]]
    # the completions shape: how many top log-probabilities (false: none, as clients send by default)
    logprobs: StrictBool | Annotated[StrictInt, Field(ge=0, le=TOP_LOGPROBS_MAX)] | None = None

    def logprobs_k(self) -> int:
        """The ``logprobs`` count; -1 when absent or false.

        Raises:
            APIError: 400, ``logprobs: true`` (this endpoint takes a count)."""
        if self.logprobs is True:
            raise APIError(400, f"logprobs: the completions endpoint takes a count (0..{TOP_LOGPROBS_MAX}) of top "
                           "log-probabilities per token", param="logprobs")
        return -1 if self.logprobs is None or self.logprobs is False else self.logprobs



# -- reading and checking a body -----------------------------------------------------------


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
        APIError: 400 for a body that is not JSON, not an object, or not
            valid; 413 for one too large; CLIENT_GONE (499) when the client
            disconnected before sending all of it.
    """
    raw = bytearray()
    try:
        async for chunk in request.stream():  # bounded, also when no Content-Length was sent (chunked)
            raw += chunk
            if len(raw) > state_of(request).access.max_body_bytes:
                raise too_large(state_of(request))
    except ClientDisconnect:   # the client left in the middle of its body: nobody to answer, nothing to log
        raise APIError(CLIENT_GONE, "the client disconnected before sending its whole body") from None
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


def too_large(state: ServerState) -> APIError:
    """The 413 answer to a body over ``--max-body-bytes``."""
    return APIError(413, f"the request body is larger than {state.access.max_body_bytes} bytes (--max-body-bytes)",
                    code="request_too_large")


def answer(state: ServerState, job: Job, done, waited_s: float, grace_s: float) -> None:
    """Answer a finished request (``done``: a Completion; ``waited_s``:
    seconds it waited for the pipeline): its completion, recorded in the
    metrics, or, when a shutdown cut it and its client is still there, 503
    saying so (code ``shutdown``; ``grace_s``: ``--shutdown-grace``). A reply
    cut that way is never passed off as complete."""
    if done.finish_reason == "interrupted" and not job.cancelled.is_set():
        job.push("error", shutting_down(f": the reply was cut after {len(done.tokens)} tokens "
                                        f"(--shutdown-grace {grace_s:g} s)"))
        return
    state.metrics.finished(done, waited_s)
    job.push("done", done)
