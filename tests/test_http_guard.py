"""The server's access checks, without a model: the pure Host/Origin logic,
the API key sources, and the FastAPI app with a fake tokenizer (Starlette's
TestClient; no MPI, no ranks)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from starlette.testclient import TestClient

from ggpipe.errors import ConfigError
from ggpipe.frontends.serve.http_guard import Access, host_allowed, is_json_content_type, origin_allowed, split_host
from ggpipe.frontends.serve.server import read_api_key
from ggpipe.frontends.serve.app import create_app
from ggpipe.frontends.serve.state import ServerState
from ggpipe.sampling_params import SamplingParams


def test_split_host():
    assert split_host("[::1]:8080") == "::1" and split_host("Example.ORG:80") == "example.org"
    assert split_host("127.0.0.1") == "127.0.0.1" and split_host("localhost.") == "localhost"


@pytest.mark.parametrize("host,allowed,ok", [
    ("127.0.0.1:8080", (), True), ("[::1]:8080", (), True), ("localhost:8080", (), True),
    ("10.1.2.3:8080", (), True), ("app.localhost", (), True), (None, (), True),
    ("evil.example:8080", (), False),                       # DNS rebinding
    ("evil.example", ("node1",), False), ("node1:8080", ("node1",), True),
    ("a.cluster.org", (".cluster.org",), True), ("cluster.org", (".cluster.org",), True),
    ("xcluster.org", (".cluster.org",), False), ("anything", ("*",), True),
])
def test_host_allowed(host, allowed, ok):
    assert host_allowed(host, allowed) is ok


def test_origin_allowed_and_content_type():
    assert origin_allowed(None) and not origin_allowed("http://evil.example")
    assert origin_allowed("http://localhost:3000/", ("http://localhost:3000",))
    assert not origin_allowed("http://localhost:3001", ("http://localhost:3000",))
    assert origin_allowed("https://x", ("*",))
    assert is_json_content_type("application/json; charset=utf-8") and not is_json_content_type("text/plain")
    assert not is_json_content_type(None)


def test_api_key_sources(tmp_path):
    for bad in ("", "   "):
        with pytest.raises(ConfigError, match="--api-key is empty"):
            read_api_key(bad, None, env={})
        with pytest.raises(ConfigError, match="GGPIPE_API_KEY is set but empty"):
            read_api_key(None, None, env={"GGPIPE_API_KEY": bad})
    f = tmp_path / "key"
    f.write_text("s3cret\n")
    assert read_api_key(None, f, env={}) == "s3cret"
    assert read_api_key(None, None, env={"GGPIPE_API_KEY": "k"}) == "k" and read_api_key(None, None, env={}) is None
    f.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_api_key(None, f, env={})
    with pytest.raises(ConfigError, match="not both"):
        read_api_key("a", f, env={})
    with pytest.raises(ConfigError, match="cannot read --api-key-file"):
        read_api_key(None, tmp_path / "missing", env={})


def app_client(**kw) -> TestClient:
    state = ServerState(tokenize=lambda p, m: np.array([1, 2, 3], dtype=np.int32), model_id="m", n_ctx=64,
                        n_vocab=100, n_predict=4, sampling=SamplingParams(), **kw)
    return TestClient(create_app(state), base_url="http://127.0.0.1:8080")


BODY = json.dumps({"prompt": "hi", "max_tokens": 2})


def test_cross_site_and_rebinding_requests_are_refused():
    c = app_client()
    # a web page's "simple" cross-site POST: text/plain, foreign Origin
    r = c.post("/v1/completions", content=BODY, headers={"Content-Type": "text/plain",
                                                          "Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = c.post("/v1/completions", content=BODY, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    r = c.get("/v1/models", headers={"Host": "evil.example:8080"})  # DNS rebinding
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    # preflight from a page: no CORS grant
    r = c.options("/v1/completions", headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
                                              "Access-Control-Request-Headers": "content-type"})
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
    assert c.get("/v1/models").status_code == 200 and c.get("/health", headers={"Host": "localhost"}).status_code == 200


def test_configured_origins_and_hosts():
    c = app_client(access=Access(allowed_hosts=("node1",), allowed_origins=("http://localhost:3000",)))
    r = c.options("/v1/completions", headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                                              "Access-Control-Request-Headers": "content-type,authorization"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = c.get("/v1/models", headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert c.get("/v1/models", headers={"Host": "node1:8080"}).status_code == 200


def test_a_long_host_header_is_not_echoed_in_full():
    c = app_client()
    r = c.get("/v1/models", headers={"Host": "e" * 5000})
    msg = r.json()["error"]["message"]
    assert r.status_code == 403 and "(5000 characters)" in msg and len(msg) < 400, msg
    r = c.get("/v1/models", headers={"Origin": "http://" + "o" * 5000})
    msg = r.json()["error"]["message"]
    assert r.status_code == 403 and len(msg) < 400, msg


def test_body_size_is_bounded():
    c = app_client(access=Access(max_body_bytes=2048))
    big = json.dumps({"prompt": "x" * 5000})
    r = c.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: chunked transfer
        for i in range(0, len(big), 500):
            yield big[i:i + 500].encode()

    r = c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_a_full_queue_answers_503_with_retry_after_and_the_slots_view():
    """--max-queue requests waiting: the next gets 503 queue_full with
    Retry-After (a slot frees as soon as any request ends); /slots shows the
    scheduler's view; /v1/models says how requests are scheduled."""
    view = [{"id": 0, "n_ctx": 512, "is_processing": True, "n_prompt_tokens": 3, "n_decoded": 7, "n_cached": 9}]
    state = ServerState(tokenize=lambda p, m: np.array([1, 2, 3], np.int32), model_id="m", n_ctx=512, n_vocab=10,
                        n_predict=4, sampling=SamplingParams(), max_queue=1, parallel=2, slots=lambda: view,
                        tokens_per_s=lambda: 12.5)
    c = TestClient(create_app(state), base_url="http://127.0.0.1")
    state.jobs.put(object())                         # one request waiting already
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
    assert c.get("/slots").json() == view
    meta = c.get("/v1/models").json()["data"][0]["meta"]
    assert meta["parallel"] == 2 and meta["scheduling"].startswith("continuous batching: up to 2 requests")
    metrics = c.get("/metrics").text
    assert "ggpipe_slots 2.0" in metrics and "ggpipe_aggregate_tokens_per_second 12.5" in metrics
