"""Grammar-constrained output on the head: llama.cpp's grammar sampler over a
numpy logits row, and JSON schemas turned into grammars.

:class:`Grammar` is the :class:`ggpipe.sampling.LogitMask` of a GBNF grammar:
``llama_sampler_init_grammar`` (llama.cpp's ``llama-grammar.cpp``: the
grammar's stacks, advanced by ``llama_sampler_accept``) applied to the whole
vocabulary through ``llama_sampler_apply``, which sets the logit of every token
the grammar does not allow next to -inf; an end-of-generation token is allowed
once the grammar is complete. :func:`json_grammar` gives the GBNF of OpenAI's
``response_format`` (``json_object``: any JSON object, llama.cpp's
``grammars/json.gbnf``; ``json_schema``: llama-cpp-python's
``json_schema_to_gbnf``, a port of llama.cpp's ``json-schema-to-grammar``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import tempfile
import threading

import numpy as np

from ggpipe.errors import ConfigError
from ggpipe.logits import top_k_sorted
from ggpipe.runtime import llama as _llama

#: llama.cpp's ``llama_token_data`` as a numpy record (id int32, logit float32, p float32: 12 bytes).
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


def sampler_apply(smpl, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One ``llama_sampler_apply`` of llama.cpp sampler ``smpl`` (a chain or
    one sampler) over the whole row ``logits`` (float32 (n_vocab,)): the
    candidates it keeps, in its order (int32 ids, float32 logits; a filter
    such as min-p keeps fewer, a bias or a grammar changes logits)."""
    L = _llama.lib()
    cand = np.zeros(logits.size, dtype=TOKEN_DATA)
    cand["id"] = np.arange(logits.size)
    cand["logit"] = logits
    arr = L.llama_token_data_array(data=cand.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), size=logits.size,
                                   selected=-1, sorted=False)
    L.llama_sampler_apply(smpl, ctypes.byref(arr))
    kept = cand[: arr.size]
    return kept["id"].copy(), kept["logit"].copy()


_STDERR_LOCK = threading.Lock()


@contextlib.contextmanager
def _captured_stderr(out: list[str]):
    """Capture what C code writes to file descriptor 2 meanwhile into
    ``out`` (llama.cpp's grammar parser prints its error and the whole
    grammar there, which a client could use to flood the server's log)."""
    with _STDERR_LOCK, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read(4096).decode("utf-8", "replace"))


class Grammar:
    """A GBNF grammar holding one sequence's next token (start rule ``root``).

    ``vocab``: the model's ``llama_vocab *`` (ggpipe.runtime.vocab.Vocab's);
    ``n_vocab``: its size (tokens). Not thread-safe: one per sequence.

    Raises:
        ConfigError: llama.cpp cannot parse the grammar.
    """

    def __init__(self, vocab, n_vocab: int, gbnf: str):
        L = self._L = _llama.lib()
        said: list[str] = []
        with _captured_stderr(said):
            self._smpl = L.llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), b"root")
        if not self._smpl:
            why = next((ln.split("error parsing grammar:", 1)[1].strip() for ln in "".join(said).splitlines()
                        if "error parsing grammar:" in ln), "")
            raise ConfigError(f"grammar: llama.cpp cannot parse it{': ' + why[:200] if why else ''} (GBNF, start "
                              "rule 'root'; llama.cpp's grammars/README.md)")
        self._cand = np.zeros(n_vocab, dtype=TOKEN_DATA)
        self._cand["id"] = np.arange(n_vocab, dtype=np.int32)
        self._array = L.llama_token_data_array(
            data=self._cand.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), size=n_vocab, selected=-1,
            sorted=False)

    def mask(self, logits: np.ndarray, best: int = 0) -> np.ndarray:
        """float32 (n_vocab,) -> a float32 copy with every token the grammar
        does not allow next at -inf (``llama_sampler_apply``).

        ``best`` > 0: only the ``best`` most likely allowed tokens matter
        (greedy: 1; top-k sampling: k). The grammar is first asked about the
        ``2 * best`` most likely tokens (ggpipe.logits.top_k_sorted order);
        when at least ``best`` of them are allowed, those are the ``best``
        most likely allowed tokens of the whole row, and every other token
        is returned -inf (a filter keeping the ``best`` first decides the
        same). Else the whole vocabulary is asked. Walking 49k tokens takes
        3-20 ms; inside a JSON string most of them are allowed."""
        n = self._cand.shape[0]
        if 0 < best and 2 * best < n:
            ids = top_k_sorted(logits, 2 * best)
            part = self._cand[: ids.size]
            part["id"] = ids
            part["logit"] = logits[ids]
            if self._apply(ids.size) and np.isfinite(part["logit"]).sum() >= best:
                out = np.full(n, -np.inf, dtype=np.float32)
                out[part["id"]] = part["logit"]
                self._cand["id"][: ids.size] = np.arange(ids.size, dtype=np.int32)   # restore the identity ids
                return out
            self._cand["id"][: ids.size] = np.arange(ids.size, dtype=np.int32)
        self._cand["logit"] = logits
        self._apply(n)
        return self._cand["logit"].copy()

    def _apply(self, size: int) -> bool:
        self._array.size = size
        self._array.selected = -1
        self._array.sorted = False
        self._L.llama_sampler_apply(self._smpl, ctypes.byref(self._array))
        return self._array.size == size     # the grammar sampler masks, it never drops candidates

    def accept(self, token: int) -> None:
        """Advance past ``token`` (``llama_sampler_accept``).

        Raises:
            ValueError: the grammar does not allow ``token`` here (llama.cpp
                would abort the process)."""
        one = self._cand[:1]
        one["id"], one["logit"] = token, 0.0
        allowed = self._apply(1) and np.isfinite(one["logit"][0])
        one["id"] = 0
        if not allowed:
            raise ValueError(f"the grammar does not allow token {int(token)} here")
        self._L.llama_sampler_accept(self._smpl, int(token))

    def close(self) -> None:
        """Free the llama.cpp sampler (``llama_sampler_free``); a second call does nothing."""
        if self._smpl:
            self._L.llama_sampler_free(self._smpl)
            self._smpl = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass


#: JSON-schema keywords llama-cpp-python's converter does not turn into
#: grammar rules: a schema using one is refused, not silently loosened.
UNENFORCED = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minProperties", "maxProperties",
    "uniqueItems", "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
    "patternProperties", "contains", "minContains", "maxContains", "propertyNames", "unevaluatedProperties",
    "unevaluatedItems"})


def subschemas(schema, where: str = "", depth: int = 0):
    """Every schema object in ``schema`` (a JSON schema) with where it is
    (``properties.age.``) and how deep (0: ``schema`` itself, which comes
    first), walked through the keywords the converter reads (``items``,
    ``prefixItems``, ``anyOf``, ``oneOf``, ``allOf``,
    ``additionalProperties``, ``properties``, ``$defs``, ``definitions``):
    an iterator of (str, dict, int). Stops below :data:`DEPTH_MAX` + 1
    levels (the deepest it yields says the schema is too deep)."""
    if depth > DEPTH_MAX + 1:
        return
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            yield from subschemas(sub, f"{where}{i}.", depth)
        return
    if not isinstance(schema, dict):
        return
    yield where, schema, depth
    for k in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties"):
        if k in schema:
            yield from subschemas(schema[k], f"{where}{k}.", depth + 1)
    for group in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(group), dict):
            for name, sub in schema[group].items():
                yield from subschemas(sub, f"{where}{group}.{name}.", depth + 1)


def unenforced(schema, where: str = "") -> str | None:
    """The first keyword of ``schema`` (a JSON schema, walked through its
    subschemas) that the converter would ignore, with where it is
    (``properties.age.maximum``); None when every keyword is enforced or
    only annotates."""
    for at, node, _ in subschemas(schema, where):
        for key in node:
            if key in UNENFORCED:
                return f"{at}{key}"
    return None


#: Most nesting of subschemas, and largest length or count bound
#: (``maxLength``, ``minItems``, ...), a schema may have: the converter's
#: rules grow with both (a repetition is written out), and a larger schema is
#: refused before it is compiled rather than compiled for minutes.
DEPTH_MAX = 32
REPEAT_MAX = 1000


def _bounds_problem(node: dict) -> str | None:
    for lo, hi in (("minLength", "maxLength"), ("minItems", "maxItems")):
        for k in (lo, hi):
            v = node.get(k)
            if isinstance(v, int) and v > REPEAT_MAX:
                return f"{k} {v} is more than ggpipe compiles ({REPEAT_MAX})"
        a, b = node.get(lo), node.get(hi)
        if isinstance(a, int) and isinstance(b, int) and a > b:
            return f"{lo} {a} is more than {hi} {b}: no value can satisfy it"
    return None


def unsatisfiable(schema) -> str | None:
    """Why a valid JSON schema cannot be turned into a grammar that keeps to
    it, with where (``properties.x: ...``), or None: a required property that
    the schema leaves out (``required`` names it, ``properties`` does not,
    ``additionalProperties`` is false), an empty ``enum``, a lower bound over
    its upper one (``minItems`` > ``maxItems``, ``minLength`` >
    ``maxLength``), nesting deeper than :data:`DEPTH_MAX` or a bound over
    :data:`REPEAT_MAX`."""
    for at, node, depth in subschemas(schema):
        shown = at.rstrip(".") or "the schema"
        if depth > DEPTH_MAX:
            return f"nested more than {DEPTH_MAX} levels deep, more than ggpipe compiles"
        required = node.get("required")
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if node.get("additionalProperties") is False and isinstance(required, list):
            missing = [r for r in required if isinstance(r, str) and r not in props]
            if missing:
                return (f"{shown}: {missing[0]!r} is required but not among the properties, and "
                        "additionalProperties is false: no object can satisfy it")
        if node.get("enum") == []:
            return f"{shown}: an empty enum: no value can satisfy it"
        why = _bounds_problem(node)
        if why:
            return f"{shown}: {why}"
    return None


def check_schema(schema: dict, field: str = "json_schema") -> None:
    """Refuse a JSON schema that is not one (the JSON Schema metaschema of
    its ``$schema``, draft 2020-12 when it names none: ``jsonschema``'s
    ``check_schema``), that the converter would loosen
    (:func:`unenforced`) or that no grammar can keep to
    (:func:`unsatisfiable`).

    Raises:
        ConfigError: naming ``field`` (the request field that carried the
            schema), the problem and where it is.
    """
    import jsonschema  # noqa: PLC0415 (only requests with a schema need it)

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = ".".join(str(p) for p in e.path)
        raise ConfigError(f"{field}: not a valid JSON schema{f' (at {where})' if where else ''}: "
                          f"{' '.join(e.message.split())[:160]}") from None
    bad = unenforced(schema)
    if bad is not None:
        raise ConfigError(f"{field}: {bad.rsplit('.', 1)[-1]!r} (at {bad}) is not enforced by the grammar "
                          "(llama-cpp-python's converter); leave it out")
    why = unsatisfiable(schema)
    if why is not None:
        raise ConfigError(f"{field}: {why}")


def json_grammar(schema: dict | None, field: str = "json_schema") -> str:
    """GBNF for JSON output: any JSON object when ``schema`` is None or
    empty (``response_format: {"type": "json_object"}``, llama.cpp's
    ``-j '{}'``), else JSON valid under
    the JSON schema ``schema`` (llama-cpp-python's ``json_schema_to_gbnf``).

    Raises:
        ConfigError: naming ``field`` (the request field that carried the
            schema): a schema :func:`check_schema` refuses (not a JSON
            schema, a keyword the converter would ignore, unsatisfiable, too
            large to compile), or one the converter cannot turn into a grammar.
    """
    from llama_cpp import llama_grammar  # noqa: PLC0415 (heavy import, the head's first use)

    if not schema:    # None or {}: any JSON object (llama.cpp's -j '{}')
        return llama_grammar.JSON_GBNF
    check_schema(schema, field)
    try:
        gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # noqa: BLE001 - the converter raises bare exceptions of several kinds
        raise ConfigError(f"{field}: cannot turn it into a grammar: {' '.join(str(e).split())[:200] or type(e).__name__}") from None
    # the converter's string character lets control characters through (a raw newline in a string is not
    # JSON); llama.cpp's own converter's rule does not
    return "\n".join(STRICT_CHAR if line.startswith(LOOSE_CHAR) else line for line in gbnf.split("\n"))


#: The converter's rule for a character in a JSON string, and llama.cpp's
#: (``json-schema-to-grammar.cpp``), which leaves out control characters.
LOOSE_CHAR = 'char ::= [^"\\\\] |'
STRICT_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})'
