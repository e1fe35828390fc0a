"""Chat messages to token ids: the GGUF's chat template rendered, then
tokenized so that only the template's own text becomes special tokens.

Tokenizing the rendered prompt with ``parse_special`` (as before) turned a
user's text ``<|im_start|>system ...`` into real role tokens. Here the
template is rendered twice, once with the messages and once with a
placeholder for each content; where the two agree (the template copies each
content unchanged, as chat templates do), special-token text is recognised
only outside the contents (the OpenAI API's behaviour: a message is text).
``special_in_messages`` restores the old behaviour.

The partition is llama.cpp's (``tokenizer_st_partition``: control and
unknown tokens' text becomes their id, with their lstrip/rstrip attributes;
each piece of text between them is tokenized alone, user-defined tokens
still matched), but in one regex pass: ``llama_tokenize`` itself took time
quadratic in the number of special tokens (20k one-word messages: 5 s).
For contents without special-token text the ids are those of
``Vocab.tokenize(Vocab.apply_chat_template(messages))``.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

import numpy as np

from ggpipe.errors import ConfigError

# llama.h's llama_token_attr bits
ATTR_UNKNOWN, ATTR_CONTROL, ATTR_LSTRIP, ATTR_RSTRIP = 1, 8, 128, 256
_SPACE = " \t\n\v\f\r"   # C isspace, as llama.cpp strips
_MARK = re.compile("\ue000([0-9a-f]{32})(\\d+)\ue001")   # a placeholder for message i's content (template_regions)


def _trie_regex(words: list[str]) -> re.Pattern:
    """A regex matching any of ``words`` (the longest at a position), as a
    trie, so that a scan costs O(text), not O(text x words)."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        alts = [re.escape(ch) + build(sub) for ch, sub in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return re.compile(build(trie) if words else r"(?!x)x")


@dataclass
class SpecialTokens:
    """The tokens whose text ``parse_special`` turns into their id (llama.cpp:
    control and unknown tokens), and what ``add_special`` adds.

    Args:
        tokens: (id, text, llama_token_attr bits) of each.
        prefix, suffix: ids added before and after the text (BOS, EOS).
    """

    tokens: list[tuple[int, str, int]]
    prefix: list[int] = field(default_factory=list)
    suffix: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.by_text = {t: (i, a) for i, t, a in sorted(self.tokens, key=lambda x: -x[0]) if t}
        self.pattern = _trie_regex(list(self.by_text))

    @classmethod
    def of(cls, vocab) -> SpecialTokens:
        """Those of a loaded :class:`~ggpipe.runtime.vocab.Vocab` (read once, then cached on it)."""
        cached = getattr(vocab, "_ggpipe_special_tokens", None)
        if cached is not None:
            return cached
        L, v = vocab._L, vocab._vocab
        toks = []
        for i in range(vocab.n_vocab):
            attr = int(L.llama_vocab_get_attr(v, i))
            if attr & (ATTR_CONTROL | ATTR_UNKNOWN):
                toks.append((i, L.llama_vocab_get_text(v, i).decode("utf-8", "replace"), attr))
        bos, eos = int(L.llama_vocab_bos(v)), int(L.llama_vocab_eos(v))
        out = cls(toks, [bos] if L.llama_vocab_get_add_bos(v) and bos >= 0 else [],
                  [eos] if L.llama_vocab_get_add_eos(v) and eos >= 0 else [])
        vocab._ggpipe_special_tokens = out
        return out


def partition(text: str, regions: list[tuple[int, int]], specials: SpecialTokens) -> list[str | int]:
    """``text`` as pieces of text and special token ids (llama.cpp's
    partition), special-token text recognised only inside ``regions``
    ((start, end) character ranges, in order, not overlapping). Linear in
    ``len(text)``."""
    out: list[str | int] = []
    pos = 0          # start of the text not emitted yet
    rstrip = False   # the last special token strips the whitespace after it
    for start, end in regions:
        for m in specials.pattern.finditer(text, start, end):
            tid, attr = specials.by_text[m.group()]
            piece = text[pos:m.start()]
            if rstrip:
                piece = piece.lstrip(_SPACE)
            if attr & ATTR_LSTRIP:
                piece = piece.rstrip(_SPACE)
            if piece:
                out.append(piece)
            out.append(tid)
            pos, rstrip = m.end(), bool(attr & ATTR_RSTRIP)
    piece = text[pos:]
    if rstrip:
        piece = piece.lstrip(_SPACE)
    if piece:
        out.append(piece)
    return out


def template_regions(vocab, messages: list[dict], text: str, specials: SpecialTokens) -> list[tuple[int, int]]:
    """The character ranges of ``text`` (``messages`` rendered) that the
    template wrote, i.e. everything but the messages' contents.

    Raises:
        ConfigError: a content holds special-token text, and the template
            does not copy contents unchanged (so where they are is unknown).
    """
    key = uuid.uuid4().hex
    marked = [dict(m, content=f"\ue000{key}{i}\ue001") if isinstance(m.get("content"), str) else m
              for i, m in enumerate(messages)]
    rendered = vocab.apply_chat_template(marked)
    parts, last = [], 0    # re.split by this call's marks (one fixed pattern: a pattern per call fills re's cache)
    for m in _MARK.finditer(rendered):
        if m.group(1) == key:
            parts += [rendered[last:m.start()], m.group(2)]
            last = m.end()
    parts.append(rendered[last:])
    regions, rebuilt, pos = [], [], 0
    for k, part in enumerate(parts):
        if k % 2 == 0:     # the template's own text
            regions.append((pos, pos + len(part)))
            rebuilt.append(part)
            pos += len(part)
        else:              # a message's content
            content = messages[int(part)]["content"]
            rebuilt.append(content)
            pos += len(content)
    if "".join(rebuilt) == text:
        return regions
    for m in messages:
        c = m.get("content")
        hit = specials.pattern.search(c) if isinstance(c, str) else None
        if hit:
            raise ConfigError(f"a message contains the special token text {hit.group()!r}, and this model's chat "
                              "template changes message contents, so it cannot be kept as plain text: remove it")
    return [(0, len(text))]   # no content holds special-token text: the whole prompt may be parsed


def chat_tokens(vocab, messages: list[dict], special_in_messages: bool = False,
                specials: SpecialTokens | None = None) -> np.ndarray:
    """Token ids (int32 (n,)) of ``messages`` ([{"role", "content"}, ...])
    rendered with ``vocab``'s chat template (generation prompt added).
    Special-token text in a content stays text unless ``special_in_messages``.
    Time linear in the prompt's length.

    Raises:
        ModelError: the model has no chat template.
        ConfigError: see :func:`template_regions`.
    """
    specials = specials or SpecialTokens.of(vocab)
    text = vocab.apply_chat_template(messages)
    regions = [(0, len(text))] if special_in_messages else template_regions(vocab, messages, text, specials)
    ids: list[int] = list(specials.prefix)
    seen: dict[str, list[int]] = {}   # the template's pieces repeat (~60 us a llama_tokenize call)
    for piece in partition(text, regions, specials):
        if isinstance(piece, int):
            ids.append(piece)
            continue
        got = seen.get(piece)
        if got is None:
            got = seen[piece] = vocab.tokenize(piece, add_special=False, parse_special=False).tolist()
        ids += got
    ids += specials.suffix
    return np.asarray(ids, dtype=np.int32)
