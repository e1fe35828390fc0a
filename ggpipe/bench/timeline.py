"""Per-rank timelines (PipeInfer Figure 3) from ``GGPIPE_TRACE_DIR`` traces.

    ggpipe timeline TRACEDIR [-o timeline.png] [--chrome trace.json] [--start-ms A --end-ms B]

One Gantt row per (rank, lane): a lane is the thread that computed (a
worker's ``stage``, the head's ``target stage`` / ``draft stage``). Bars:
non-speculative runs, speculative runs, runs aborted mid-compute (cancelled),
and a worker's idle waits; ticks mark cancellations received, runs skipped
because they were cancelled before starting, and logits arriving at the head.
The time axis starts at the first run (model loading is left out).

The Chrome trace JSON (``chrome://tracing``, https://ui.perfetto.dev) has one
process per rank and one thread per lane, times in microseconds of Unix time.
"""

from __future__ import annotations

import json
from pathlib import Path

from ggpipe.errors import ConfigError

COLORS = {"run": "#4C72B0", "spec": "#55A868", "cancelled": "#C44E52", "idle": "#DDDDDD"}


def load_traces(trace_dir: str | Path) -> tuple[dict[int, dict], dict[int, list[dict]], dict]:
    """(headers by rank, events by rank with ``t`` in Unix seconds, meta).

    Raises:
        ConfigError: the directory holds no ``rank*.jsonl`` or one is unreadable.
    """
    d = Path(trace_dir)
    files = sorted(d.glob("rank*.jsonl"))
    if not files:
        raise ConfigError(f"{d}: no rank*.jsonl traces (run with GGPIPE_TRACE_DIR={d} or ggpipe bench --timeline)")
    headers, events = {}, {}
    for f in files:
        try:
            lines = f.read_text().splitlines()
            head = json.loads(lines[0])
            evs = [json.loads(x) for x in lines[1:] if x.strip()]
        except (OSError, IndexError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{f}: unreadable trace ({exc})") from None
        r = int(head["rank"])
        for e in evs:
            e["t"] = e["ts"] + head["wall_offset_s"]
        headers[r], events[r] = head, evs
    meta = {}
    if (d / "meta.json").is_file():
        meta = json.loads((d / "meta.json").read_text())
    _spec_from_head(events, meta)
    return headers, events, meta


def _spec_from_head(events: dict[int, list[dict]], meta: dict) -> None:
    """A worker only sees KV sequence ids, so it marks a run speculative when
    none of its tokens is in sequence 0. The head knows better (its ``submit``
    events): when the ranks' roles are known, workers' runs take the head's flag."""
    roles = {int(k): str(v).split(" ")[0] for k, v in meta.get("roles", {}).items()}
    flags = {(e.get("pipeline"), e.get("run")): e.get("spec") for e in events.get(0, [])
             if e["name"] == "submit"}
    for r, evs in events.items():
        if r == 0 or roles.get(r) not in ("target", "draft"):
            continue
        for e in evs:
            f = flags.get((roles[r], e.get("run")))
            if e["name"] == "run" and f is not None:
                e["spec"] = f


def _kind(e: dict) -> str:
    if e["name"] == "idle":
        return "idle"
    if e.get("cancelled"):
        return "cancelled"
    return "spec" if e.get("spec") else "run"


def summarize(events: dict[int, list[dict]]) -> dict[int, dict]:
    """Per rank: runs, speculative runs, aborted runs, busy and idle seconds
    between its first and last run."""
    out = {}
    for r, evs in events.items():
        runs = [e for e in evs if e["name"] == "run"]
        if not runs:
            continue
        t0 = min(e["t"] for e in runs)
        t1 = max(e["t"] + e["dur"] for e in runs)
        busy = sum(e["dur"] for e in runs)
        out[r] = {"runs": len(runs), "spec_runs": sum(1 for e in runs if e.get("spec")),
                  "aborted": sum(1 for e in runs if e.get("cancelled")), "busy_s": busy,
                  "span_s": t1 - t0, "utilization": busy / (t1 - t0) if t1 > t0 else None}
    return out


def draw(trace_dir: str | Path, out_png: str | Path, start_ms: float | None = None, end_ms: float | None = None,
         title: str | None = None, dpi: int = 90) -> Path:
    """Draw the Gantt chart of a trace directory to ``out_png``; returns its path.

    Args:
        start_ms, end_ms: window to draw, in ms from the first run (default: all).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    _, events, meta = load_traces(trace_dir)
    runs = [e for evs in events.values() for e in evs if e["name"] == "run"]
    if not runs:
        raise ConfigError(f"{trace_dir}: the traces hold no runs")
    origin = min(e["t"] for e in runs)
    last = max(e["t"] + e["dur"] for e in runs)
    lo = 0.0 if start_ms is None else start_ms
    hi = (last - origin) * 1e3 if end_ms is None else end_ms
    roles = {int(k): v for k, v in meta.get("roles", {}).items()}
    rows = []  # (rank, lane)
    for r in sorted(events):
        lanes = list(dict.fromkeys(e["lane"] for e in events[r] if e["ph"] == "X"))
        rows += [(r, ln) for ln in sorted(lanes)]
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.4))
    for y, (r, lane) in enumerate(rows):
        for e in events[r]:
            if e["lane"] != lane or e["ph"] != "X":
                continue
            x0 = (e["t"] - origin) * 1e3
            w = e["dur"] * 1e3
            if x0 + w < lo or x0 > hi:
                continue
            k = _kind(e)
            ax.broken_barh([(x0, max(w, 0.05))], (y - (0.2 if k == "idle" else 0.38), 0.4 if k == "idle" else 0.76),
                           facecolors=COLORS[k], edgecolor="white" if k != "idle" else "none", linewidth=0.3)
    marks = {"cancel": ("x", "#C44E52"), "skip": ("|", "#8172B2"), "recv": ("v", "#333333")}
    index = {row: y for y, row in enumerate(rows)}
    for r in events:
        for e in events[r]:
            if e["ph"] != "i" or e["name"] not in marks:
                continue
            lane = e["lane"] if (r, e["lane"]) in index else rows_head(rows, r)
            x = (e["t"] - origin) * 1e3
            if lane is not None and lo <= x <= hi:
                m, c = marks[e["name"]]
                ax.plot([x], [index[(r, lane)] + 0.45], marker=m, color=c, markersize=4, linestyle="none")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {lane}" + (f"\n({roles[r]})" if r in roles else "") for r, lane in rows],
                       fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(lo, hi)
    ax.set_xlabel("time since the first run (ms)")
    handles = [Patch(color=COLORS["run"], label="run (non-speculative)"),
               Patch(color=COLORS["spec"], label="speculative run"),
               Patch(color=COLORS["cancelled"], label="aborted mid-compute (cancelled)"),
               Patch(color=COLORS["idle"], label="idle (waiting for work)"),
               plt.Line2D([], [], marker="x", color="#C44E52", linestyle="none", label="cancel"),
               plt.Line2D([], [], marker="|", color="#8172B2", linestyle="none", label="skipped (cancelled)"),
               plt.Line2D([], [], marker="v", color="#333333", linestyle="none", label="logits at head")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.4 / max(len(rows), 1)),
              ncol=4, fontsize=7, frameon=False)
    ax.set_title(title or meta.get("key") or str(trace_dir), fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=dpi)
    plt.close(fig)
    return out_png


def rows_head(rows: list[tuple[int, str]], rank: int) -> str | None:
    """The lane of ``rank`` that head-side instants (cancel, recv) are drawn on."""
    lanes = [ln for r, ln in rows if r == rank]
    for pref in ("target stage", "draft stage", "stage"):
        if pref in lanes:
            return pref
    return lanes[0] if lanes else None


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def not_a_png(path: Path) -> str | None:
    """Why the existing file ``path`` is not a chart :func:`draw` may
    replace (it is not a PNG), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(PNG_SIGNATURE))
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None if head == PNG_SIGNATURE else "exists and is not a PNG image: not overwriting it"


def not_a_chrome_trace(path: Path) -> str | None:
    """Why the existing file ``path`` is not a trace :func:`chrome_trace`
    may replace (not JSON with ``traceEvents``), or None."""
    try:
        obj = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        obj = None
    if isinstance(obj, dict) and "traceEvents" in obj:
        return None
    return "exists and is not a Chrome trace: not overwriting it"


def chrome_trace(trace_dir: str | Path, out_json: str | Path) -> Path:
    """Export the traces as Chrome trace JSON (µs, one pid per rank, one tid per lane)."""
    _, events, meta = load_traces(trace_dir)
    roles = {int(k): v for k, v in meta.get("roles", {}).items()}
    out = []
    for r in sorted(events):
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                    "args": {"name": f"rank {r}" + (f" ({roles[r]})" if r in roles else "")}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        tids = {}
        for e in events[r]:
            tid = tids.setdefault(e["lane"], len(tids) + 1)
            args = {k: v for k, v in e.items() if k not in ("ph", "name", "ts", "dur", "lane", "t")}
            name = e["name"] if e["name"] != "run" else (
                "aborted run" if e.get("cancelled") else ("speculative run" if e.get("spec") else "run"))
            if "run" in args:
                name += f" {args['run']}"
            ev = {"ph": e["ph"], "name": name, "cat": e["name"], "pid": r, "tid": tid, "ts": e["t"] * 1e6,
                  "args": args}
            if e["ph"] == "X":
                ev["dur"] = e["dur"] * 1e6
            else:
                ev["s"] = "t"
            out.append(ev)
        for lane, tid in tids.items():
            out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": lane}})
    out_json = Path(out_json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))
    return out_json
