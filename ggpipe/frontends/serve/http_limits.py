"""How many connections ``ggpipe serve`` holds, and for how long a request may
take to arrive: the server stays answerable under a connection flood.

uvicorn's own limits cover part of it: ``timeout_keep_alive`` closes a
connection idle between two requests, h11's ``max_incomplete_event_size``
(16 KiB) bounds a request's headers. What it lacks is added here, as a
subclass of its h11 protocol and a subclass of its server
(ggpipe.frontends.serve.http_protocol); the limits and their log are here:

* **A read time limit** (``--read-timeout``): a request's headers and body
  must arrive within that many seconds of its first byte (of the
  connection's opening, for its first request); else the connection is
  closed. It is a timer of the same kind as uvicorn's keep-alive timer
  (``loop.call_later``), but one that the bytes of an unfinished request do
  not push back: a client that sends one header byte a second is still
  closed in time.
* **A cap on open connections** (``--max-connections``; default
  :func:`default_max_connections`: the open-file limit less an eighth of
  it, at least :data:`RESERVED_FDS`, for the head's own files and the
  descriptors of closed connections not yet freed). A connection accepted
  beyond it closes the oldest connection that has not sent a whole request
  (unfinished headers, or idle between requests), so a flood of unfinished
  requests cannot lock clients out; when every connection is busy with a
  request, the new one is answered 503 and closed. uvicorn's
  ``limit_concurrency`` does not do this: it counts the connections but
  refuses only after a whole request has been read, and logs a line per
  refusal.
* **One line a second at most** about refused or closed connections
  (:class:`RefusalLog`), and none per accept that failed for lack of file
  descriptors: asyncio reports each such failure (``socket.accept() out of
  system resource``, ``OSError: [Errno 24] Too many open files``) with a
  traceback to the loop's exception handler, which :class:`GuardedServer`
  replaces with a count.

This module imports no HTTP library (the command line reads its defaults).
"""

from __future__ import annotations

import asyncio
import errno
import resource
import sys
import time
from dataclasses import dataclass, field

#: File descriptors the default ``--max-connections`` leaves the head for its
#: own use (the model's files, MPI's sockets, pipes, the log), at least; and
#: at least one in :data:`RESERVED_SHARE` of the limit: under a flood at the
#: cap, each accept closes an older connection, but asyncio frees that
#: descriptor only on a later turn of its loop, while it accepts up to 100
#: at a time. With 256 to spare, 20,000 held connections still ran the head
#: out of descriptors, and asyncio stops accepting for 1 s after each failure
#: (``/health`` took up to 2.5 s); with one in eight, none failed.
RESERVED_FDS = 256
RESERVED_SHARE = 8
#: The default ``--max-connections`` where the open-file limit is unlimited.
UNLIMITED_DEFAULT = 65536
#: Default ``--read-timeout``, seconds.
READ_TIMEOUT_S = 10.0
#: Seconds between two of :class:`RefusalLog`'s lines, at least.
REPORT_EVERY_S = 1.0
_BUSY_BODY = (b'{"error": {"message": "too many connections (--max-connections); retry later", '
              b'"type": "server_error", "param": null, "code": "busy"}}')
#: What a connection refused because every one is busy gets (before it has sent anything).
BUSY_503 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(_BUSY_BODY) + _BUSY_BODY)
#: errno values of an accept that failed for lack of resources (asyncio's list).
RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def default_max_connections(nofile: int | None = None) -> int:
    """The default ``--max-connections``: the soft open-file limit
    (``RLIMIT_NOFILE``, or ``nofile``) less the larger of
    :data:`RESERVED_FDS` and an eighth of it (:data:`RESERVED_SHARE`), and at
    least 16 (half the limit where it is below 2 x RESERVED_FDS);
    :data:`UNLIMITED_DEFAULT` where the limit is unlimited."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if nofile == resource.RLIM_INFINITY or nofile < 0:
        return UNLIMITED_DEFAULT
    room = nofile - max(RESERVED_FDS, nofile // RESERVED_SHARE) if nofile >= 2 * RESERVED_FDS else nofile // 2
    return max(16, room)


class RefusalLog:
    """Counts connections refused or closed early, and writes at most one line
    per :data:`REPORT_EVERY_S` about them to stderr
    (``ggpipe serve: in the last 1.0 s: 1200 connections over --max-connections ...``).

    Args:
        write: where a line goes (default: stderr).
        clock: monotonic seconds.
    """

    WHAT = {"evicted": "unfinished connections closed for newer ones (--max-connections {cap})",
            "busy": "connections refused with 503, every one busy (--max-connections {cap})",
            "timeout": "connections closed for not sending a whole request within --read-timeout {timeout:g} s",
            "accept_failed": "accepts that failed: {error} (the server retries after 1 s)"}

    def __init__(self, cap: int, timeout_s: float, write=None, clock=time.monotonic):
        self.cap, self.timeout_s = cap, timeout_s
        self.write = write or _stderr
        self.clock = clock
        self.counts: dict[str, int] = {}
        self.error = ""
        self.last = -float("inf")     # when the last line was written
        self.pending: asyncio.TimerHandle | None = None

    def note(self, kind: str, loop: asyncio.AbstractEventLoop | None = None, error: str = "") -> None:
        """Count one event of ``kind`` (a key of WHAT); write the line now if
        the last one is old enough, else once the second is over (``loop``)."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.error = error or self.error
        wait = self.last + REPORT_EVERY_S - self.clock()
        if wait <= 0:
            self.flush()
        elif loop is not None and self.pending is None:
            self.pending = loop.call_later(wait, self.flush)

    def flush(self) -> None:
        """Write the counts so far as one line (nothing when there are none)."""
        self.pending = None
        if not self.counts:
            return
        now = self.clock()
        span = min(now - self.last, 60.0) if self.last > -float("inf") else 0.0
        parts = [f"{n} {self.WHAT[k].format(cap=self.cap, timeout=self.timeout_s, error=self.error)}"
                 for k, n in self.counts.items()]
        self.write(f"ggpipe serve: {'in the last %.1f s: ' % span if span else ''}{'; '.join(parts)}\n")
        self.counts.clear()
        self.last = now


def _stderr(line: str) -> None:
    sys.stderr.write(line)
    sys.stderr.flush()


@dataclass
class ConnectionLimits:
    """The limits of one server, and the connections they govern.

    Attributes:
        max_connections: most open connections.
        read_timeout_s: seconds a request's headers and body may take to arrive.
        log: the refusals' one line a second.
        waiting: connections without a whole request (unfinished headers, or
            idle between requests), oldest first: those closed for a newer one.
    """

    max_connections: int
    read_timeout_s: float = READ_TIMEOUT_S
    log: RefusalLog | None = None
    waiting: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.log is None:
            self.log = RefusalLog(self.max_connections, self.read_timeout_s)
