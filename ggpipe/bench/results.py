"""The results of ``ggpipe bench``: one ``results.csv`` row per run record
(:data:`COLUMNS`), the exactness check of every run against the first
mode's tokens, reading and writing the CSV, and the summary table and plots
(ggpipe.bench.report) with their title."""

from __future__ import annotations

import csv
import re
from pathlib import Path

from ggpipe.bench.grid import BenchSpec, Config, variant_speculates

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


# -- rows -----------------------------------------------------------------------

def _ms(x):
    return None if x is None else 1e3 * x


def row_of(rec: dict) -> dict:
    """The results.csv row of one run record (metrics empty when it failed)."""
    c = rec["config"]
    speculates = variant_speculates(c["mode"], default=bool(rec.get("draft")))
    row = {k: None for k in COLUMNS}
    row.update(mode=c["mode"], ranks=c["ranks"], link=c["link"], prompt=c["prompt"], repeat=c["repeat"],
               status=rec["status"], wall_s=round(rec.get("wall_s", 0.0), 2), threads=rec["threads"],
               target=rec["target"], draft=rec["draft"] if speculates else None, n=rec["n"],
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
        accepted_per_pass=d.get("accepted_per_pass", None if speculates else 1.0),
        runs_cancelled=d.get("cancel_sent", 0),
        aborted_mid_compute=sum(r.get("cancelled_mid_compute", 0) for r in ranks),
        skipped_before_start=sum(r.get("cancelled_before_start", 0) for r in ranks),
        peak_rss_mib_max=round(max(rss) / 2**20, 1) if rss else None,
        peak_rss_mib_per_rank=";".join(f"{x / 2**20:.0f}" for x in rss),
        peak_pss_mib_per_rank=";".join("" if x is None else f"{x / 2**20:.0f}" for x in pss),
        tokens_per_s_per_mb=(tps / (max(rss) / 1e6)) if tps and rss and max(rss) else None,
    )
    return row


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


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
    """Write ``rows`` to the CSV file ``path`` (its folder created): a header of
    ``columns``, keys not among them left out, None as an empty cell, floats
    with 6 significant digits."""
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

def _model_name(s: str | None) -> str | None:
    return Path(s).stem if s and ("/" in s or s.endswith(".gguf")) else s


def spec_title(spec: BenchSpec) -> str:
    """The plot title of a bench: its target (and draft) model."""
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
