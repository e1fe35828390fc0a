"""No request parameter is silently ignored: a field ``ggpipe serve`` does not
implement is refused with 400 naming it, unless its value asks for nothing
(what OpenAI clients send by default); unknown fields are refused too."""

from __future__ import annotations

import pytest

from tests.test_serve_trust import app_client

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT = {"prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"15": -100}), ("logit_bias", "garbage"), ("frequency_penalty", float("nan")),
    ("frequency_penalty", 0.5), ("presence_penalty", 1e308), ("min_p", 5), ("best_of", 2),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}), ("logprobs", True), ("top_logprobs", 3),
    ("repeat_penalty", 1.1), ("grammar", "root ::= \"a\""), ("no_such_field", 1),
])
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)])
def test_a_field_that_would_be_ignored_is_refused_by_name(path, body, field, value):
    c = app_client(max_queue=0)   # had it been accepted: 503, the queue is full
    r = c.post(path, content=__import__("json").dumps({**body, field: value}, allow_nan=True),
               headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    assert "does not implement" in err["message"], err


@pytest.mark.parametrize("neutral", [
    {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "n": 1, "best_of": 1},
    {"logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}},
    {"logit_bias": None, "tools": None, "response_format": None, "user": "someone", "min_p": 0},
])
def test_neutral_values_are_accepted(neutral):
    """The queue is the limit here (no engine runs): 503 queue_full means the body was accepted."""
    c = app_client(max_queue=0)   # a request that passes every check meets the full queue
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
        r = c.post(path, json={**body, **neutral})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
