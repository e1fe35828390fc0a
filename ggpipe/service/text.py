"""One request's text as its tokens are accepted: detokenizing, stop
strings, and when to stop. Shared by the one-at-a-time path and the
continuous-batching path of the engine (ggpipe.service.engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ggpipe.runtime.vocab import Vocab


@dataclass(frozen=True)
class Resume:
    """A reply begun by another job, to go on from (ggpipe.service.engine.Engine.submit).

    Attributes:
        tokens: the token ids it had accepted (int; in output order).
        sent: the characters of their text already passed on (a prefix).
    """

    tokens: tuple[int, ...]
    sent: int


class TextStream:
    """Turns accepted tokens into text for ``on_text``, holding back the
    characters that may start a stop string.

    Args:
        vocab: the model's vocabulary.
        on_text: called with each new piece of text (never text after a
            stop string), or None.
        stop: strings that end the generation (not included in the text).
        should_stop: polled after each accepted token list; true stops the
            reply there (Ctrl-C in the chat, a closed HTTP stream).
        on_tokens: called just before each ``on_text`` with the token ids
            accepted since the last call (the text passed so far is a prefix
            of the text of the tokens passed so far), or None.

    Attributes:
        text: the text so far (cut before a stop string).
        stopped: None, "stop" (a stop string) or "interrupted" (``should_stop``).
    """

    def __init__(self, vocab: Vocab, on_text: Callable[[str], None] | None = None, stop=(),
                 should_stop: Callable[[], bool] | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None):
        self.vocab = vocab
        self.on_text = on_text
        self.on_tokens = on_tokens
        self.stop = list(stop)
        self.should_stop = should_stop
        self.detok = vocab.detokenizer()
        self.text = ""
        self.sent = 0
        self.tokens: list[int] = []   # accepted so far
        self.told = 0                  # of them, passed to on_tokens
        self.stopped: str | None = None
        self.hold = max((len(s) for s in self.stop), default=0)  # chars that may start a stop string

    def _flush(self, upto: int) -> None:
        if self.on_text is not None and upto > self.sent:
            if self.on_tokens is not None:
                self.on_tokens(self.tokens[self.told:])
                self.told = len(self.tokens)
            self.on_text(self.text[self.sent:upto])
        self.sent = max(self.sent, upto)

    def _push(self, new) -> None:
        for t in new:
            t = int(t)
            self.tokens.append(t)
            if not self.vocab.is_eog(t):
                self.text += self.detok.push(t)
        for s in self.stop:
            i = self.text.find(s)
            if i >= 0:
                self.text = self.text[:i]
                self.stopped = "stop"

    def resume(self, tokens: list[int], sent: int) -> None:
        """Take the reply up where another job left it: ``tokens`` were
        accepted there, and the first ``sent`` characters of their text were
        passed on; they are not passed again (nor the tokens).

        Raises:
            ValueError: ``sent`` is more than their text holds."""
        self._push(tokens)
        if not 0 <= sent <= len(self.text):
            raise ValueError(f"{sent} characters were sent, but the {len(tokens)} tokens given hold "
                             f"{len(self.text)}")
        self.sent, self.told = sent, len(self.tokens)

    def emit(self, new: list[int]) -> bool:
        """Accepted tokens (a decoder's ``emit``); True: stop here."""
        self._push(new)
        if self.stopped:
            self._flush(len(self.text))
            return True
        self._flush(len(self.text) - max(self.hold - 1, 0))
        return self.check_stop()

    def check_stop(self) -> bool:
        """Poll ``should_stop``; True (and ``stopped`` "interrupted") when
        the reply must stop."""
        if self.should_stop is not None and self.should_stop():
            self.stopped = self.stopped or "interrupted"
            return True
        return False

    def finish(self, out: list[int], n_predict: int) -> str:
        """The generation ended with ``out``: send the rest of the text;
        returns the finish reason ("stop", "length" or "interrupted")."""
        if not self.stopped:
            self.text += self.detok.flush()
        self._flush(len(self.text))
        return self.stopped or ("stop" if out and self.vocab.is_eog(out[-1]) else
                                "length" if len(out) >= n_predict else "stop")
