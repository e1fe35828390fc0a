"""Entry point of the ``ggpipe`` command and of ``python -m ggpipe``.

Under an MPI launcher the launcher's SIGUSR1 is taken over before the CLI's
imports (a few hundred ms) run, so a rank that ends during start-up is
reported instead of silently killing the others
(``ggpipe/transport/launcher_signal.py``).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """Run ``ggpipe ARGV`` (default: ``sys.argv[1:]``); exits the process."""
    from ggpipe.transport.launcher_signal import ignore_launcher_signal, launched_rank, watch_launcher_signal

    if launched_rank() is not None:
        import atexit

        watch_launcher_signal()                   # until the heartbeat watch takes SIGUSR1 over
        atexit.register(ignore_launcher_signal)   # and through MPI_Finalize
    from ggpipe.frontends.cli import main as cli_main

    cli_main(argv)


if __name__ == "__main__":
    main()
