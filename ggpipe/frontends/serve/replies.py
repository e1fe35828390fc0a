"""What ``ggpipe serve`` answers: a finished request's body in OpenAI's
shapes (``chat.completion`` / ``text_completion``, one choice per ``n``),
its ``usage`` and each choice's ``logprobs`` (:func:`complete`), or its
server-sent events in OpenAI's chunk format as the text comes
(:func:`stream`); a request's client that leaves cancels it."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ggpipe.frontends.serve.bodies import CLIENT_GONE
from ggpipe.frontends.serve.resume import TOKENS
from ggpipe.frontends.serve.state import Job, ServerState

#: OpenAI's finish_reason of a Completion's.
FINISH = {"stop": "stop", "length": "length", "interrupted": "length"}


def usage(done: list) -> dict:
    """OpenAI's ``usage`` of the Completions of one request (one per choice):
    its prompt tokens once, the tokens of every choice."""
    prompt, completion_tokens = done[0].n_prompt, sum(len(d.tokens) for d in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}


def logprobs(state: ServerState, done, kind: str) -> dict | None:
    """OpenAI's ``logprobs`` of a choice: the chat shape (``content``: one
    entry per token, with its ``top_logprobs``) or the completions shape
    (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``); a
    final end-of-generation token is left out, as its text is. None when
    the request asked for none."""
    if done.logprobs is None:
        return None
    entries = done.logprobs
    if done.finish_reason == "stop" and entries and done.tokens and state.is_eog(done.tokens[-1]):
        entries = entries[:-1]

    def text(t: int) -> tuple[str, list[int]]:
        b = state.piece(t)
        return b.decode("utf-8", "replace"), list(b)

    if kind == "chat":
        content = []
        for e in entries:
            tok, raw = text(e.token)
            content.append({"token": tok, "logprob": e.logprob, "bytes": raw,
                            "top_logprobs": [{"token": text(t)[0], "logprob": lp, "bytes": text(t)[1]}
                                             for t, lp in e.top]})
        return {"content": content}
    tokens, offsets, at = [], [], 0
    for e in entries:
        tok = text(e.token)[0]
        tokens.append(tok)
        offsets.append(at)
        at += len(tok)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t)[0]: lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def completion(state: ServerState, rid: str, done: list, kind: str) -> dict:
    """The body answering request ``rid`` (``kind`` "chat" or "text") whose
    choices are the Completions ``done``, in order; its ``ggpipe`` field has
    the first choice's token ids, metrics and decoder statistics (and each
    choice's tokens and metrics when there are several)."""
    first = done[0]
    extra = {"tokens": first.tokens, "n_reused": first.n_reused, "metrics": first.metrics, "decoder": first.decoder}
    if len(done) > 1:
        extra["choices"] = [{"tokens": d.tokens, "metrics": d.metrics} for d in done]
    choices = []
    for i, d in enumerate(done):
        lp = logprobs(state, d, kind)
        if kind == "chat":
            choices.append({"index": i, "message": {"role": "assistant", "content": d.text}, "logprobs": lp,
                            "finish_reason": FINISH[d.finish_reason]})
        else:
            choices.append({"index": i, "text": d.text, "logprobs": lp, "finish_reason": FINISH[d.finish_reason]})
    return {"object": "chat.completion" if kind == "chat" else "text_completion", "choices": choices, "id": rid,
            "created": int(time.time()), "model": state.model_id, "usage": usage(done), "ggpipe": extra}


# -- a request's answer, as its job ends or as its text comes ---------------------------------


async def _watch(request: Request, job: Job) -> None:
    """Wait for the client to disconnect (the body has been read: the next
    message is ``http.disconnect``), then cancel the job, queued or running
    (the request loops stop it at its next token or never start it), and
    tell its handler ("gone"). ``request.is_disconnected()`` never saw it
    behind the counting middleware, so a request whose client had left was
    served to its end."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001, S110 - any failure to read means the client is gone
        pass
    job.cancelled.set()
    job.events.put_nowait(("gone", None))


def _watching(request: Request, job: Job) -> asyncio.Task:
    return asyncio.get_running_loop().create_task(_watch(request, job))


async def _finished(job: Job, request: Request):
    """Wait for ``job``'s Completion; None when its client left."""
    watcher = _watching(request, job)
    try:
        while True:
            ev, value = await job.events.get()
            if ev == "gone":
                return None
            if ev == "error":
                raise value
            if ev == "done":
                return value
    finally:
        watcher.cancel()


async def complete(state: ServerState, jobs: list[Job], request: Request, kind: str) -> Response:
    """The whole answer of a request's ``jobs`` (one per choice) once they
    have ended: OpenAI's completion body of ``kind`` ("chat" or "text"),
    or an empty 499 when its client left (the jobs still running are
    cancelled).

    Raises:
        APIError: what a job ended with (its ``error`` event)."""
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + jobs[0].rid
    done = []
    try:
        for job in jobs:
            d = await _finished(job, request)
            if d is None:     # nobody will read an answer; counted in /metrics
                return Response(status_code=CLIENT_GONE)
            done.append(d)
    finally:
        for job in jobs:
            if not job.finished:
                job.cancelled.set()
    return JSONResponse(completion(state, rid, done, kind))


def sse(obj) -> str:
    """One server-sent event: ``obj`` as JSON after ``data: ``."""
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def stream(state: ServerState, job: Job, request: Request, kind: str, include_usage: bool) -> StreamingResponse:
    """``job``'s answer as server-sent events in OpenAI's chunk format of
    ``kind`` ("chat": an opening chunk with the role first), one chunk per
    piece of text (with its token ids for the front end of ``serve
    --ranks``, ggpipe.frontends.serve.resume), the finish reason, the usage
    when ``include_usage``, then ``data: [DONE]``; an error as its error
    body. A client that leaves cancels the job."""
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + job.rid
    created = int(time.time())
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(text: str | None, reason: str | None, first: bool = False, ids: list[int] | None = None) -> dict:
        if kind == "chat":
            delta = {} if text is None else ({"role": "assistant", "content": text} if first else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        out = {"id": rid, "object": obj, "created": created, "model": state.model_id, "choices": [choice]}
        if ids is not None:
            out[TOKENS] = ids
        return out

    async def events():
        watcher = _watching(request, job)   # also while it waits in the queue, before any text is sent
        try:
            if kind == "chat":
                yield sse(chunk("", None, first=True))
            ids = None
            while True:
                ev, value = await job.events.get()
                if ev == "gone":
                    return
                if ev == "tokens":      # the front end's: they come with the next text
                    ids = (ids or []) + value
                elif ev == "text":
                    yield sse(chunk(value, None, ids=ids))
                    ids = None
                elif ev == "error":
                    yield sse(value.body())
                    break
                else:
                    yield sse(chunk(None, FINISH[value.finish_reason]))
                    if include_usage:
                        yield sse({"id": rid, "object": obj, "created": created, "model": state.model_id,
                                    "choices": [], "usage": usage([value])})
                    break
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            if not job.finished:
                job.cancelled.set()  # the client went away: stop generating for it

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
