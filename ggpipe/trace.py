"""Per-rank event trace (``GGPIPE_TRACE_DIR``), for timelines of a run.

When ``GGPIPE_TRACE_DIR`` is set, every rank records timestamped events in
memory and writes them at exit to ``DIR/rank<R>.jsonl``: a header line
(rank, pid, host, clock offset) then one event per line. When it is unset,
:func:`tracer` returns None and the hooks in the scheduling code cost one
global lookup and one ``if``.

Events (``ph`` as in the Chrome trace format):

* ``"X"`` complete spans with ``ts`` and ``dur`` (seconds): ``run`` (a
  stage computing a micro-batch; args ``run``, ``n`` tokens, ``spec``,
  ``pipeline``, and ``cancelled`` when aborted mid-compute), ``idle`` (a
  worker waiting for its next transaction);
* ``"i"`` instants: ``send`` (a run handed to the next rank), ``recv``
  (logits arrived at the head), ``cancel`` (a cancellation issued or
  received), ``skip`` (a run skipped because it was cancelled before it
  started), ``start`` / ``finish`` of the rank's work.

Timestamps are ``time.perf_counter()`` seconds; the header's ``wall_offset_s``
converts them to Unix time (``ts + wall_offset_s``), which is how traces of
ranks on different hosts are put on one axis (as good as their clocks' NTP
sync). :mod:`ggpipe.bench.timeline` draws them and exports Chrome trace JSON.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from ggpipe.transport.launcher_signal import launched_rank

ENV_VAR = "GGPIPE_TRACE_DIR"


class Tracer:
    """Collects this rank's events; :meth:`write` saves them (also at exit).

    Args:
        directory: where ``rank<R>.jsonl`` goes.
        rank: this process's rank (default: from the MPI launcher's environment).
    """

    def __init__(self, directory: str | os.PathLike, rank: int | None = None):
        self.dir = Path(directory)
        self.rank = (launched_rank() or 0) if rank is None else rank
        self.events: list[tuple] = []  # (ph, name, ts, dur, lane, args)
        self.wall_offset_s = time.time() - time.perf_counter()
        self._written = False
        self.instant("start", "main")

    def span(self, name: str, t0: float, t1: float, lane: str | None = None, **args) -> None:
        """A finished span from ``t0`` to ``t1`` (perf_counter seconds)."""
        self.events.append(("X", name, t0, t1 - t0, lane or threading.current_thread().name, args))

    def instant(self, name: str, lane: str | None = None, **args) -> None:
        """An instant event now."""
        self.events.append(("i", name, time.perf_counter(), 0.0, lane or threading.current_thread().name, args))

    def write(self) -> Path:
        """Write ``DIR/rank<R>.jsonl`` (once; later calls rewrite it)."""
        if not self._written:
            self.instant("finish", "main")
        self._written = True
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}.jsonl"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps({"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                                "wall_offset_s": self.wall_offset_s}) + "\n")
            f.writelines(json.dumps({"ph": ph, "name": name, "ts": ts, "dur": dur, "lane": lane, **args}) + "\n"
                         for ph, name, ts, dur, lane, args in list(self.events))
        tmp.replace(path)
        return path


_TRACER: Tracer | None = None


def _init() -> Tracer | None:
    d = os.environ.get(ENV_VAR)
    if not d:
        return None
    t = Tracer(d)
    atexit.register(_write_at_exit, t)
    return t


def _write_at_exit(t: Tracer) -> None:
    """Write the trace at exit; a folder that went away or filled up since
    the start-up check (ggpipe.env_check) is one line, not a traceback."""
    try:
        t.write()
    except OSError as e:
        sys.stderr.write(f"ggpipe: warning: rank {t.rank}: cannot write the trace into {t.dir} "
                         f"({e.strerror or e})\n")


_TRACER = _init()


def discard() -> None:
    """Write no trace at exit (the folder was refused at start-up)."""
    atexit.unregister(_write_at_exit)


def tracer() -> Tracer | None:
    """This process's tracer, or None when tracing is off (the usual case)."""
    return _TRACER
