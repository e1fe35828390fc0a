"""The package's folders are layers (ggpipe/__init__.py's layout map): a
folder imports only folders below it, never one above, lazily or not."""

from __future__ import annotations

import re
from pathlib import Path

import ggpipe

ROOT = Path(ggpipe.__file__).resolve().parent


def _layers() -> list[str]:
    """The folders in the layout map's order, top first."""
    return re.findall(r"^    (\w+)/ ", ggpipe.__doc__, re.M)


def test_the_layout_map_names_every_folder():
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert set(_layers()) == folders


def test_no_folder_imports_one_above_it():
    order = _layers()
    rank = {name: i for i, name in enumerate(order)}
    upward = []
    for name in order:
        for f in sorted((ROOT / name).rglob("*.py")):
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                for used in re.findall(r"^\s*(?:from|import) ggpipe\.(\w+)", line):
                    if used in rank and rank[used] < rank[name]:
                        upward.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()} ({name}/ is below {used}/)")
    assert not upward, "\n".join(upward)
