"""What the front end of ``serve --ranks N`` and the job's server say to
each other about a streamed reply, so that a new job can go on with it
where a job that lost a rank left it (resume by prefill, as Petals replays
a client's inputs to a new server).

The front end starts every job with a key of its own in the environment
(:data:`KEY_ENV`) and sends it in a header (:data:`HEADER`) with every
request. To a request that carries it, the job's server adds to each
streamed chunk the token ids accepted since the last chunk
(:data:`TOKENS`); the front end keeps them and takes them out before the
client sees the chunk. When the job is lost, the front end sends the
request to the next job with :data:`RESUME` in its body: those tokens and
the characters of their text already sent, and the new job prefills the
prompt and the tokens and goes on (ggpipe.service.engine.Engine.submit).
Without the key, :data:`RESUME` is an unknown field, as to any client.
"""

from __future__ import annotations

import hmac
import json
import os

#: The variable that gives a job's server the front end's key.
KEY_ENV = "GGPIPE_FRONT_KEY"
#: The request header that carries it.
HEADER = "x-ggpipe-front"
#: A streamed chunk's token ids (a list of int) accepted since the last chunk.
TOKENS = "ggpipe_tokens"
#: A request body's reply to go on with: ``{"tokens": [int, ...], "sent": characters}``.
RESUME = "ggpipe_resume"


def job_key() -> str | None:
    """The front end's key, in a job it started; None otherwise."""
    return os.environ.get(KEY_ENV) or None


def from_front(headers, key: str | None) -> bool:
    """Whether a request with ``headers`` came from the front end holding ``key``."""
    got = headers.get(HEADER)
    return key is not None and got is not None and hmac.compare_digest(got.encode(), key.encode())


def resumed_body(body: bytes, tokens: list[int], sent: int) -> bytes:
    """The request body ``body`` (a JSON object) with :data:`RESUME` set to
    ``tokens`` (ids) and ``sent`` (characters): the same request, to go on
    after them."""
    obj = json.loads(body)
    obj[RESUME] = {"tokens": tokens, "sent": sent}
    return json.dumps(obj, ensure_ascii=False).encode()
