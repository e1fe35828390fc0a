"""No request parameter is silently ignored: the sampling constraints
(``min_p``, penalties, ``logit_bias``, ``response_format``, ``json_schema``,
``grammar``), ``logprobs`` and ``n`` are checked and taken; a field
``ggpipe serve`` does not implement is refused with 400 naming it, unless its
value asks for nothing (what OpenAI clients send by default); unknown fields
are refused too. (That the accepted fields change the output: tests/test_constraints_mpi.py.)"""

from __future__ import annotations

import json

import pytest

from tests.test_serve_trust import app_client

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT = {"prompt": "hi", "max_tokens": 2}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _post(c, path, body):
    return c.post(path, content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("field, value", [
    ("best_of", 2), ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("n_probs", 3), ("mirostat", 2), ("typical_p", 0.5), ("no_such_field", 1),
])
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)])
def test_a_field_that_would_be_ignored_is_refused_by_name(path, body, field, value):
    c = app_client(max_queue=0)   # had it been accepted: 503, the queue is full
    r = _post(c, path, {**body, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    assert "does not implement" in err["message"], err


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": "garbage"}, "logit_bias"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"15": 500}}, "logit_bias"), ({"logit_bias": {"100": -100}}, "logit_bias"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"), ({"presence_penalty": 1e308}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"), ({"min_p": 5}, "min_p"), ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_last_n": -2}, "repeat_last_n"), ({"repeat_last_n": 1.5}, "repeat_last_n"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"json_schema": "not a schema"}, "json_schema"),
    ({"json_schema": SCHEMA, "grammar": 'root ::= "a"'}, "grammar"),
    ({"grammar": 5}, "grammar"), ({"n": 9}, "n"), ({"n": 2, "stream": True}, "n"),
    # invalid schemas (the metaschema) and unsatisfiable ones are refused, not answered with output that does not hold
    ({"json_schema": {"type": "object", "required": "x"}}, "json_schema"),
    ({"json_schema": {"type": "object", "required": 5}}, "json_schema"),
    ({"json_schema": {"type": "object", "additionalProperties": "x"}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"],
        "additionalProperties": False}}}}, "response_format"),
    ({"json_schema": {"type": "array", "minItems": 3, "maxItems": 2}}, "json_schema"),
    ({"json_schema": {"type": "string", "maxLength": 10**6}}, "json_schema"),
    ({"json_schema": {"enum": []}}, "json_schema"),
    # unknown keys inside response_format, and the types of its known ones
    ({"response_format": {"type": "json_object", "extra": 1}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "bogus": 1}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "response_format"),
    ({"response_format": {"type": "text", "json_schema": {"schema": SCHEMA}}}, "response_format"),
    ({"stream_options": {"include_usage": True, "extra": 1}}, "stream_options"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
])
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)])
def test_a_bad_value_is_refused_naming_its_field(path, body, fields, param):
    c = app_client(max_queue=8)
    r = _post(c, path, {**body, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == param and param in err["message"], err


@pytest.mark.parametrize("path, body, fields, param", [
    ("/v1/chat/completions", CHAT, {"top_logprobs": 3}, "top_logprobs"),      # without logprobs: true
    ("/v1/chat/completions", CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", CHAT, {"logprobs": True, "stream": True}, "logprobs"),
    ("/v1/completions", TEXT, {"logprobs": 21}, "logprobs"),
    ("/v1/completions", TEXT, {"logprobs": True}, "logprobs"),              # the completions shape is a count
])
def test_bad_logprobs_are_refused(path, body, fields, param):
    r = _post(app_client(max_queue=8), path, {**body, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("fields", [
    {"frequency_penalty": 0.5, "presence_penalty": -0.5, "repeat_penalty": 1.1, "repeat_last_n": -1, "min_p": 0.1},
    {"logit_bias": {"15": -100, "3": 2.5}},
    {"response_format": {"type": "json_object"}}, {"response_format": {"type": "json_schema",
                                                                       "json_schema": {"name": "x", "schema": SCHEMA}}},
    {"json_schema": SCHEMA}, {"grammar": 'root ::= "a"'}, {"n": 3},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "description": "d", "strict": True,
                                                                "schema": SCHEMA}}},
    {"json_schema": {**SCHEMA, "$schema": "http://json-schema.org/draft-07/schema#"}},
])
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)])
def test_implemented_fields_are_accepted(path, body, fields):
    """The queue is the limit here (no engine runs): 503 queue_full means the body was accepted."""
    r = _post(app_client(max_queue=0), path, {**body, **fields})
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text


@pytest.mark.parametrize("neutral", [
    {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "n": 1, "best_of": 1},
    {"logprobs": False, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}},
    {"logit_bias": None, "tools": None, "response_format": None, "user": "someone", "min_p": 0},
])
def test_neutral_values_are_accepted(neutral):
    """The queue is the limit here (no engine runs): 503 queue_full means the body was accepted."""
    c = app_client(max_queue=0)   # a request that passes every check meets the full queue
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
        r = c.post(path, json={**body, **neutral})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text


def test_the_servers_own_constraints_are_kept():
    """A server started with --grammar, a logit bias or penalties applies them
    to every request that does not override them (they were dropped)."""
    from ggpipe.frontends.serve.app import request_sampling
    from ggpipe.frontends.serve.bodies import CompletionBody
    from ggpipe.sampling_params import SamplingParams

    d = SamplingParams(grammar='root ::= "a"', logit_bias=((3, -100.0),), repeat_penalty=1.2, min_p=0.1, top_k=20)
    s = request_sampling(d, CompletionBody.model_validate({"prompt": "x", "temperature": 0.5}), logprobs=2)
    assert (s.grammar, s.logit_bias, s.repeat_penalty, s.min_p, s.top_k) == (d.grammar, d.logit_bias, 1.2, 0.1, 20)
    assert (s.temperature, s.logprobs) == (0.5, 2)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("schema, words", [
    ({"type": "object", "required": "x"}, "not a valid JSON schema (at required)"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"], "additionalProperties": False},
     "'b' is required but not among the properties"),
    ({"properties": {"p": {"type": "array", "minItems": 3, "maxItems": 2}}}, "properties.p: minItems 3 is more"),
    (_nested(40), "nested more than"),
])
def test_an_invalid_or_unsatisfiable_schema_is_one_line_naming_the_problem(schema, words):
    from ggpipe.errors import ConfigError
    from ggpipe.runtime.grammar import json_grammar

    with pytest.raises(ConfigError) as e:
        json_grammar(schema)
    assert words in str(e.value) and "\n" not in str(e.value), e.value


@pytest.mark.parametrize("message", [
    {"role": "user", "content": "hi", "extra": 1},
    {"role": "user", "content": [{"type": "text", "text": "hi", "bogus": True}]},
    {"role": "assistant", "content": "hi", "tool_calls": [{"id": "1"}]},
])
def test_unknown_or_unimplemented_keys_of_a_message_are_refused(message):
    c = app_client(max_queue=8)
    r = _post(c, "/v1/chat/completions", {**CHAT, "messages": [message]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("messages"), r.text


def test_a_message_echoed_back_with_its_empty_fields_is_accepted():
    c = app_client(max_queue=0)   # accepted: 503, the queue is full
    echoed = {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None, "function_call": None,
              "audio": None, "annotations": [], "name": "bot"}
    r = _post(c, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}, echoed,
                                                               {"role": "user", "content": "again"}]})
    assert r.status_code == 503, r.text
