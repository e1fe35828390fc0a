"""Tokenizer, detokenizer and chat template of a loaded model (head rank).

Thin wrappers over llama.cpp's ``llama_tokenize`` / ``llama_token_to_piece`` /
``llama_vocab_is_eog``, and llama-cpp-python's ``Jinja2ChatFormatter`` for the
GGUF's own chat template (``tokenizer.chat_template``), as llama-cpp-python's
``Llama.create_chat_completion`` does.
"""

from __future__ import annotations

import codecs
import ctypes

import numpy as np

from ggpipe.errors import ConfigError, ModelError
from ggpipe.runtime import llama as _llama

_INT32_P = ctypes.POINTER(ctypes.c_int32)


class Vocab:
    """Token <-> text for a model's vocabulary (``llama_vocab *``)."""

    def __init__(self, model, vocab):
        self._L = _llama.lib()
        self._model = model
        self._vocab = vocab
        self.n_vocab = int(self._L.llama_vocab_n_tokens(vocab))
        self._formatter = None   # the chat template, compiled (apply_chat_template)
        # each token's answers, asked once: every generated token asks both, and a ctypes call releases the
        # GIL, which the head's loop then waits to take back from the HTTP thread
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> np.ndarray:
        """Token ids of ``text``: int32 (n,). ``add_special`` adds BOS as the
        model's metadata asks; ``parse_special`` maps control-token text
        (e.g. ``<|im_start|>`` in a chat prompt) to its id."""
        L = self._L
        data = text.encode("utf-8")
        cap = len(data) + 16
        while True:
            # a numpy buffer: a ctypes array type per length would stay in ctypes' type cache for good
            buf = np.empty(cap, dtype=np.int32)
            n = L.llama_tokenize(self._vocab, data, len(data), buf.ctypes.data_as(_INT32_P), cap, add_special,
                                 parse_special)
            if n >= 0:
                return buf[:n].copy()
            cap = -n

    def piece(self, token: int) -> bytes:
        """Raw bytes of one token (``llama_token_to_piece``, special tokens rendered)."""
        token = int(token)
        known = self._pieces.get(token)
        if known is None:
            known = self._pieces[token] = self._piece(token)
        return known

    def _piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self._L.llama_token_to_piece(self._vocab, int(token), buf, 64, 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._L.llama_token_to_piece(self._vocab, int(token), buf, -n, 0, True)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        """End-of-generation token (EOS, EOT, ...)? (``llama_vocab_is_eog``)"""
        token = int(token)
        known = self._eog.get(token)
        if known is None:
            known = self._eog[token] = bool(self._L.llama_vocab_is_eog(self._vocab, token))
        return known

    def grammar(self, gbnf: str):
        """A :class:`ggpipe.runtime.grammar.Grammar` of ``gbnf`` on this
        vocabulary (one sequence's; ggpipe.sampling.LogitMask).

        Raises:
            ConfigError: llama.cpp cannot parse the grammar."""
        from ggpipe.runtime.grammar import Grammar  # noqa: PLC0415

        return Grammar(self._vocab, self.n_vocab, gbnf)

    def detokenizer(self) -> "Detokenizer":
        """A new :class:`Detokenizer` over this vocabulary."""
        return Detokenizer(self)

    def chat_template(self) -> str | None:
        """The GGUF's chat template (``tokenizer.chat_template``,
        ``llama_model_chat_template``), or None when it has none."""
        ptr = self._L.llama_model_chat_template(self._model, None)
        return ptr.decode("utf-8") if ptr else None

    def token_text(self, token: int) -> str:
        """One token's text (:meth:`piece`, invalid UTF-8 replaced by U+FFFD)."""
        return self.piece(token).decode("utf-8", "replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the
        GGUF's chat template, adding the assistant generation prompt.

        Raises:
            ModelError: the model has no chat template.
        """
        if self._formatter is None:     # compiled once: a server renders one per request
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # noqa: PLC0415

            template = self.chat_template()
            if not template:
                raise ModelError("this model has no chat template (tokenizer.chat_template); drop --chat")
            bos = self._special_text(self._L.llama_vocab_bos(self._vocab))
            eos = self._special_text(self._L.llama_vocab_eos(self._vocab))
            self._formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos,
                                                  add_generation_prompt=True)
        return self._formatter(messages=messages).prompt

    def _special_text(self, token: int) -> str:
        return "" if token < 0 else self.token_text(token)


class Detokenizer:
    """Incremental token -> text that never splits a UTF-8 character across
    pieces (a multi-byte character can span several tokens)."""

    def __init__(self, vocab: Vocab):
        self._vocab = vocab
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        """The text ``token`` completes: its piece's bytes decoded, the bytes of an
        unfinished character kept for the next call ("" until it completes)."""
        return self._dec.decode(self._vocab.piece(token))

    def flush(self) -> str:
        """The text left at the end: bytes of an unfinished character become U+FFFD."""
        return self._dec.decode(b"", final=True)


def check_prompt_fits(n_prompt: int, n_predict: int, n_ctx: int) -> None:
    """Raise ConfigError when the prompt (tokens) plus ``n_predict`` new tokens
    do not fit the context."""
    if n_prompt == 0:
        raise ConfigError("the prompt is empty")
    if n_prompt + n_predict > n_ctx:
        raise ConfigError(
            f"the prompt has {n_prompt} tokens and -n asks for {n_predict} more, "
            f"but the context holds {n_ctx}: raise --ctx-size or shorten the prompt"
        )


class vocab_only:
    """Context manager: the :class:`Vocab` of a vocabulary-only llama.cpp
    load of ``model_path`` (metadata and tokenizer, no weights; freed on exit).

    Raises:
        ModelError: llama.cpp cannot load the file's vocabulary."""

    def __init__(self, model_path):
        self.path = str(model_path)

    def __enter__(self) -> Vocab:
        L = _llama.lib()
        mp = L.llama_model_default_params()
        mp.vocab_only = True
        self.model = L.llama_model_load_from_file(self.path.encode(), mp)
        if not self.model:
            raise ModelError(f"llama.cpp could not load the vocabulary of {self.path}")
        self.L = L
        return Vocab(self.model, L.llama_model_get_vocab(self.model))

    def __exit__(self, *exc):
        self.L.llama_model_free(ctypes.c_void_p(self.model) if isinstance(self.model, int) else self.model)
        return False
