"""uvicorn's h11 protocol and server with ggpipe's connection limits
(:class:`~ggpipe.frontends.serve.http_limits.ConnectionLimits`: the cap on open
connections, the read time limit, one log line a second about refusals).

The protocol is h11's in every install (with ``httptools`` installed uvicorn
would pick its own protocol, which these limits do not cover).
"""

from __future__ import annotations

import asyncio
import functools
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ggpipe.errors import ConfigError
from ggpipe.frontends.serve.http_limits import BUSY_503, RESOURCE_ERRNOS, ConnectionLimits


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with ``limits`` (:class:`ConnectionLimits`):
    the connection cap at accept time, and the read time limit of each
    request."""

    def __init__(self, *args, limits: ConnectionLimits, **kw):
        super().__init__(*args, **kw)
        self.limits = limits
        self.read_deadline: asyncio.TimerHandle | None = None

    # -- the cap -----------------------------------------------------------------------------

    def connection_made(self, transport) -> None:  # type: ignore[override]
        limits = self.limits
        if len(self.connections) >= limits.max_connections:
            oldest = next(iter(limits.waiting), None)
            if oldest is None:              # every connection is busy with a request: refuse this one
                transport.write(BUSY_503)
                transport.close()
                limits.log.note("busy", self.loop)
                return
            oldest.close_now()
            limits.log.note("evicted", self.loop)
        super().connection_made(transport)
        self._arm_read_deadline()
        self._track()

    def connection_lost(self, exc) -> None:
        if self.transport is None:          # refused in connection_made: uvicorn never saw it
            return
        self._disarm_read_deadline()
        self.limits.waiting.pop(self, None)
        super().connection_lost(exc)

    def close_now(self) -> None:
        """Close this connection (it has no request being answered)."""
        self._disarm_read_deadline()
        self.limits.waiting.pop(self, None)
        if not self.transport.is_closing():
            self.transport.close()

    def _track(self) -> None:
        """Keep :attr:`ConnectionLimits.waiting` in step: this connection is
        in it while it has not sent a whole request's headers."""
        waiting = self.limits.waiting
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            waiting.setdefault(self, None)
        else:
            waiting.pop(self, None)

    # -- the read time limit -----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.read_deadline is None and self.conn.their_state is h11.IDLE:
            self._arm_read_deadline()       # the first byte of the next request
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm_read_deadline()    # the whole request is in (or the connection is ending)
        self._track()

    def on_response_complete(self) -> None:
        """uvicorn's end of a response (which arms its keep-alive timer); a
        connection now idle again goes to the end of ``limits.waiting``, so it is
        the last idle one to be evicted."""
        super().on_response_complete()      # arms uvicorn's keep-alive timer for the idle wait
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.limits.waiting.pop(self, None)
            self.limits.waiting[self] = None   # idle again: at the end of the line

    def _arm_read_deadline(self) -> None:
        self._disarm_read_deadline()
        self.read_deadline = self.loop.call_later(self.limits.read_timeout_s, self._read_timed_out)

    def _disarm_read_deadline(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _read_timed_out(self) -> None:
        self.read_deadline = None
        if not self.transport.is_closing():
            self.limits.log.note("timeout", self.loop)
            self.close_now()


class GuardedServer(uvicorn.Server):
    """uvicorn's server whose event loop counts failed accepts into
    ``limits.log`` instead of logging a traceback for each (other errors go
    to the loop's default handler)."""

    def __init__(self, config: uvicorn.Config, limits: ConnectionLimits):
        super().__init__(config)
        self.limits = limits

    async def startup(self, sockets=None) -> None:
        """uvicorn's start-up, after installing the event loop's exception handler
        that counts failed accepts (EMFILE, ENFILE, ...) into ``limits.log``."""
        asyncio.get_running_loop().set_exception_handler(self._loop_error)
        await super().startup(sockets)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
            self.limits.log.note("accept_failed", loop, f"{exc.strerror} (errno {exc.errno})")
            return
        loop.default_exception_handler(context)


def guarded_config(app, limits: ConnectionLimits, **kw) -> uvicorn.Config:
    """A ``uvicorn.Config`` for ``app`` whose connections obey ``limits``
    (``kw``: uvicorn.Config's other settings). Serve it with
    ``GuardedServer(config, limits)``."""
    return uvicorn.Config(app, http=functools.partial(GuardedH11Protocol, limits=limits), **kw)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: any free port).

    Raises:
        ConfigError: the address cannot be resolved or bound (in use, no permission).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock
