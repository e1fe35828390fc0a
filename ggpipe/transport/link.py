"""Link emulation: make shared-memory MPI behave like a slower interconnect.

``GGPIPE_LINK=BANDWIDTH,LATENCY`` (``ggpipe bench --link``), e.g.
``1gbit,200us``, makes every rank's :class:`~ggpipe.transport.mpi.Transport`
hold each message it sends for

    latency + bytes / bandwidth

before handing it to MPI, so it reaches the receiver that much later than it
would over shared memory. ``shm`` (or ``none``, or unset) turns it off.

What is emulated:

* every message of every hop, in both directions (activations down the
  pipeline, logits back to the head, KV operations, cancellations, the
  start-up handshake and statistics), since every rank's sends go through it;
* serialization per link: a link is one direction of one (sender, receiver)
  pair, full duplex. A message starts occupying it when the previous message
  on the same link has finished, so back-to-back messages queue behind each
  other (``bytes / bandwidth`` each); latency is added after serialization;
* per-link FIFO order, so MPI's ordering guarantees still hold.

What is not emulated:

* contention between links: two hops never slow each other down (an ideal,
  non-blocking switch), and a rank sending to two ranks at once serializes
  the two links independently;
* packet loss, jitter, retransmission, TCP/IP or MPI protocol overhead,
  MTU/packetization, rendezvous round trips (a message is one transfer);
* the real shared-memory transfer still happens on top (a few us for the
  messages ggpipe sends; see docs/clusters/emulated-cluster.md);
* a held message is released by the sender's own progress (its waits and its
  progress thread while computing), so a release can be late by the sender's
  polling interval (10-100 us; the transport shortens its sleeps to the next
  release time).
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from dataclasses import dataclass

from ggpipe.errors import ConfigError

ENV_VAR = "GGPIPE_LINK"

_BW_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
             "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}
_LAT_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_NUM = r"(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"
OFF_NAMES = ("shm", "none", "off", "")


@dataclass(frozen=True)
class LinkSpec:
    """An emulated link: ``bandwidth_bps`` in bits per second (None:
    unlimited), ``latency_s`` in seconds."""

    bandwidth_bps: float | None
    latency_s: float

    def delay_s(self, nbytes: int) -> float:
        """Time one message of ``nbytes`` bytes occupies the link plus latency (s)."""
        return self.latency_s + self.serialize_s(nbytes)

    def serialize_s(self, nbytes: int) -> float:
        """Seconds ``nbytes`` bytes occupy the link at ``bandwidth_bps`` (0 for an
        unlimited link)."""
        return 0.0 if not self.bandwidth_bps else 8.0 * nbytes / self.bandwidth_bps

    def __str__(self) -> str:
        return format_link(self)


def _parse_number(text: str, units: dict[str, float], what: str, spec: str) -> float:
    m = re.fullmatch(r"\s*(?P<num>" + _NUM + r")\s*(?P<unit>[a-zµ]*)\s*", text.lower())
    if not m or m.group("unit") not in units:
        raise ConfigError(f"bad {what} {text.strip()!r} in link {spec!r}: expected a number with a unit "
                          f"({', '.join(sorted(units))}), e.g. 1gbit,200us")
    value = float(m.group("num")) * units[m.group("unit")]
    if not math.isfinite(value):
        raise ConfigError(f"bad {what} {text.strip()!r} in link {spec!r}: not a finite number"
                          + (" (an unlimited link is inf)" if what == "bandwidth" else ""))
    return value


def parse_link(spec: str | None) -> LinkSpec | None:
    """Parse ``BANDWIDTH,LATENCY`` (``1gbit,200us``, ``100mbit,1ms``,
    ``inf,50us``); ``shm``/``none``/empty/None mean no emulation (None).

    Raises:
        ConfigError: not of that form, an unknown unit, a figure too large
            to be finite (``1e400gbit``), or a non-positive bandwidth.
    """
    if spec is None or spec.strip().lower() in OFF_NAMES:
        return None
    parts = spec.split(",")
    if len(parts) != 2:
        raise ConfigError(f"bad link {spec!r}: expected BANDWIDTH,LATENCY such as 1gbit,200us (or shm)")
    bw_text, lat_text = parts
    bw = None if bw_text.strip().lower() in ("inf", "unlimited") else \
        _parse_number(bw_text, _BW_UNITS, "bandwidth", spec)
    if bw is not None and bw <= 0:
        raise ConfigError(f"bad link {spec!r}: bandwidth must be positive")
    lat = _parse_number(lat_text, _LAT_UNITS, "latency", spec)
    return LinkSpec(bw, lat)


def format_link(link: LinkSpec | None) -> str:
    """Canonical text of a link (``1gbit,200us``), ``shm`` for none."""
    if link is None:
        return "shm"
    if link.bandwidth_bps is None:
        bw = "inf"
    else:
        for unit, f in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
            if link.bandwidth_bps >= f:
                bw = f"{link.bandwidth_bps / f:g}{unit}"
                break
    lat = link.latency_s
    lt = f"{lat * 1e6:g}us" if lat < 1e-3 else (f"{lat * 1e3:g}ms" if lat < 1 else f"{lat:g}s")
    return f"{bw},{lt}"


class LinkEmulator:
    """Holds outgoing messages of one rank until their emulated arrival time.

    Not thread-safe on its own: the Transport calls it under its lock.
    ``now`` is ``time.perf_counter`` (seconds).
    """

    def __init__(self, link: LinkSpec, clock=time.perf_counter):
        self.link = link
        self.clock = clock
        self._busy_until: dict[int, float] = {}     # per destination: link free again (s)
        self._held: dict[int, deque] = {}           # per destination: (release_s, item), FIFO
        self.n_held = 0
        self.delay_total_s = 0.0

    def hold(self, dest: int, nbytes: int, item) -> float:
        """Queue ``item`` (``nbytes`` bytes) for ``dest``; returns its release time (s)."""
        now = self.clock()
        start = max(now, self._busy_until.get(dest, 0.0))
        done = start + self.link.serialize_s(nbytes)
        self._busy_until[dest] = done
        release = done + self.link.latency_s
        self._held.setdefault(dest, deque()).append((release, item))
        self.n_held += 1
        self.delay_total_s += release - now
        return release

    def due(self) -> list:
        """Items whose release time has come, in per-destination FIFO order."""
        if not self.n_held:
            return []
        now = self.clock()
        out = []
        for q in self._held.values():
            while q and q[0][0] <= now:
                out.append(q.popleft()[1])
        self.n_held -= len(out)
        return out

    def next_release_in(self) -> float | None:
        """Seconds until the next held message is due (0 if overdue), None if none is held."""
        if not self.n_held:
            return None
        t = min(q[0][0] for q in self._held.values() if q)
        return max(0.0, t - self.clock())


def from_env(environ=None) -> LinkEmulator | None:
    """The emulator ``GGPIPE_LINK`` asks for, or None.

    Raises:
        ConfigError: the variable is set but malformed.
    """
    import os

    spec = parse_link((environ if environ is not None else os.environ).get(ENV_VAR))
    return LinkEmulator(spec) if spec is not None else None
