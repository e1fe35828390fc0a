"""The ``GGPIPE_*`` environment variables ggpipe reads, checked when a command
starts (:func:`check_environment`, called by the ``ggpipe`` command before
any of its subcommands runs), so that a bad value is one line before any
work instead of a value silently ignored, a line per rank, or a traceback
at exit. Under MPI every rank checks and the head prints the line
(``cli/main.py``'s start-up error path); without MPI the same check runs.

Each variable is checked by the code that reads it (its parser raises
:class:`~ggpipe.errors.ConfigError`); this module only calls them in turn.
``GGPIPE_API_KEY`` is checked by ``serve``, the only command that reads it;
``GGPIPE_VERBOSE``, ``GGPIPE_JOB_KEY`` and ``GGPIPE_READY_FILE`` (set by
``--ranks``' supervisor) take any value.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from ggpipe.errors import ConfigError


def _link(env: Mapping[str, str]) -> None:
    from ggpipe.transport import link  # noqa: PLC0415

    try:
        link.from_env(env)
    except ConfigError as e:
        raise ConfigError(f"GGPIPE_LINK={env['GGPIPE_LINK']!r}: {e}") from None


def _fault(env: Mapping[str, str]) -> None:
    from ggpipe.runtime import faults  # noqa: PLC0415
    from ggpipe.transport.launcher_signal import launched_size  # noqa: PLC0415

    # the job's ranks as the launcher gives them (one without a launcher)
    faults.planned(0, True, dict(env), n_ranks=launched_size() or 1)


def _lookahead(env: Mapping[str, str]) -> None:
    from ggpipe.decoding.parallel.lone_drafts import lookahead_setting  # noqa: PLC0415

    lookahead_setting(env)


def _init_timeout(env: Mapping[str, str]) -> None:
    from ggpipe.transport.init_watchdog import init_timeout_s  # noqa: PLC0415

    init_timeout_s(env, strict=True)


def _first_run_id(env: Mapping[str, str]) -> None:
    from ggpipe.runs import parse_first_run_id  # noqa: PLC0415

    parse_first_run_id(env.get("GGPIPE_FIRST_RUN_ID", ""))


def _guard(env: Mapping[str, str]) -> None:
    v = env.get("GGPIPE_GUARD")
    if v is not None and v.strip() not in ("0", "1"):
        raise ConfigError(f"GGPIPE_GUARD={v!r}: use 1 (a guard process per rank, the default) or 0 (none)")


def _models(env: Mapping[str, str]) -> None:
    v = env.get("GGPIPE_MODELS")
    if v and not Path(v).expanduser().is_file():
        raise ConfigError(f"GGPIPE_MODELS={v!r}: no such file (it names the models.toml registry to read)")


def check_trace_dir(directory: str) -> None:
    """``GGPIPE_TRACE_DIR``: a folder that exists or can be made, and in which
    a file can be written (tried: a temporary file, removed at once). The
    folder is made here, as the traces would make it at exit.

    Raises:
        ConfigError: it is a file, cannot be made, or cannot be written in.
    """
    d = Path(directory).expanduser()
    what = f"GGPIPE_TRACE_DIR={directory!r}"
    if d.exists() and not d.is_dir():
        raise ConfigError(f"{what} is not a folder; the traces (rank<R>.jsonl) go into a folder")
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".ggpipe-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"{what}: cannot write the traces there ({e.strerror or e})") from None


def _trace_dir(env: Mapping[str, str]) -> None:
    v = env.get("GGPIPE_TRACE_DIR")
    if v:
        try:
            check_trace_dir(v)
        except ConfigError:
            from ggpipe import trace  # noqa: PLC0415

            trace.discard()   # nor a second line about it at exit
            raise


#: The checks, in the order they run: (variable, check).
CHECKS: tuple[tuple[str, Callable[[Mapping[str, str]], None]], ...] = (
    ("GGPIPE_LINK", _link), ("GGPIPE_FAULT", _fault), ("GGPIPE_LOOKAHEAD", _lookahead),
    ("GGPIPE_INIT_TIMEOUT", _init_timeout), ("GGPIPE_FIRST_RUN_ID", _first_run_id), ("GGPIPE_GUARD", _guard),
    ("GGPIPE_MODELS", _models), ("GGPIPE_TRACE_DIR", _trace_dir),
)


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """Check every ``GGPIPE_*`` variable set in ``env`` (default: the process's).

    Raises:
        ConfigError: the first bad one, naming it and what it accepts.
    """
    env = os.environ if env is None else env
    for name, check in CHECKS:
        if env.get(name):
            check(env)
