"""Aggregated tables and plots of ``ggpipe bench`` results (PipeInfer
Figures 4-7 style): speed vs ranks per mode, TTFT, ITL, speed per MB of
memory, and speed vs link.

Every figure is the mean over prompts and repeats of one (link, ranks, mode);
with repeats, the table adds the range of the per-repeat means of tokens/s.
Peer rows (``peer.csv`` from scripts/peer_llamacpp.py: llama.cpp's own
programs, one process) are drawn as horizontal reference lines and listed in
the table.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ggpipe.bench.grid import variant_speculates
from ggpipe.transport.link import parse_link


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def _link_order(link: str) -> float:
    spec = parse_link(link)
    return 0.0 if spec is None else spec.delay_s(2344) * 1e6


def aggregate(rows: list[dict]) -> list[dict]:
    """One dict per (link, ranks, mode) over successful rows: means of the
    metrics, ``n_runs``, ``n_failed``, ``n_inexact``, per-rank peak RSS
    (max over runs, MiB, ';'-joined) and ``tokens_per_s_repeats`` (min, max
    over repeats of the per-repeat mean tokens/s; None for one repeat)."""
    groups: dict[tuple, list[dict]] = {}
    order: list[tuple] = []
    for r in rows:
        k = (r["link"], r["ranks"], r["mode"])
        if k not in groups:
            groups[k] = []
            order.append(k)
        groups[k].append(r)
    out = []
    for k in order:
        rs = groups[k]
        ok = [r for r in rs if r.get("status", "ok") == "ok"]
        per_rank = None
        rss = [str(r["peak_rss_mib_per_rank"]).split(";") for r in ok if r.get("peak_rss_mib_per_rank")]
        if rss and all(len(x) == len(rss[0]) for x in rss):
            per_rank = ";".join(str(max(int(float(x[i])) for x in rss)) for i in range(len(rss[0])))
        a = {"link": k[0], "ranks": k[1], "mode": k[2], "n_runs": len(ok), "n_failed": len(rs) - len(ok),
             "n_inexact": sum(1 for r in ok if r.get("exact") is False), "peak_rss_mib_per_rank": per_rank,
             "threads": rs[0].get("threads")}
        a["tokens_per_s_repeats"] = _repeat_range(ok)
        for col in ("tokens_per_s", "ttft_ms", "itl_mean_ms", "itl_p50_ms", "itl_p90_ms", "acceptance_rate",
                    "accepted_per_pass", "runs_cancelled", "aborted_mid_compute", "peak_rss_mib_max",
                    "tokens_per_s_per_mb", "wall_s"):
            a[col] = _mean([r.get(col) for r in ok])
        out.append(a)
    return out


def _repeat_range(rows: list[dict]) -> tuple[float, float] | None:
    """(min, max) over repeats of the tokens/s mean over prompts, or None
    with fewer than two repeats: the run-to-run spread of one configuration,
    without the prompts' own differences."""
    per: dict[int, list[float]] = {}
    for r in rows:
        if r.get("tokens_per_s") is not None and r.get("repeat") not in (None, ""):
            per.setdefault(int(r["repeat"]), []).append(float(r["tokens_per_s"]))
    if len(per) < 2:
        return None
    means = [statistics.mean(v) for v in per.values()]
    return min(means), max(means)


def _f(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def markdown_table(agg: list[dict], peers: list[dict] = (), ref_mode: str | None = None) -> str:
    """Markdown table of :func:`aggregate`'s output (+ peer rows), one row
    per (link, ranks, mode), with the speed relative to ``ref_mode`` at the
    same link and ranks and a loud exactness column."""
    ref = {(a["link"], a["ranks"]): a["tokens_per_s"] for a in agg if a["mode"] == ref_mode}
    lines = ["| link | ranks | mode | tokens/s | vs %s | TTFT (ms) | ITL mean / p50 / p90 (ms) | acceptance "
             "| tokens per target pass | runs cancelled (aborted mid-compute) | peak RSS per rank (MiB) "
             "| tokens/s per MB | exact |" % (ref_mode or "-"),
             "|---|---:|---|---:|---:|---:|---|---:|---:|---|---|---:|---|"]
    for a in agg:
        b = ref.get((a["link"], a["ranks"]))
        rel = f"{a['tokens_per_s'] / b:.2f}x" if b and a["tokens_per_s"] else "-"
        exact = "yes" if a["n_inexact"] == 0 else f"**NO: {a['n_inexact']} run(s) DIFFER**"
        if a["n_failed"]:
            exact += f" ({a['n_failed']} failed)"
        cancelled = "-" if not variant_speculates(a["mode"]) else \
            f"{_f(a['runs_cancelled'], '.0f')} ({_f(a['aborted_mid_compute'], '.0f')})"
        speed = _f(a["tokens_per_s"])
        if a.get("tokens_per_s_repeats"):
            lo, hi = a["tokens_per_s_repeats"]
            speed += f" ({lo:.1f}-{hi:.1f})"
        lines.append(
            f"| {a['link']} | {a['ranks']} | {a['mode']} | {speed} | {rel} | {_f(a['ttft_ms'])} | "
            f"{_f(a['itl_mean_ms'])} / {_f(a['itl_p50_ms'])} / {_f(a['itl_p90_ms'])} | "
            f"{_f(a['acceptance_rate'], '.2f')} | {_f(a['accepted_per_pass'], '.2f')} | {cancelled} | "
            f"{(a['peak_rss_mib_per_rank'] or '-').replace(';', ', ')} | {_f(a['tokens_per_s_per_mb'], '.3f')} | "
            f"{exact} |")
    for p in peer_aggregate(peers):
        procs = f"{p['ranks']} processes x" if p["ranks"] > 1 else "1 process,"
        lines.append(f"| (none) | {procs} {p['threads']} thread(s) | {p['mode']} | {_f(p['tokens_per_s'])} | - | - "
                     f"| {_f(p['itl_mean_ms'])} / - / - | {_f(p['acceptance_rate'], '.2f')} | - | - | - | - | - |")
    return "\n".join(lines)


def peer_aggregate(peers: list[dict]) -> list[dict]:
    """Mean tokens/s (and ITL, acceptance) per (peer program, processes, threads)
    over prompts; ``ranks`` is the number of processes (2 for llama.cpp RPC,
    1 otherwise; peer.csv files without the column count as 1)."""
    groups: dict[tuple, list[dict]] = {}
    for p in peers:
        groups.setdefault((p["mode"], int(p.get("ranks") or 1), p["threads"]), []).append(p)
    return [{"mode": k[0], "ranks": k[1], "threads": k[2], "tokens_per_s": _mean([r["tokens_per_s"] for r in v]),
             "itl_mean_ms": _mean([r.get("itl_mean_ms") for r in v]),
             "acceptance_rate": _mean([r.get("acceptance_rate") for r in v])} for k, v in groups.items()]


# -- plots ----------------------------------------------------------------------------

_METRICS = {
    "speed": ("tokens_per_s", "generation speed (tokens/s)", False),
    "ttft": ("ttft_ms", "time to first token (ms)", False),
    "itl": ("itl_mean_ms", "inter-token latency, mean (ms)", False),
    "memory_efficiency": ("tokens_per_s_per_mb", "tokens/s per MB of peak RSS (largest rank)", True),
}


def plot_all(agg: list[dict], out: Path, peers: list[dict] = (), title: str = "", dpi: int = 80) -> list[Path]:
    """Write speed.png, ttft.png, itl.png, memory_efficiency.png (metric vs
    ranks, one line per mode, one panel per link) and, with more than one
    link, link.png (speed vs link, one panel per rank count). Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    links = sorted({a["link"] for a in agg}, key=_link_order)
    modes = list(dict.fromkeys(a["mode"] for a in agg))
    ranks = sorted({a["ranks"] for a in agg})
    colors = {m: f"C{i}" for i, m in enumerate(modes)}
    paths = []
    for name, (col, ylabel, logy) in _METRICS.items():
        fig, axes = plt.subplots(1, len(links), figsize=(2.9 * len(links) + 1.2, 3.0), sharey=True, squeeze=False)
        for ax, link in zip(axes[0], links):
            for mode in modes:
                pts = [(a["ranks"], a[col]) for a in agg if a["link"] == link and a["mode"] == mode
                       and a[col] is not None]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", color=colors[mode], label=mode)
                if name == "itl":
                    band = sorted((a["ranks"], a["itl_p50_ms"], a["itl_p90_ms"]) for a in agg
                                  if a["link"] == link and a["mode"] == mode and a["itl_p90_ms"] is not None)
                    if band:
                        xs, lo, hi = zip(*band)
                        ax.fill_between(xs, lo, hi, color=colors[mode], alpha=0.15, linewidth=0)
            if name == "speed":
                for i, p in enumerate(peer_aggregate(peers)):
                    ax.axhline(p["tokens_per_s"], color="0.4", linestyle=["--", ":", "-.", (0, (5, 1))][i % 4],
                               linewidth=1, label=f"{p['mode']} ({p['ranks']}x{p['threads']} thr)")
            ax.set_title(f"link: {link}", fontsize=9)
            ax.set_xlabel("ranks")
            ax.set_xticks(ranks)
            if logy:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(ylabel)
        if name == "itl":
            axes[0][0].text(0.02, 0.98, "band: p50-p90", transform=axes[0][0].transAxes, fontsize=7, va="top")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center right", fontsize=7, frameon=False)
        fig.suptitle(f"{title}: {ylabel}" if title else ylabel, fontsize=9)
        fig.tight_layout(rect=(0, 0, 0.86, 1))
        p = out / f"{name}.png"
        fig.savefig(p, dpi=dpi)
        plt.close(fig)
        paths.append(p)
    if len(links) > 1:
        fig, axes = plt.subplots(1, len(ranks), figsize=(2.9 * len(ranks) + 1.2, 3.0), sharey=True, squeeze=False)
        for ax, r in zip(axes[0], ranks):
            for mode in modes:
                pts = [(links.index(a["link"]), a["tokens_per_s"]) for a in agg
                       if a["ranks"] == r and a["mode"] == mode and a["tokens_per_s"] is not None]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", color=colors[mode], label=mode)
            ax.set_xticks(range(len(links)))
            ax.set_xticklabels(links, rotation=30, ha="right", fontsize=7)
            ax.set_title(f"{r} ranks", fontsize=9)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("generation speed (tokens/s)")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center right", fontsize=7, frameon=False)
        fig.suptitle(f"{title}: speed vs interconnect" if title else "speed vs interconnect", fontsize=9)
        fig.tight_layout(rect=(0, 0, 0.86, 1))
        p = out / "link.png"
        fig.savefig(p, dpi=dpi)
        plt.close(fig)
        paths.append(p)
    return paths
