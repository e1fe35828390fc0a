"""Fault injection for tests and ``scripts/fault_injection.py``: make one
rank's target stage fail on purpose, the way a real fault would, so that the
path from the failure to the one line the user reads is tested end to end.

``GGPIPE_FAULT=RANK:KIND:N`` (unset: no fault, and nothing is checked but one
attribute per decode): the target stage of rank ``RANK`` fails on its ``N``-th
``llama_decode`` call (counting from 1) with

* ``kvfull``: the error llama.cpp's "no KV slot" gives (``GGPipeError``,
  "the KV cache is full"), which a stage can meet near the end of the context;
* ``nan``: non-finite values in the stage's output (as damaged weights give),
  caught by the stage's own check (:class:`ggpipe.errors.NonFiniteError`).

Not a user setting: the message says the fault was injected.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ggpipe.errors import ConfigError

KINDS = ("kvfull", "nan")


@dataclass
class Fault:
    """One planned fault: ``kind`` at decode call number ``at`` (1-based)."""

    kind: str
    at: int
    calls: int = 0

    def due(self) -> bool:
        """Count one decode call; True on the one that must fail."""
        self.calls += 1
        return self.calls == self.at


def planned(rank: int, target: bool, env: dict | None = None, n_ranks: int | None = None) -> Fault | None:
    """The fault ``GGPIPE_FAULT`` plans for this rank's stage, or None.

    Args:
        n_ranks: the job's ranks, when known: ``RANK`` must be one of them.

    Raises:
        ConfigError: ``GGPIPE_FAULT`` is not ``RANK:KIND:N``, or ``RANK`` is
            not a rank of a job of ``n_ranks``.
    """
    text = (os.environ if env is None else env).get("GGPIPE_FAULT", "")
    if not text or not target:
        return None
    parts = text.split(":")
    try:
        r, kind, n = int(parts[0]), parts[1], int(parts[2])
    except (IndexError, ValueError):
        raise ConfigError(f"GGPIPE_FAULT={text!r}: expected RANK:KIND:N, KIND one of {', '.join(KINDS)}") from None
    if kind not in KINDS or n < 1 or len(parts) != 3:
        raise ConfigError(f"GGPIPE_FAULT={text!r}: expected RANK:KIND:N, KIND one of {', '.join(KINDS)}, N >= 1")
    if n_ranks is not None and not 0 <= r < n_ranks:
        raise ConfigError(f"GGPIPE_FAULT={text!r}: this job has no rank {r} (its ranks are 0..{n_ranks - 1})")
    return Fault(kind, n) if r == rank else None
