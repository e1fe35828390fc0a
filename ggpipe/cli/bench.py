"""``ggpipe bench`` and ``ggpipe timeline`` (click commands; see
ggpipe/bench/sweep.py and ggpipe/bench/timeline.py).

    ggpipe bench -m TARGET -md DRAFT --modes iterative,speculative,pipeinfer --ranks 2,3,4 \\
        --prompts default -n 512 --repeat 3 --link shm --link 1gbit,200us -o results/
    ggpipe timeline results/traces/<run> -o timeline.png --chrome trace.json
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from ggpipe.errors import ConfigError
from ggpipe.cli.types import SECONDS, Finite


def _int_list(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not out:
        raise ConfigError(f"{what} is empty")
    return out


def _links(values: tuple[str, ...]) -> list[str]:
    out = []
    for v in values:
        out += [x.strip() for x in v.split(";") if x.strip()]
    return out or ["shm"]


@click.command("bench")
@click.option("-m", "--model", "target", default="smollm2-135m", show_default=True,
              help="Target model: registry name or .gguf path.")
@click.option("-md", "--draft-model", "draft", default=None, help="Draft model (needed by speculative modes).")
@click.option("--modes", default="iterative", show_default=True,
              help="Comma-separated modes: iterative, speculative, pipeinfer, pipeinfer-no-cancel, "
                   "pipeinfer-no-continuous, pipedec, pipedec-tree (--tree-width 4 --max-children 4), vote (pipeinfer with "
                   "Minions' vote of the draft and the n-gram lookup). The first is the exactness reference.")
@click.option("--ranks", default="2", show_default=True, help="Comma-separated rank counts, e.g. 2,3,4.")
@click.option("--prompts", "prompt_set", default="default", show_default=True,
              help="Prompt set: 'default' (code, Goliath story, encyclopedia; ~128 tokens each) or a JSONL file "
                   "with one {\"id\": ..., \"prompt\": ...} per line.")
@click.option("-n", "--n-predict", "n", default=128, show_default=True, type=int,
              help="Tokens generated per run (--ignore-eos: exactly n).")
@click.option("--repeat", default=1, show_default=True, type=int, help="Runs per configuration.")
@click.option("--link", "links", multiple=True,
              help="Emulated interconnect BANDWIDTH,LATENCY (e.g. 1gbit,200us; 'shm' = none). Repeat the option "
                   "or separate with ';' to sweep several.  [default: shm]")
@click.option("-t", "--threads", default="1", show_default=True, help="Threads per rank (passed to every run).")
@click.option("--launcher", default="mpiexec -n {ranks}", show_default=True,
              help="Launch prefix; {ranks} is replaced, e.g. 'srun -n {ranks}' or 'mpiexec -f hosts -n {ranks}'.")
@click.option("--args", "extra", default="", help="More 'ggpipe generate' arguments for every run, e.g. '--draft 4'.")
@click.option("--no-chat", is_flag=True, help="Feed prompts raw instead of as a user turn of the chat template.")
@click.option("--timeline", is_flag=True,
              help="Record per-rank traces; draw OUT/timelines/<run>.png and Chrome trace JSON per run.")
@click.option("--run-timeout", default=1800.0, show_default=True, type=SECONDS, help="Limit of one run (s).")
@click.option("-o", "--output", default="results/bench", show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="Results directory (resumable).")
@click.option("--plots-only", is_flag=True,
              help="Run nothing: redraw summary.md and plots from OUT/results.csv (and OUT/peer.csv).")
@click.option("--dry-run", is_flag=True, help="Print the commands that would run, and stop.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def bench_command(target, draft, modes, ranks, prompt_set, n, repeat, links, threads, launcher, extra, no_chat,
                  timeline, run_timeout, output, plots_only, dry_run, no_progress):
    """Benchmark modes x ranks x links x prompts; write CSV, JSON per run, plots.

    Each configuration runs once per repeat as its own 'ggpipe generate --json' job under the launcher.
    Finished configurations in OUT are not run again. Exit status 3 when a run failed or its output
    differs from the first mode's (exactness is part of the benchmark).
    """
    from ggpipe.bench.grid import BenchSpec, launch_command
    from ggpipe.bench.prompts import load_prompts
    from ggpipe.bench.results import finish_report, read_csv, spec_title, title_from_rows
    from ggpipe.bench.sweep import run_bench
    from ggpipe.output_paths import check_output

    output = check_output(output, directory=True, what="the results folder")
    if plots_only:
        csv_path = output / "results.csv"
        if not csv_path.is_file():
            raise ConfigError(f"{csv_path} does not exist: run the bench first")
        rows = read_csv(csv_path)
        mode_list = [m for m in modes.split(",") if m]
        click.echo(finish_report(output, rows, mode_list[0] if mode_list else None,
                                 title=title_from_rows(rows, target)))
        return
    spec = BenchSpec(target=target, draft=draft, modes=[m.strip() for m in modes.split(",") if m.strip()],
                     ranks=_int_list(ranks, "--ranks"), links=_links(links), prompts=load_prompts(prompt_set),
                     n=n, repeat=repeat, threads=threads, launcher=launcher, extra_args=shlex.split(extra),
                     chat=not no_chat, timeline=timeline, timeout_s=run_timeout).validate()
    if dry_run:
        for cfg in spec.configs():
            cmd = launch_command(spec, cfg, output / "prompts" / f"{cfg.prompt}.txt")
            click.echo(f"GGPIPE_LINK={cfg.link} " + shlex.join(cmd))
        return
    rows, problems = run_bench(spec, output, progress=not no_progress, log=lambda s: click.echo(s, err=True))
    click.echo(finish_report(output, rows, spec.modes[0], title=spec_title(spec)) if rows else "")
    click.echo(f"\nresults: {output / 'results.csv'}, {output / 'summary.md'}, plots in {output}/", err=True)
    if problems:
        for p in problems:
            click.secho(p, fg="red", bold=True, err=True)
        sys.exit(3)


@click.command("timeline")
@click.argument("trace_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--output", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="PNG to write (default: TRACE_DIR/timeline.png).")
@click.option("--chrome", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Also write Chrome trace JSON here (chrome://tracing, ui.perfetto.dev).")
@click.option("--start-ms", default=None, type=Finite(), help="Window start, ms after the first run.")
@click.option("--end-ms", default=None, type=Finite(), help="Window end, ms after the first run.")
def timeline_command(trace_dir, output, chrome, start_ms, end_ms):
    """Draw a per-rank Gantt chart (PipeInfer Fig. 3) from a GGPIPE_TRACE_DIR trace directory."""
    from ggpipe.bench import timeline
    from ggpipe.output_paths import check_output

    png_path = check_output(output or trace_dir / "timeline.png", foreign=timeline.not_a_png, what="the chart")
    chrome = chrome and check_output(chrome, inputs=(png_path,), foreign=timeline.not_a_chrome_trace,
                                     what="the Chrome trace")
    png = timeline.draw(trace_dir, png_path, start_ms, end_ms)
    click.echo(f"wrote {png}")
    if chrome:
        click.echo(f"wrote {timeline.chrome_trace(trace_dir, chrome)}")
    for r, s in sorted(timeline.summarize(timeline.load_traces(trace_dir)[1]).items()):
        u = f"{100 * s['utilization']:.0f}%" if s["utilization"] is not None else "-"
        click.echo(f"rank {r}: {s['runs']} runs ({s['spec_runs']} speculative, {s['aborted']} aborted), "
                   f"busy {1e3 * s['busy_s']:.0f} ms of {1e3 * s['span_s']:.0f} ms ({u})")
