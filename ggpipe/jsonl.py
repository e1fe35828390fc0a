"""Reading JSONL input files (batch requests, prompt sets): one JSON value per
line, blank lines skipped, the first bad line named in a one-line error."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from ggpipe.errors import ConfigError


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, object]]:
    """Yield ``(line number, value)`` for every non-blank line of ``path``
    (numbered from 1; a line ends at ``\n``, ``\r\n`` too).

    Raises:
        ConfigError: the file cannot be read, or a line is not valid JSON
            ("FILE:LINE: not valid JSON (...)").
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {p}: {getattr(e, 'strerror', None) or e}") from None
    # lines end at "\n" only: str.splitlines() would also split inside a JSON
    # string at a raw U+2028/U+2029/U+0085, which JSON allows unescaped
    for i, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        try:
            yield i, json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{i}: not valid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise ConfigError(f"{p}:{i}: JSON nested too deeply") from None
