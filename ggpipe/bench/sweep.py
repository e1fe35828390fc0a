"""``ggpipe bench``: run a grid of configurations, one ``ggpipe generate --json``
run at a time, and collect their metrics into a resumable results directory.

A configuration is (link, ranks, prompt, repeat, mode). Each is launched with
the launcher template (default ``mpiexec -n {ranks}``), with the emulated link
in ``GGPIPE_LINK`` and, with ``timeline``, ``GGPIPE_TRACE_DIR`` in its
environment. Results directory layout::

    OUT/runs/<key>.json     one per configuration: command, environment, versions,
                            git commit, CPU, threads, the run's --json summary, exactness
    OUT/prompts/<id>.txt    the exact prompt text fed to every run (chat template applied)
    OUT/results.csv         one tidy row per configuration (see COLUMNS)
    OUT/summary.md          the aggregated table (mean over prompts and repeats)
    OUT/*.png               plots (ggpipe.bench.plots)
    OUT/traces/<key>/       per-rank traces, OUT/timelines/<key>.png/.trace.json (timeline)

A configuration whose ``runs/<key>.json`` holds a successful run with the same
fingerprint (models, token count, threads, extra arguments, prompt text) is not
run again.

Exactness: every run's tokens are compared with the tokens of the first mode
of ``modes`` on the same prompt (greedy sampling makes them equal by design);
a difference sets ``exact`` to False and ``first_diff`` to the first differing
token index, and is reported loudly.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ggpipe.transport.launcher_path import find_launcher
from ggpipe.errors import ConfigError
from ggpipe.transport.link import format_link, parse_link

# mode name -> ggpipe generate arguments
MODE_ARGS = {
    "iterative": ["--mode", "iterative"],
    "speculative": ["--mode", "speculative"],
    "pipeinfer": ["--mode", "pipeinfer"],
    "pipeinfer-no-cancel": ["--mode", "pipeinfer", "--no-cancel"],
    "pipeinfer-no-continuous": ["--mode", "pipeinfer", "--no-continuous"],
    "pipedec": ["--mode", "pipedec"],
    "pipedec-tree": ["--mode", "pipedec", "--tree-width", "4", "--max-children", "4"],
    "vote": ["--mode", "pipeinfer", "--spec-type", "vote"],
}

COLUMNS = [
    "mode", "ranks", "link", "prompt", "repeat", "status", "exact", "first_diff", "n_prompt", "n_gen_tokens",
    "tokens_per_s", "ttft_ms", "itl_mean_ms", "itl_p50_ms", "itl_p90_ms", "acceptance_rate", "accepted_per_pass",
    "runs_cancelled", "aborted_mid_compute", "skipped_before_start", "peak_rss_mib_max", "peak_rss_mib_per_rank",
    "peak_pss_mib_per_rank", "tokens_per_s_per_mb", "wall_s", "threads", "target", "draft", "n", "key",
]
"""Columns of results.csv. Units: tokens/s (generation only, PipeInfer V.A),
milliseconds for TTFT/ITL (ITL p50/p90 over per-acceptance gaps), MiB for
memory, ``tokens_per_s_per_mb`` = tokens/s divided by the largest per-rank
peak RSS in MB (10^6 bytes; the memory a node needs), seconds for wall_s."""


@dataclass(frozen=True)
class Config:
    """One benchmark run."""

    mode: str
    ranks: int
    link: str      # canonical link text (format_link), "shm" for none
    prompt: str    # prompt id
    repeat: int

    @property
    def key(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9.]+", "-", self.link)
        return f"{self.mode}_r{self.ranks}_{slug}_{self.prompt}_{self.repeat}"


@dataclass
class BenchSpec:
    """Everything ``ggpipe bench`` was asked for.

    Attributes:
        target, draft: model names or paths (draft None: only iterative).
        modes: mode names (keys of MODE_ARGS); the first is the exactness reference.
        ranks: rank counts.
        links: link texts (``shm``, ``1gbit,200us``, ...).
        prompts: dicts with id/category/prompt (ggpipe.bench.prompts).
        n: tokens generated per run (--ignore-eos: exactly n).
        repeat: runs per configuration.
        threads: -t value passed to every run (per rank).
        launcher: command prefix template with ``{ranks}``.
        extra_args: more ``ggpipe generate`` arguments for every run.
        chat: wrap prompts in the target's chat template.
        timeline: record per-rank traces and draw a timeline per run.
        timeout_s: wall-clock limit of one run (s).
    """

    target: str
    draft: str | None
    modes: list[str]
    ranks: list[int]
    links: list[str] = field(default_factory=lambda: ["shm"])
    prompts: list[dict] = field(default_factory=list)
    n: int = 128
    repeat: int = 1
    threads: str = "1"
    launcher: str = "mpiexec -n {ranks}"
    extra_args: list[str] = field(default_factory=list)
    chat: bool = True
    timeline: bool = False
    timeout_s: float = 1800.0

    def validate(self) -> BenchSpec:
        """Raises ConfigError on an unknown mode, a speculative mode without a
        draft, bad rank counts, bad links, or a launcher without {ranks}."""
        if not self.modes:
            raise ConfigError("give at least one mode with --modes")
        for m in self.modes:
            if m not in MODE_ARGS:
                raise ConfigError(f"unknown mode {m!r}: choose from {', '.join(MODE_ARGS)}")
            if m != "iterative" and not self.draft:
                raise ConfigError(f"mode {m} needs a draft model: give one with -md (e.g. -md smollm2-135m)")
        if len(set(self.modes)) != len(self.modes):
            raise ConfigError("a mode is listed twice in --modes")
        if not self.ranks or any(r < 1 for r in self.ranks):
            raise ConfigError("--ranks must list positive rank counts, e.g. 2,3,4")
        self.links = [format_link(parse_link(x)) for x in self.links]
        if len(set(self.links)) != len(self.links):
            raise ConfigError("a link is listed twice in --link")
        if "{ranks}" not in self.launcher:
            raise ConfigError(f"--launcher {self.launcher!r} must contain {{ranks}}, e.g. 'mpiexec -n {{ranks}}'")
        exe = shlex.split(self.launcher.format(ranks=1))[0] if self.launcher.strip() else ""
        if exe in ("mpiexec", "mpirun"):
            find_launcher(exe)  # one line now rather than a failed run per configuration
        if self.n < 1 or self.repeat < 1:
            raise ConfigError("-n and --repeat must be at least 1")
        if not self.prompts:
            raise ConfigError("the prompt set is empty")
        return self

    def configs(self) -> list[Config]:
        """All configurations, the first mode first within each (link, ranks, prompt, repeat)."""
        return [Config(mode, r, link, p["id"], rep) for link in self.links for r in self.ranks
                for p in self.prompts for rep in range(self.repeat) for mode in self.modes]

    def fingerprint(self, prompt_text: str) -> str:
        """Hash of what must match for a stored run to be reused."""
        h = hashlib.sha256(json.dumps([self.target, self.draft, self.n, self.threads, self.extra_args,
                                       prompt_text]).encode())
        return h.hexdigest()[:16]


def generate_args(spec: BenchSpec, cfg: Config, prompt_file: Path) -> list[str]:
    """``ggpipe generate`` arguments of one configuration. Iterative runs use
    every rank for the target (no draft); the speculative modes put the
    draft on the last rank (``--split`` even over the others, then ``/1.0``,
    from 3 ranks on; the ggpipe default at 2 ranks; sharing the head's
    process at 1 rank)."""
    args = ["generate", "-m", spec.target, "-f", str(prompt_file), "-n", str(spec.n), "--ignore-eos", "--json",
            "-t", spec.threads, *MODE_ARGS[cfg.mode]]
    if cfg.mode != "iterative":
        args += ["-md", spec.draft]
        if cfg.ranks >= 3:
            args += ["--split", ",".join(["1"] * (cfg.ranks - 1)) + "/1"]
    return args + list(spec.extra_args)


def launch_command(spec: BenchSpec, cfg: Config, prompt_file: Path) -> list[str]:
    prefix = shlex.split(spec.launcher.format(ranks=cfg.ranks))
    if prefix and prefix[0] in ("mpiexec", "mpirun"):
        prefix[0] = find_launcher(prefix[0])
    return [*prefix, sys.executable, "-m", "ggpipe", *generate_args(spec, cfg, prompt_file)]


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


# -- one run ------------------------------------------------------------------------

def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_one(spec: BenchSpec, cfg: Config, prompt_file: Path, out: Path, env_info: dict) -> dict:
    """Launch one configuration and return its record (also on failure: then
    ``status`` is "failed" and ``error`` holds the end of its stderr)."""
    cmd = launch_command(spec, cfg, prompt_file)
    env = dict(os.environ)
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
    path = out / "runs" / f"{rec['config']['key']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=1))
    tmp.replace(path)


def load_record(out: Path, cfg: Config) -> dict | None:
    path = out / "runs" / f"{cfg.key}.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# -- rows -----------------------------------------------------------------------

def _ms(x):
    return None if x is None else 1e3 * x


def row_of(rec: dict) -> dict:
    """The results.csv row of one run record (metrics empty when it failed)."""
    c = rec["config"]
    row = {k: None for k in COLUMNS}
    row.update(mode=c["mode"], ranks=c["ranks"], link=c["link"], prompt=c["prompt"], repeat=c["repeat"],
               status=rec["status"], wall_s=round(rec.get("wall_s", 0.0), 2), threads=rec["threads"],
               target=rec["target"], draft=rec["draft"] if c["mode"] != "iterative" else None, n=rec["n"],
               key=c["key"], exact=rec.get("exact"), first_diff=rec.get("first_diff"))
    res = rec.get("result")
    if rec["status"] != "ok" or not res:
        return row
    m, d, ranks = res["metrics"], res.get("decoder", {}), res.get("ranks", [])
    rss = [r.get("peak_rss_bytes") or 0 for r in ranks]
    pss = [r.get("peak_pss_bytes") for r in ranks]
    tps = m.get("tokens_per_s")
    row.update(
        n_prompt=res.get("n_prompt"), n_gen_tokens=m.get("n_gen_tokens"), tokens_per_s=tps,
        ttft_ms=_ms(m.get("ttft_s")), itl_mean_ms=_ms(m.get("itl_mean_s")), itl_p50_ms=_ms(m.get("itl_p50_s")),
        itl_p90_ms=_ms(m.get("itl_p90_s")), acceptance_rate=d.get("acceptance_rate"),
        accepted_per_pass=d.get("accepted_per_pass", 1.0 if c["mode"] == "iterative" else None),
        runs_cancelled=d.get("cancel_sent", 0),
        aborted_mid_compute=sum(r.get("cancelled_mid_compute", 0) for r in ranks),
        skipped_before_start=sum(r.get("cancelled_before_start", 0) for r in ranks),
        peak_rss_mib_max=round(max(rss) / 2**20, 1) if rss else None,
        peak_rss_mib_per_rank=";".join(f"{x / 2**20:.0f}" for x in rss),
        peak_pss_mib_per_rank=";".join("" if x is None else f"{x / 2**20:.0f}" for x in pss),
        tokens_per_s_per_mb=(tps / (max(rss) / 1e6)) if tps and rss and max(rss) else None,
    )
    return row


def check_exactness(spec: BenchSpec, records: dict[Config, dict]) -> list[str]:
    """Set ``exact``/``first_diff`` on every successful record against the
    first mode's tokens for the same prompt (its first successful run);
    returns one message per differing run."""
    ref: dict[str, list[int]] = {}
    for cfg, rec in records.items():
        if cfg.mode == spec.modes[0] and rec.get("status") == "ok" and cfg.prompt not in ref:
            ref[cfg.prompt] = rec["result"]["tokens"]
    problems = []
    for cfg, rec in records.items():
        if rec.get("status") != "ok":
            rec["exact"], rec["first_diff"] = None, None
            continue
        r = ref.get(cfg.prompt)
        if r is None:
            rec["exact"], rec["first_diff"] = None, None
            continue
        i = _first_diff(rec["result"]["tokens"], r)
        rec["exact"], rec["first_diff"] = i is None, i
        if i is not None:
            problems.append(f"EXACTNESS FAILURE: {cfg.mode} at {cfg.ranks} ranks, link {cfg.link}, prompt "
                            f"{cfg.prompt}, repeat {cfg.repeat}: output differs from {spec.modes[0]}'s "
                            f"from token {i} on")
    return problems


def write_csv(path: Path, rows: list[dict], columns: list[str] = COLUMNS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(r.get(k)) for k in columns})


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def read_csv(path: Path) -> list[dict]:
    """Rows of a results/peer CSV with numbers parsed back (empty cells -> None)."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row = {}
            for k, v in r.items():
                if v == "":
                    row[k] = None
                elif v in ("True", "False"):
                    row[k] = v == "True"
                else:
                    try:
                        row[k] = int(v) if re.fullmatch(r"-?\d+", v) else float(v)
                    except ValueError:
                        row[k] = v
            out.append(row)
    return out


# -- the whole bench ------------------------------------------------------------------

def prepare_prompts(spec: BenchSpec, out: Path) -> dict[str, Path]:
    """Render every prompt once (chat template of the target) into
    OUT/prompts/<id>.txt; returns id -> file."""
    from ggpipe.bench.prompts import render_prompts
    from ggpipe.models.registry import resolve

    texts = render_prompts(resolve(spec.target), spec.prompts, chat=spec.chat)
    files = {}
    (out / "prompts").mkdir(parents=True, exist_ok=True)
    for p, text in zip(spec.prompts, texts):
        f = out / "prompts" / f"{p['id']}.txt"
        if not f.is_file() or f.read_text(encoding="utf-8") != text:
            f.write_text(text, encoding="utf-8")
        files[p["id"]] = f
    return files


def run_bench(spec: BenchSpec, out: Path, progress: bool = True, log=print) -> tuple[list[dict], list[str]]:
    """Run every configuration not already done in ``out``, then write
    results.csv, summary.md, the plots and (timeline) the per-run timelines.

    Returns:
        (rows of results.csv, problems): problems lists failed runs and
        exactness failures (empty when all is well).
    """
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    files = prepare_prompts(spec, out)
    fps = {pid: spec.fingerprint(f.read_text(encoding="utf-8")) for pid, f in files.items()}
    configs = spec.configs()
    records: dict[Config, dict] = {}
    todo = []
    for cfg in configs:
        rec = load_record(out, cfg)
        if rec is not None and rec.get("status") == "ok" and rec.get("fingerprint") == fps[cfg.prompt] \
                and (not spec.timeline or (out / "traces" / cfg.key).is_dir()):
            records[cfg] = rec
        else:
            todo.append(cfg)
    if records:
        log(f"resuming: {len(records)} of {len(configs)} configurations already done in {out}")
    env_info = environment(spec.launcher) if todo else {}
    bar = tqdm(total=len(configs), initial=len(configs) - len(todo), unit="run", disable=not progress,
               dynamic_ncols=True)
    try:
        for cfg in todo:
            bar.set_postfix_str(f"{cfg.mode} R={cfg.ranks} {cfg.link} {cfg.prompt}#{cfg.repeat}")
            rec = run_one(spec, cfg, files[cfg.prompt], out, env_info)
            rec["fingerprint"] = fps[cfg.prompt]
            save_record(out, rec)
            records[cfg] = rec
            if rec["status"] != "ok":
                bar.write(f"FAILED: {cfg.key}: {rec.get('error', '').strip().splitlines()[-1:] or ''}")
            bar.update(1)
    finally:
        bar.close()
    records = {c: records[c] for c in configs if c in records}
    problems = check_exactness(spec, records)
    for rec in records.values():  # keep the stored records' exactness in step
        save_record(out, rec)
    problems = [f"FAILED: {c.key} ({r.get('error', '').strip().splitlines()[-1] if r.get('error') else 'no output'})"
                for c, r in records.items() if r["status"] != "ok"] + problems
    rows = [row_of(r) for r in records.values()]
    write_csv(out / "results.csv", rows)
    finish_report(out, rows, spec.modes[0], title=_title(spec))
    if spec.timeline:
        from ggpipe.bench import timeline

        for cfg, rec in records.items():
            d = out / "traces" / cfg.key
            if rec["status"] == "ok" and d.is_dir() and any(d.glob("rank*.jsonl")):
                timeline.draw(d, out / "timelines" / f"{cfg.key}.png", title=cfg.key)
                timeline.chrome_trace(d, out / "timelines" / f"{cfg.key}.trace.json")
    return rows, problems


def _model_name(s: str | None) -> str | None:
    return Path(s).stem if s and ("/" in s or s.endswith(".gguf")) else s


def _title(spec: BenchSpec) -> str:
    return _model_name(spec.target) + (f" + draft {_model_name(spec.draft)}" if spec.draft else "")


def title_from_rows(rows: list[dict], fallback: str) -> str:
    """The plot title for results already on disk: the target (and draft)
    the runs used, from the CSV's target/draft columns."""
    targets = [r.get("target") for r in rows if r.get("target")]
    if not targets:
        return fallback
    drafts = [r.get("draft") for r in rows if r.get("draft")]
    return _model_name(targets[0]) + (f" + draft {_model_name(drafts[0])}" if drafts else "")


def finish_report(out: Path, rows: list[dict], ref_mode: str | None, title: str = "") -> str:
    """Write OUT/summary.md and the plots from result rows (+ OUT/peer.csv if
    present); returns the markdown table."""
    from ggpipe.bench import report

    peers = read_csv(out / "peer.csv") if (out / "peer.csv").is_file() else []
    agg = report.aggregate(rows)
    table = report.markdown_table(agg, peers, ref_mode)
    (out / "summary.md").write_text(table + "\n")
    if agg:
        report.plot_all(agg, out, peers, title=title)
    return table
