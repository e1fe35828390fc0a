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


def unenforced(schema, where: str = "") -> str | None:
    """The first keyword of ``schema`` (a JSON schema, walked through its
    subschemas) that the converter would ignore, with where it is
    (``properties.age.maximum``); None when every keyword is enforced or
    only annotates."""
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            found = unenforced(sub, f"{where}{i}.")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key in UNENFORCED:
            return f"{where}{key}"
    subs = [(k, schema[k]) for k in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties")
            if k in schema]
    for group in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(group), dict):
            subs += [(f"{group}.{name}", sub) for name, sub in schema[group].items()]
    for k, sub in subs:
        found = unenforced(sub, f"{where}{k}.")
        if found:
            return found
    return None


def json_grammar(schema: dict | None) -> str:
    """GBNF for JSON output: any JSON object when ``schema`` is None or
    empty (``response_format: {"type": "json_object"}``, llama.cpp's
    ``-j '{}'``), else JSON valid under
    the JSON schema ``schema`` (llama-cpp-python's ``json_schema_to_gbnf``).

    Raises:
        ConfigError: a schema the converter cannot turn into a grammar, or
            one with a keyword it would ignore (:data:`UNENFORCED`).
    """
    from llama_cpp import llama_grammar  # noqa: PLC0415 (heavy import, the head's first use)

    bad = unenforced(schema)
    if bad is not None:
        raise ConfigError(f"json_schema: {bad.rsplit('.', 1)[-1]!r} (at {bad}) is not enforced by the grammar "
                          "(llama-cpp-python's converter); leave it out")
    if not schema:    # None or {}: any JSON object (llama.cpp's -j '{}')
        return llama_grammar.JSON_GBNF
    try:
        gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # noqa: BLE001 - the converter raises bare exceptions of several kinds
        raise ConfigError(f"json_schema: cannot turn it into a grammar: {' '.join(str(e).split())[:200] or type(e).__name__}") from None
    # the converter's string character lets control characters through (a raw newline in a string is not
    # JSON); llama.cpp's own converter's rule does not
    return "\n".join(STRICT_CHAR if line.startswith(LOOSE_CHAR) else line for line in gbnf.split("\n"))


#: The converter's rule for a character in a JSON string, and llama.cpp's
#: (``json-schema-to-grammar.cpp``), which leaves out control characters.
LOOSE_CHAR = 'char ::= [^"\\\\] |'
STRICT_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})'
