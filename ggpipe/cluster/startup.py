"""The start-up exchange of a job's ranks (steps 1, 2, 4 and 5 of
ggpipe.cluster.session's start-up): HELLO, GO, READY, GO.

:func:`meet` is HELLO and the head's GO (the ranks' arguments compared, every
rank's host and pid shared); :func:`ready` is READY and the head's last GO
(every rank loaded, or the first error, named). Every wait is bounded.

A rank that fails before it reaches HELLO (a usage error, a bad option value:
:func:`report_startup_error`) still initialises MPI and sends a HELLO
carrying its error (and its exit code) instead of a digest, so the job meets,
the head prints one line naming that rank, and every rank exits within
seconds with that error's code (2 for a usage error, as when every rank has
it; a launcher such as hydra ORs the ranks' codes, so one rank's 2 beside
the others' 1 gave 3). Without it the other ranks would wait inside
``MPI_Init`` for a process that never comes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from ggpipe.cluster.config import ClusterConfig
from ggpipe.errors import ConfigError, GGPipeError, RankFailedError, RankTimeoutError
from ggpipe.metrics import rank_info
from ggpipe.transport import messages as m
from ggpipe.transport.init_watchdog import init_timeout_s
from ggpipe.transport.launcher_signal import check_launcher_signal
from ggpipe.transport.mpi import Transport, mpi_world, thread_level_problem


def _exchange(t: Transport, rank: int, size: int, payload: dict, what: str, timeout_s: float):
    """Worker: send ``payload`` to the head and wait for its verdict. Head:
    collect every worker's payload. Returns the list (head) or verdict (worker)."""
    if rank == 0:
        return [payload] + [t.recv_obj(r, m.T_HELLO if what == "hello" else m.T_READY, f"its {what}", timeout_s)
                            for r in range(1, size)]
    t.send_obj(0, m.T_HELLO if what == "hello" else m.T_READY, payload)
    return t.recv_obj(0, m.T_GO, f"the head's answer to {what}", timeout_s)


def _verdict(t: Transport, size: int, error: str | None, extra: dict | None = None) -> None:
    for r in range(1, size):
        t.send_obj(r, m.T_GO, dict(ok=error is None, error=error, **(extra or {})))
    t.flush(10.0)


_startup = {"entered": False}  # open_session has begun meeting the other ranks


def startup_entered() -> bool:
    """True once this process has begun the start-up exchange (HELLO)."""
    return _startup["entered"]


def enter_startup() -> None:
    """This process meets the other ranks by other means than
    :func:`open_session` (``ggpipe calibrate``): an error from now on ends
    the job (MPI_Abort) instead of being carried by a HELLO."""
    _startup["entered"] = True


def report_startup_error(message: str, timeout_s: float | None = None,
                         exit_code: int = 1) -> tuple[str | None, int]:
    """Meet the other ranks with an error instead of a HELLO (see the module
    docstring) and return the line this rank should print and the code to
    exit with. The line: on the head, its own error (it is the first); on a
    worker, None when the head answered (the head prints it), else its own
    error naming its rank. The code: ``exit_code`` (this error's), or on a
    worker the head's verdict's (the code of the error the head prints), so
    every rank exits with the same code. Without an MPI launcher, or in a job
    of one rank: ``(message, exit_code)``.

    Every wait is bounded by ``timeout_s`` seconds (default
    ``GGPIPE_INIT_TIMEOUT``, 30 s; it ends early when the launcher signals
    that another rank has ended).
    """
    if _startup["entered"]:
        return message, exit_code
    _startup["entered"] = True
    timeout_s = init_timeout_s() if timeout_s is None else timeout_s
    try:
        world = mpi_world()
    except Exception:  # noqa: BLE001 - no MPI library: report locally
        return message, exit_code
    if world is None or world[2] == 1:
        return message, exit_code
    comm, rank, size = world
    transport = Transport(comm, timeout_s=timeout_s, emulate_link=False)
    transport.interrupt = check_launcher_signal
    me = rank_info(rank)
    hello = {"digest": None, "error": message, "code": exit_code, "host": me["host"], "pid": me["pid"],
             "cpus": None}
    try:
        got = _exchange(transport, rank, size, hello, "hello", timeout_s)
    except GGPipeError as exc:
        return (message if rank == 0 else f"rank {rank} ({me['host']}): {message} (and then: {exc})"), exit_code
    if rank == 0:
        _verdict(transport, size, message, {"hosts": [g["host"] for g in got], "pids": [g["pid"] for g in got],
                                            "code": exit_code})
        return message, exit_code
    return None, _code(got)


def _code(h: dict) -> int:
    """The exit code a HELLO or verdict carries (1 where it carries none)."""
    code = h.get("code")
    return code if isinstance(code, int) and not isinstance(code, bool) and 0 < code < 256 else 1


def _first_error(got: list[dict]) -> tuple[str, int] | None:
    """The first error a HELLO carries (rank order), named by rank and host,
    with its exit code."""
    for r, h in enumerate(got):
        if h.get("error"):
            return (h["error"] if r == 0 else f"rank {r} ({h['host']}): {h['error']}"), _code(h)
    return None


def meet(world: tuple, config: ClusterConfig, argv: list[str] | None,
         offer: dict | None = None) -> tuple[int, int, Transport, list[str], list[int], list, dict]:
    """Steps 1 and 2 (HELLO, GO) in the MPI ``world`` (comm, rank, size):
    returns this rank, the job's size, the transport, every rank's host and
    pid, every rank's CPU affinity (a list of CPU ids, or None where
    unknown), and what the head decided for every rank before loading
    (``offer``, given on the head: a JSON-able dict; {} when none). ``argv``
    (default ``sys.argv[1:]``) must be the same on every rank: its digest,
    with the config's, is compared.

    Raises:
        ConfigError: on the head, a rank's error or different arguments.
        RankFailedError: on a worker, when the head stops the job.
        RankTimeoutError: a rank that sent no HELLO within ``GGPIPE_INIT_TIMEOUT``.
    """
    comm, rank, size = world
    _startup["entered"] = True
    transport = Transport(comm, timeout_s=config.timeout_s)
    args = sys.argv[1:] if argv is None else argv
    digest = hashlib.sha256((config.digest() + json.dumps(list(args))).encode()).hexdigest()[:16]
    me = rank_info(rank)
    hello = {"digest": digest, "host": me["host"], "pid": me["pid"], "cpus": me["cpu_affinity"],
             "error": thread_level_problem()}
    transport.interrupt = check_launcher_signal  # a rank that ends before the heartbeats start
    # MPI_Init synchronises the processes, and each sends its HELLO right after it: a rank that has
    # not done so within the start-up bound is not a ggpipe rank of this job, or has ended
    try:
        got = _exchange(transport, rank, size, hello, "hello", init_timeout_s())
    except RankTimeoutError as exc:
        raise RankTimeoutError(f"{exc.waited_for}: that rank did not start a ggpipe job within "
                               f"{init_timeout_s():g} s of MPI start-up: it runs another command, or it ended "
                               f"(its own output says which; GGPIPE_INIT_TIMEOUT sets the limit)") from None
    if rank == 0:
        hosts = [h["host"] for h in got]
        if os.environ.get("GGPIPE_VERBOSE"):
            for r, h in enumerate(got):
                sys.stderr.write(f"ggpipe: rank {r}: host {h['host']}, pid {h['pid']}, "
                                 f"CPU affinity {_cpu_list(h['cpus'])}\n")
        bad = [r for r, h in enumerate(got) if h["digest"] != hello["digest"]]
        err, code = _first_error(got) or (None, 1)
        if bad and err is None:
            err = (f"rank {bad[0]} ({hosts[bad[0]]}) was started with different arguments than rank 0: "
                   f"start every rank with the same ggpipe command")
        _verdict(transport, size, err, {"hosts": hosts, "pids": [h["pid"] for h in got],
                                        "cpus": [h.get("cpus") for h in got], "code": code, "offer": offer or {}})
        if err:
            exc = ConfigError(err)
            exc.exit_code = code  # a usage error on another rank exits 2 here too
            raise exc
    else:
        if not got["ok"]:
            exc = RankFailedError(got["error"])
            exc.exit_code = _code(got)
            raise exc
        hosts = got["hosts"]
    transport.hosts = hosts
    pids = [h["pid"] for h in got] if rank == 0 else got["pids"]
    cpus = [h.get("cpus") for h in got] if rank == 0 else (got.get("cpus") or [None] * size)
    agreed = (offer or {}) if rank == 0 else got.get("offer", {})
    return rank, size, transport, hosts, pids, cpus, agreed


def ready(transport: Transport, rank: int, size: int, err: str | None, role: str | None, timeout_s: float,
          described: dict[int, str]) -> GGPipeError | None:
    """Steps 4 and 5 (READY, GO) after loading: ``err`` is this rank's load
    error (or None), ``role`` what it loaded (or None). The head adds every
    rank's role to ``described``. Returns the error that stops the job (on
    the head the first one of any rank, named; on a worker a RankFailedError
    with the head's message), or None: serve.
    """
    got = _exchange(transport, rank, size, {"ok": err is None, "error": err, "role": role}, "ready", timeout_s)
    if rank == 0:
        described.update({r: g.get("role") for r, g in enumerate(got) if g.get("role")})
        first = err and (0, err) or next(((r, g["error"]) for r, g in enumerate(got) if not g["ok"]), None)
        msg = None
        if first:
            r, e = first
            msg = e if (r == 0 or e == err) else f"{transport.name(r)}: {e}"
        _verdict(transport, size, msg)
        return GGPipeError(msg) if msg else None
    return None if got["ok"] else RankFailedError(got["error"])


def _cpu_list(cpus: list[int] | None) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    if not cpus:
        return "unknown"
    out, start = [], cpus[0]
    for a, b in zip(cpus, cpus[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ",".join(out)
