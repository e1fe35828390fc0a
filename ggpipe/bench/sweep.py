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

This module runs the whole bench; the grid of configurations and their
command lines are in ggpipe.bench.grid, one run and its stored record in
ggpipe.bench.records, the rows, the CSV, the exactness check and the report
in ggpipe.bench.results.
"""

from __future__ import annotations

from pathlib import Path

from ggpipe.bench.grid import BenchSpec, Config
from ggpipe.bench.records import environment, load_record, run_one, save_record
from ggpipe.bench.results import COLUMNS  # noqa: F401 (results.csv's columns, named in the docstring)
from ggpipe.bench.results import check_exactness, finish_report, row_of, spec_title, write_csv


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
    finish_report(out, rows, spec.modes[0], title=spec_title(spec))
    if spec.timeline:
        from ggpipe.bench import timeline

        for cfg, rec in records.items():
            d = out / "traces" / cfg.key
            if rec["status"] == "ok" and d.is_dir() and any(d.glob("rank*.jsonl")):
                timeline.draw(d, out / "timelines" / f"{cfg.key}.png", title=cfg.key)
                timeline.chrome_trace(d, out / "timelines" / f"{cfg.key}.trace.json")
    return rows, problems

