"""One ``ggpipe bench`` configuration run: the launch (its emulated link and
trace directory in the environment), the record kept of it in
``OUT/runs/<key>.json`` (command, environment, the run's --json summary or
its error), and the description of this machine stored in every record
(versions, git commit, CPU)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from ggpipe.bench.grid import BenchSpec, Config, launch_command
from ggpipe.child_process import child_env
from ggpipe.errors import ConfigError
from ggpipe.transport.launcher_path import find_launcher


# -- environment description -----------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=False, timeout=10).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def environment(launcher: str) -> dict:
    """Versions, git commit, CPU model and core count of this machine."""
    exe = shlex.split(launcher.format(ranks=1))[0]
    mpi = None
    try:
        exe = find_launcher(exe)
    except ConfigError:
        exe = None
    if exe:
        try:
            p = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20, check=False)
            mpi = " ".join((p.stdout or p.stderr).split("\n")[:2]).strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    return {
        "ggpipe": _version("ggpipe"), "llama_cpp_python": _version("llama-cpp-python"),
        "mpi4py": _version("mpi4py"), "numpy": _version("numpy"), "python": platform.python_version(),
        "launcher_version": mpi, "git_commit": _git_commit(), "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(), "host": platform.node(), "platform": platform.platform(),
    }

def run_one(spec: BenchSpec, cfg: Config, prompt_file: Path, out: Path, env_info: dict) -> dict:
    """Launch one configuration and return its record (also on failure: then
    ``status`` is "failed" and ``error`` holds the end of its stderr)."""
    cmd = launch_command(spec, cfg, prompt_file)
    env = child_env()
    env["GGPIPE_LINK"] = cfg.link
    env.setdefault("PYTHONUNBUFFERED", "1")
    trace_dir = None
    if spec.timeline:
        trace_dir = out / "traces" / cfg.key
        shutil.rmtree(trace_dir, ignore_errors=True)
        env["GGPIPE_TRACE_DIR"] = str(trace_dir)
    else:
        env.pop("GGPIPE_TRACE_DIR", None)
    rec = {"config": cfg.__dict__ | {"key": cfg.key}, "command": cmd,
           "env": {k: env[k] for k in ("GGPIPE_LINK", "GGPIPE_TRACE_DIR") if k in env},
           "threads": spec.threads, "n": spec.n, "target": spec.target, "draft": spec.draft,
           "environment": env_info, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=spec.timeout_s, env=env, check=False,
                           stdin=subprocess.DEVNULL)
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = None, "", f"timed out after {spec.timeout_s:.0f} s\n{exc.stderr or ''}"
    rec["wall_s"] = time.perf_counter() - t0
    rec["returncode"] = rc
    if rc == 0:
        try:
            rec["result"] = json.loads(stdout)
            rec["status"] = "ok"
        except json.JSONDecodeError:
            rec["status"], rec["error"] = "failed", "unreadable --json output: " + stdout[-500:]
    else:
        rec["status"] = "failed"
        rec["error"] = (stderr if isinstance(stderr, str) else stderr.decode("utf-8", "replace"))[-3000:]
    if trace_dir is not None and rec["status"] == "ok" and trace_dir.exists():
        roles = {r["rank"]: r.get("model", "") + (f" layers {r['layers'][0]}-{r['layers'][1] - 1}"
                                                  if r.get("layers") else "")
                 for r in rec["result"].get("ranks", [])}
        (trace_dir / "meta.json").write_text(json.dumps({"key": cfg.key, "roles": roles}))
    return rec


def save_record(out: Path, rec: dict) -> None:
    """Write ``rec`` to ``OUT/runs/<key>.json`` (its ``config.key``), through a
    temporary file and a rename, so a stored record is never half written."""
    path = out / "runs" / f"{rec['config']['key']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=1))
    tmp.replace(path)


def load_record(out: Path, cfg: Config) -> dict | None:
    """The stored record of ``cfg`` (``OUT/runs/<key>.json``), or None when it
    is absent or unreadable."""
    path = out / "runs" / f"{cfg.key}.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
