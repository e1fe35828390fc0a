"""The ``ggpipe`` command (click).

    mpiexec -n 2 ggpipe generate -p "Tell me about MPI" -n 64
    ggpipe models list | fetch NAME | path NAME
    ggpipe split MODEL --split 0.3,0.7 -o DIR

Errors a user can cause print one line, ``ggpipe: error: ...``, and exit 1
(usage errors: 2; a traceback only with ``-v``). Under MPI only the head
prints it; a worker that fails on its own prints its line (naming its rank)
and aborts the job so nothing hangs. An error before the ranks have met is
carried to the head by the start-up exchange (``cluster/startup.py``), and
every rank exits with its code. Ctrl-C (``mpiexec`` forwards SIGINT to every
rank): the head prints ``ggpipe: interrupted`` and ends the job (exit 130);
a worker says nothing unless the head did not end the job within
:data:`WORKER_INTERRUPT_GRACE_S` (only that worker was interrupted).
"""


from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback

import click

from ggpipe.cli.bench import bench_command, timeline_command
from ggpipe.cli.jobs import batch, chat, generate, serve
from ggpipe.cli.models import models_group, split_command
from ggpipe.cli.plan import plan
from ggpipe.cli.sim import calibrate_command, simulate_command
from ggpipe.env_check import check_environment
from ggpipe.errors import GGPipeError, RankFailedError
from ggpipe.transport.launcher_signal import launched_rank

_state = {"verbose": 0}

#: Seconds a worker that got SIGINT waits for the head (which got it too, from mpiexec) to end the job
#: before it says so itself: the head's abort comes 0.5 s after its line (transport/mpi.py, abort_world).
WORKER_INTERRUPT_GRACE_S = 3.0


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="Show llama.cpp's log, per-rank details and tracebacks.")
@click.version_option(package_name="ggpipe")
def cli(verbose: int) -> None:
    """Pipeline-parallel GGUF inference over MPI (PipeInfer)."""
    _state["verbose"] = verbose
    check_environment()   # every GGPIPE_* variable, before any work (one line from the head under MPI)
    if verbose:
        os.environ["GGPIPE_VERBOSE"] = "1"  # per-rank details (CPU affinity) at start-up
    from ggpipe.runtime import llama  # noqa: PLC0415

    llama.set_verbose(verbose > 1)


cli.add_command(generate)
cli.add_command(chat)
cli.add_command(batch)
cli.add_command(serve)
cli.add_command(plan)
cli.add_command(models_group)
cli.add_command(split_command)
cli.add_command(bench_command)
cli.add_command(timeline_command)
cli.add_command(calibrate_command)
cli.add_command(simulate_command)


def _abort_mpi(code: int) -> None:
    """End the whole job (``MPI_Abort``) once this rank's line is out; no-op
    outside a job of several ranks."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.COMM_WORLD.Get_size() > 1:
        from ggpipe.transport.mpi import abort_world

        _quiet_stderr()
        abort_world(mpi.COMM_WORLD, code)


def _quiet_stderr() -> None:
    """Send what this process writes to fd 2 from now on to /dev/null: MPICH
    prints its own "Abort(130) on node 0 (rank 0 in comm 0): application
    called MPI_Abort(...)" inside ``MPI_Abort``, a second line after
    ggpipe's (``MPIR_CVAR_SUPPRESS_ABORT_MESSAGE`` drops only its second
    half). What was written before is already in the pipe."""
    try:
        sys.stderr.flush()
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 2)
        os.close(fd)
    except (OSError, ValueError):
        pass


def _usage_line(exc: click.ClickException) -> str:
    """A click error as one line, with where to find help."""
    msg = exc.format_message()
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click.UsageError) and ctx is not None:
        msg += f" (see '{ctx.command_path} --help')"
    return msg


def _fail(message: str, code: int, abort_job: bool = False) -> None:
    """Print ``message`` as this rank's one error line (if it is this rank's
    to print) and exit with ``code``."""
    rank = launched_rank() or 0
    if launched_rank() is not None:
        from ggpipe.cluster.startup import report_startup_error, startup_entered  # noqa: PLC0415

        if not startup_entered():  # before the ranks have met: meet them with it, so no rank waits for this one
            line, code = report_startup_error(message, exit_code=code)
            if line is not None:
                sys.stderr.write(f"ggpipe: error: {line}\n")
                if rank != 0:
                    _abort_mpi(code)
            sys.exit(code)
    if rank == 0:
        sys.stderr.write(f"ggpipe: error: {message}\n")
        if abort_job:
            _abort_mpi(code)
        sys.exit(code)
    sys.stderr.write(f"ggpipe: error: rank {rank}: {message}\n")
    _abort_mpi(code)
    sys.exit(code)


def _interrupted() -> None:
    """Ctrl-C (KeyboardInterrupt, click's Abort): one line from the head,
    exit 130, the job ended (``MPI_Abort``)."""
    rank = launched_rank()
    if rank:  # a worker: mpiexec forwarded SIGINT to every rank, and the head says it once
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        from ggpipe.transport import rank_guard  # noqa: PLC0415

        rank_guard.mark_reported()  # the head's line says why this rank ends: its guard stays quiet
        time.sleep(WORKER_INTERRUPT_GRACE_S)  # the head's MPI_Abort (or the launcher) ends this process first
        sys.stderr.write(f"ggpipe: error: rank {rank} ({socket.gethostname()}) was interrupted (SIGINT) and the "
                         f"head was not; stopping every rank\n")
    else:
        sys.stderr.write("ggpipe: interrupted\n")
    _abort_mpi(130)
    sys.exit(130)


def main(argv=None) -> None:
    """Runs the click CLI and turns errors into one line (the console entry
    point is :func:`ggpipe.__main__.main`, which calls this).

    An error before the ranks have met (a usage error, a bad option value on
    any rank) still meets them, so the job ends within seconds with one line
    from the head naming the rank, instead of leaving the others in
    ``MPI_Init``."""
    rank = launched_rank() or 0
    try:
        cli.main(args=argv, prog_name="ggpipe", standalone_mode=False)
    except click.exceptions.Abort:
        _interrupted()
    except click.ClickException as exc:
        _fail(_usage_line(exc), exc.exit_code)
    except RankFailedError as exc:
        # The head reports the error that stopped the job; workers exit quietly, with its code.
        if _state["verbose"]:
            traceback.print_exc()
        sys.exit(exc.exit_code)
    except GGPipeError as exc:
        if _state["verbose"]:
            traceback.print_exc()
        _fail(str(exc), exc.exit_code, exc.abort_job)
    except KeyboardInterrupt:
        _interrupted()
    except SystemExit:
        raise
    except BaseException:  # a bug: show it, and never leave the other ranks hanging
        sys.stderr.write(f"ggpipe: internal error on rank {rank}:\n")
        traceback.print_exc()
        _abort_mpi(2)
        sys.exit(2)
    sys.exit(0)


if __name__ == "__main__":
    main()
