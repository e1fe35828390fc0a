"""Prompt sets for ``ggpipe bench``.

The shipped set ``default`` has one prompt per category of PipeInfer's
evaluation (V.A): code generation with no explanation, a story about a
warrior named Goliath, and a plain encyclopedic excerpt to continue. They
were written for this project and are about 128 tokens each after
SmolLM2's chat template.

A user's own set is a JSONL file, one object per line with a ``prompt``
string and optionally ``id`` and ``category``::

    {"id": "sql", "category": "code", "prompt": "Write a SQL query that ..."}
"""

from __future__ import annotations

import re
from pathlib import Path

from ggpipe.errors import ConfigError
from ggpipe.jsonl import iter_jsonl

DEFAULT = [
    {
        "id": "code",
        "category": "code generation, no explanation",
        "prompt": (
            "Write a Python module that implements a least-recently-used cache as a class named LRUCache. "
            "The constructor takes the capacity as an integer. The class must provide get(key), which returns "
            "the stored value or None, and put(key, value), which inserts or updates an entry and evicts the "
            "least recently used entry when the cache is full. Use collections.OrderedDict and add type "
            "hints. Reply with the code only, with no explanation."
        ),
    },
    {
        "id": "goliath",
        "category": "story about a warrior named Goliath",
        "prompt": (
            "Tell me a story about a warrior named Goliath. He is the tallest soldier of a mountain kingdom "
            "and has guarded its only pass for twenty winters without losing a fight. One spring a young "
            "shepherd arrives at the pass with a sling, a flock of sheep and a message from the king of the "
            "valley below. Describe the morning they meet, the argument that follows, and the storm that "
            "forces them to shelter together in a cave. End the story with the choice Goliath makes."
        ),
    },
    {
        "id": "encyclopedia",
        "category": "encyclopedic excerpt",
        "prompt": (
            "Continue this encyclopedia article in the same neutral style. The Message Passing Interface "
            "(MPI) is a standardized and portable message-passing specification designed to function on "
            "parallel computing architectures. The standard defines the syntax and semantics of library "
            "routines for point-to-point and collective communication between processes, which are "
            "identified by their rank within a communicator. Implementations such as MPICH and Open MPI "
            "are available for C, C++ and Fortran, and bindings exist for many other languages."
        ),
    },
]

SETS = {"default": DEFAULT}


def load_prompts(name_or_path: str) -> list[dict]:
    """The prompt set ``name_or_path``: a shipped set name (``default``) or a
    JSONL file path. Returns dicts with ``id``, ``category``, ``prompt``.

    Raises:
        ConfigError: unknown name, unreadable file, a line that is not a JSON
            object with a non-empty ``prompt`` string, duplicate ids, or no prompts.
    """
    if name_or_path in SETS:
        return [dict(p) for p in SETS[name_or_path]]
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"prompt set {name_or_path!r} is neither a shipped set ({', '.join(SETS)}) "
                          f"nor a JSONL file")
    out = []
    for i, obj in iter_jsonl(path):
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise ConfigError(f"{path}:{i}: expected an object with a non-empty \"prompt\" string")
        pid = str(obj.get("id", f"p{len(out) + 1}"))
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", pid):
            raise ConfigError(f"{path}:{i}: id {pid!r} may only use letters, digits, '_', '.', '-'")
        out.append({"id": pid, "category": str(obj.get("category", "")), "prompt": obj["prompt"]})
    if not out:
        raise ConfigError(f"{path}: no prompts")
    ids = [p["id"] for p in out]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{path}: duplicate prompt ids")
    return out


def render_prompts(model_path: str | Path, prompts: list[dict], chat: bool = True) -> list[str]:
    """The text each prompt is fed as: wrapped as a user turn in the model's
    chat template when ``chat`` (exactly as ``ggpipe generate --chat``), else
    the prompt itself. Loads only the model's vocabulary.

    Raises:
        ModelError: the model cannot be loaded, or has no chat template.
    """
    if not chat:
        return [p["prompt"] for p in prompts]
    from ggpipe.runtime.vocab import vocab_only  # noqa: PLC0415 (llama.cpp only when asked)

    with vocab_only(model_path) as vocab:
        return [vocab.apply_chat_template([{"role": "user", "content": p["prompt"]}]) for p in prompts]


def count_tokens(model_path: str | Path, texts: list[str]) -> list[int]:
    """Token counts of ``texts`` as ggpipe tokenizes a prompt (BOS per the model,
    special tokens parsed)."""
    from ggpipe.runtime.vocab import vocab_only  # noqa: PLC0415 (llama.cpp only when asked)

    with vocab_only(model_path) as vocab:
        return [int(vocab.tokenize(t).shape[0]) for t in texts]
