"""Entry point of the ``ggpipe`` command and of ``python -m ggpipe``.

Under an MPI launcher, first the rank forks off its guard, a parent process
that names the rank if it dies of a signal, whatever the launcher then does to
the others (``ggpipe/transport/rank_guard.py``); then the launcher's SIGUSR1
is taken over before the CLI's imports (a few hundred ms) run, so a rank that
ends during start-up is reported instead of silently killing the others
(``ggpipe/transport/launcher_signal.py``).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """Run ``ggpipe ARGV`` (default: ``sys.argv[1:]``); exits the process."""
    from ggpipe.transport import rank_guard
    from ggpipe.transport.launcher_signal import ignore_launcher_signal, launched_rank, watch_launcher_signal

    if launched_rank() is not None and rank_guard.enabled():
        rank_guard.start(launched_rank())         # returns in the rank; its guard waits for it
    if launched_rank() == 0:
        _enlarge_stdin_pipe()                     # before the imports: the launcher may be pushing stdin already
    if launched_rank() is not None:
        import atexit

        watch_launcher_signal()                   # until the heartbeat watch takes SIGUSR1 over
        atexit.register(ignore_launcher_signal)   # and through MPI_Finalize
    from ggpipe.cli.main import main as cli_main

    cli_main(argv)


def _enlarge_stdin_pipe() -> None:
    """Let stdin's pipe hold up to ``/proc/sys/fs/pipe-max-size`` (often
    1 MiB) instead of 64 KiB. MPICH's hydra forwards rank 0's stdin without
    back-pressure and ends the job ("process reading stdin too slowly") when
    a burst does not fit the pipe before the rank reads it (chat reads stdin
    on a thread once it runs: ggpipe/frontends/chat.py). Linux only; else nothing."""
    import os
    import stat

    try:
        import fcntl

        if stat.S_ISFIFO(os.fstat(0).st_mode):
            with open("/proc/sys/fs/pipe-max-size") as f:
                size = int(f.read())
            fcntl.fcntl(0, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
    except (OSError, ValueError, ImportError):
        pass


if __name__ == "__main__":
    main()
