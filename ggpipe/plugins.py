"""Registries of classes by name (modes, drafting strategies): an entry is
the class itself or ``"module:Class"``, imported on first use, so a
registry lists every built-in without importing them all. Pure."""

from __future__ import annotations

import importlib


def registered(registry: dict, name: str) -> type:
    """The class ``registry`` holds as ``name`` (imported now if given as
    ``"module:Class"``).

    Raises:
        KeyError: no entry of that name (callers turn it into their own
            one-line error)."""
    entry = registry[name]
    if isinstance(entry, type):
        return entry
    mod, cls = entry.split(":")
    return getattr(importlib.import_module(mod), cls)
