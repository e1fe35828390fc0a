"""What ``ggpipe serve`` answers: a finished request's body in OpenAI's
shapes (``chat.completion`` / ``text_completion``, one choice per ``n``),
its ``usage`` and each choice's ``logprobs``; the streamed chunks are built
beside the stream (ggpipe.frontends.serve.app)."""

from __future__ import annotations

import time

from ggpipe.frontends.serve.state import ServerState

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
