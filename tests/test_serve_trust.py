"""``ggpipe serve`` under hostile requests (issue 29, "Trust under hostile
requests"): the fast tests need no model and no ranks (the FastAPI app with a
fake tokenizer, the request loop with a fake engine, pure logic); the ones
marked ``full`` start real ranks or load real weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
from starlette.testclient import TestClient

from ggpipe.frontends.http_guard import Access
from ggpipe.frontends.serve import read_api_key
from ggpipe.frontends.serve_app import create_app
from ggpipe.frontends.serve_state import ServerState
from ggpipe.sampling import SamplingParams

ORIGIN = "http://localhost:3000"


def app_client(**kw) -> TestClient:
    state = ServerState(tokenize=lambda p, m: np.array([1, 2, 3], dtype=np.int32), model_id="m", n_ctx=64,
                        n_vocab=100, n_predict=4, sampling=SamplingParams(), **kw)
    return TestClient(create_app(state), base_url="http://127.0.0.1:8080", raise_server_exceptions=False)


# -- 15a: --api-key-file uses its first line ---------------------------------------------------


def test_api_key_file_first_line(tmp_path):
    f = tmp_path / "key"
    f.write_text("s3cret\nsecond line, a comment\n")
    assert read_api_key(None, f, env={}) == "s3cret"
    f.write_text("  k  \r\n")
    assert read_api_key(None, f, env={}) == "k"


# -- 5: CORS preflight with an API key ----------------------------------------------------------


def test_cors_preflight_with_an_api_key():
    c = app_client(api_key="K", access=Access(allowed_origins=(ORIGIN,)))
    r = c.options("/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                   "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    # a wrong key: still 401, and readable by the page (CORS headers)
    r = c.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
    r = c.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer K"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    # an origin not listed: no grant, refused
    r = c.options("/v1/chat/completions", headers={"Origin": "http://evil.example",
                                                   "Access-Control-Request-Method": "POST"})
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
    r = c.get("/v1/models", headers={"Origin": "http://evil.example", "Authorization": "Bearer K"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
