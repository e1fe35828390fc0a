"""The request fields that constrain sampling, read the same way by the
server (``/v1/chat/completions``, ``/v1/completions``) and by ``batch``
records: llama-server's and OpenAI's names, types and bounds.

=====================  ==========================================================
field                  meaning (ggpipe.sampling, module docstring)
=====================  ==========================================================
``min_p``              number in [0, 1]
``repeat_penalty``     number in (0, 10]; 1 is off
``frequency_penalty``  number in [-2, 2]
``presence_penalty``   number in [-2, 2]
``repeat_last_n``      integer >= -1: tokens the penalties look back on (64)
``logit_bias``         ``{"token id": bias in [-100, 100]}`` (OpenAI's shape)
``response_format``    ``{"type": "text"}``, ``{"type": "json_object"}`` or
                       ``{"type": "json_schema", "json_schema": {"schema": {...}}}``
``json_schema``        a JSON schema (llama-server's field)
``grammar``            a GBNF grammar (llama-server's field)
=====================  ==========================================================

At most one of ``response_format`` (other than text), ``json_schema`` and
``grammar``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from ggpipe.errors import ConfigError
from ggpipe.sampling_params import SamplingParams

#: The fields :func:`constraints` reads.
FIELDS = ("min_p", "repeat_penalty", "frequency_penalty", "presence_penalty", "repeat_last_n", "logit_bias",
          "response_format", "json_schema", "grammar")
#: Most characters of a grammar, or of a JSON schema's text.
GRAMMAR_MAX = 64 * 1024


class FieldError(ConfigError):
    """A request field's value is refused; ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _number(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise FieldError(name, f"{name} must be a finite number (got {_shown(v)})")
    return float(v)


def _shown(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:40] + "..."


def _bias(v) -> tuple[tuple[int, float], ...]:
    if not isinstance(v, dict):
        raise FieldError("logit_bias", 'logit_bias must be an object {"token id": bias}, as OpenAI\'s')
    out = []
    for k, b in v.items():
        if not isinstance(k, str) or not k.isdigit() or len(k) > 9:
            raise FieldError("logit_bias", f"logit_bias: keys are token ids (got {_shown(k)})")
        out.append((int(k), _number(b, "logit_bias")))
    return tuple(out)


def _grammar(fields: dict) -> str | None:
    """The GBNF text the fields ask for (response_format, json_schema, grammar), or None."""
    from ggpipe.runtime.grammar import json_grammar  # noqa: PLC0415 (llama-cpp-python, loaded on first use)

    asked = []
    rf = fields.get("response_format")
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        _known_keys(rf, RESPONSE_FORMAT_KEYS.get(kind, ("type",)), "response_format")
        if kind == "json_object":
            schema = rf.get("schema")    # llama-server also takes a schema here
            asked.append(("response_format", None if schema is None else _schema(schema, "response_format")))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise FieldError("response_format", 'response_format json_schema needs '
                                 '{"json_schema": {"name": ..., "schema": {...}}}')
            _known_keys(js, JSON_SCHEMA_KEYS, "response_format.json_schema")
            for key, kinds, shown in (("name", str, "a string"), ("description", str, "a string"),
                                      ("strict", bool, "true or false")):
                if js.get(key) is not None and not isinstance(js[key], kinds):
                    raise FieldError("response_format", f"response_format.json_schema.{key} must be {shown} "
                                     f"(got {_shown(js[key])})")
            asked.append(("response_format", _schema(js["schema"], "response_format")))
        elif kind != "text":
            raise FieldError("response_format", 'response_format type must be "text", "json_object" or '
                             f'"json_schema" (got {_shown(kind)})')
    if fields.get("json_schema") is not None:
        asked.append(("json_schema", _schema(fields["json_schema"], "json_schema")))
    g = fields.get("grammar")
    if g is not None and g != "":
        if not isinstance(g, str) or len(g) > GRAMMAR_MAX:
            raise FieldError("grammar", f"grammar must be a GBNF text of at most {GRAMMAR_MAX} characters")
        asked.append(("grammar", g))
    if len(asked) > 1:
        raise FieldError(asked[1][0], f"give one of response_format, json_schema and grammar (got "
                         f"{' and '.join(a for a, _ in asked)})")
    if not asked:
        return None
    name, value = asked[0]
    if name == "grammar":
        return value
    try:
        return json_grammar(value, field=name)
    except ConfigError as e:
        raise FieldError(name, str(e)) from None


#: The keys ``response_format`` may have, by its type (OpenAI's, and
#: llama-server's ``schema`` beside ``json_object``), and those of its
#: ``json_schema`` object; any other is refused, as unknown top-level fields are.
RESPONSE_FORMAT_KEYS = {"text": ("type",), "json_object": ("type", "schema"), "json_schema": ("type", "json_schema")}
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


def _known_keys(obj, known: tuple[str, ...], where: str) -> None:
    if not isinstance(obj, dict):
        return
    for k in obj:
        if k not in known:
            raise FieldError("response_format", f"{where}: unknown key {str(k)[:64]!r} (it takes "
                             f"{', '.join(known)})")


def _schema(s, name: str):
    import json  # noqa: PLC0415

    if not isinstance(s, dict):
        raise FieldError(name, f"{name}: the JSON schema must be an object")
    if len(json.dumps(s)) > GRAMMAR_MAX:
        raise FieldError(name, f"{name}: the JSON schema is longer than {GRAMMAR_MAX} characters")
    return s


def constraints(fields: dict, base: SamplingParams) -> SamplingParams:
    """``base`` with the constraint fields of a request (see the module
    docstring) that ``fields`` sets (absent or null: ``base``'s); validated.

    Raises:
        FieldError: a wrong type, a value out of bounds, two grammars, a JSON
            schema the converter refuses; ``param`` names the field.
    """
    over: dict = {}
    for name in ("min_p", "repeat_penalty", "frequency_penalty", "presence_penalty"):
        if fields.get(name) is not None:
            over[name] = _number(fields[name], name)
    n = fields.get("repeat_last_n")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise FieldError("repeat_last_n", f"repeat_last_n must be an integer (got {_shown(n)})")
        over["repeat_last_n"] = n
    if fields.get("logit_bias") is not None:
        over["logit_bias"] = _bias(fields["logit_bias"])
    grammar = _grammar(fields)
    if grammar is not None:
        over["grammar"] = grammar
    out = dataclasses.replace(base, **over)
    try:
        return out.validate()
    except ConfigError as e:
        text = str(e)
        param = next((f for f in FIELDS if text.startswith(f)), None)
        raise FieldError(param, text) from None
