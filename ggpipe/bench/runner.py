"""Launching ``ggpipe generate --json`` runs for benchmarks (one process per
configuration, under ``mpiexec -n R`` when R is given)."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

from ggpipe.child_process import child_env, ggpipe_command
from ggpipe.transport.launcher_path import find_launcher

# One prompt per category of PipeInfer's evaluation (V.A): code generation
# without explanation, a story about a warrior named Goliath, an encyclopedic text.
PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome. Give only the code.",
    "Tell me a story about a warrior named Goliath who guards a mountain pass.",
    "Explain what the Message Passing Interface (MPI) is, as an encyclopedia would.",
]


def ggpipe_run(model: str, prompt: str, n: int, ranks: int | None, args: list[str] = (),
               timeout_s: float = 1800, cwd: str | None = None, env: dict | None = None) -> dict:
    """Run one greedy generation of exactly ``n`` tokens (--ignore-eos) and
    return its --json summary. ``cwd``: the runs' working directory (the
    run imports the ggpipe this process runs, whatever ``cwd`` holds:
    ggpipe/child_process.py); ``env``: the runs' environment (default: this
    process's).

    Raises:
        SystemExit: the run failed (its stderr is shown).
    """
    cmd = [*ggpipe_command(), "generate", "-m", model, "-p", prompt, "-n", str(n), "--ignore-eos",
           "--json", *args]
    if ranks is not None:
        cmd = [find_launcher("mpiexec"), "-n", str(ranks), *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, cwd=cwd,
                       env=child_env(env))
    if p.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return json.loads(p.stdout)


def median_of(records: list[dict], key: str) -> float:
    """Median of ``key`` over the records that have it (NaN when none does)."""
    v = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(v) if v else float("nan")


def publish(text: str, md: str | None = None, json_path: str | None = None, data=None) -> None:
    """Print a result table; also write it to ``md`` and ``data`` as JSON to ``json_path`` when given."""
    print(text)
    if md:
        Path(md).write_text(text + "\n")
    if json_path:
        Path(json_path).write_text(json.dumps(data, indent=1))
