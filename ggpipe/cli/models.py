"""CLI commands about models: ``ggpipe models list|fetch|path|verify|info`` and
``ggpipe split``.

Register them on the main group with ``main.add_command(models_group)`` and
``main.add_command(split_command)``. Errors are raised as GGPipeError and
printed by the main wrapper.
"""

from __future__ import annotations

from pathlib import Path

import click

from ggpipe.errors import GGPipeError
from ggpipe.models import derive as _derive_mod
from ggpipe.models import registry as _reg
from ggpipe.models.gguf_info import field_value, load_gguf, read_model_info
from ggpipe.models.slicing import check_sliceable, describe_slicing

__all__ = ["models_group", "split_command"]


def human_size(n: int) -> str:
    """``n`` bytes in decimal units: ``512 B``, ``1.5 KB``, ``270.9 MB``,
    ``4.1 GB`` (GB the largest)."""
    x = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if x < 1000 or unit == "GB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return f"{n} B"  # pragma: no cover


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], right: frozenset[int] = frozenset()) -> str:
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        out = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)]
        return "  ".join(out).rstrip()

    return "\n".join([line(header)] + [line(r) for r in rows])


@click.group("models")
def models_group() -> None:
    """List, fetch and locate the models of the registry (models.toml)."""


@models_group.command("list")
def models_list() -> None:
    """Table of registry models and whether each is in the cache."""
    entries = _reg.load_registry()
    rows = []
    for e in entries.values():
        cached = "yes" if _reg._is_cached_entry(e) else "no"
        name = e.name + (" (default)" if e.name == _reg.DEFAULT_MODEL else "")
        size = human_size(e.size) if e.size is not None else "~" + human_size(_shape_bytes(e.shape))
        rows.append((name, e.arch, size, cached, e.source))
    click.echo(_table(("name", "arch", "size", "cached", "source"), rows, right=frozenset({2})))
    click.echo(f"\nregistry: {_reg.registry_path()}\ncache:    {_reg.cache_dir() / 'models'}")
    if any(e.is_described for e in entries.values()):
        click.echo("described models (source 'download'): ggpipe cannot fetch them; download the GGUF and put it "
                   "in the cache above as NAME.gguf, or pass its path; ggpipe plan and simulate size them from their shape "
                   "meanwhile (~: estimated from it)")


def _shape_bytes(shape: str | None) -> int:
    """Weight bytes of a shape (ARCH:QUANT): layers, token embedding, output."""
    from ggpipe.models.sizes import model_sizes

    m = model_sizes(shape or "")
    return m.slice_bytes(0, m.n_layer, True, True)


@models_group.command("fetch")
@click.argument("name")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
def models_fetch(name: str, quiet: bool) -> None:
    """Download or derive registry model NAME into the cache; print its path."""
    click.echo(str(_reg.fetch(name, progress=not quiet)))


@models_group.command("path")
@click.argument("name")
@click.option("--no-fetch", is_flag=True, help="Fail instead of fetching a model that is not cached.")
def models_path(name: str, no_fetch: bool) -> None:
    """Print the GGUF path of NAME (registry name or file), fetching it if needed."""
    click.echo(str(_reg.resolve(name, fetch_missing=not no_fetch)))


@models_group.command("verify")
@click.argument("name")
def models_verify(name: str) -> None:
    """Hash the cached file of NAME again and compare with the registry."""
    path = _reg.verify(name, progress=True)
    click.echo(f"{path}: sha256 ok")


@models_group.command("info")
@click.argument("model")
def models_info(model: str) -> None:
    """Show the GGUF facts of MODEL (registry name or .gguf path)."""
    info = read_model_info(_reg.resolve(model))
    sliceable = describe_slicing(info)
    reader = load_gguf(info.path)
    n_expert = field_value(reader, f"{info.arch}.expert_count") or 0
    n_used = field_value(reader, f"{info.arch}.expert_used_count") or 0
    experts = f"{n_expert}, {n_used} per token" if n_expert else "none (dense)"
    from ggpipe.runtime.llama import file_is_recurrent  # noqa: PLC0415 (loads llama.cpp)

    recurrent = file_is_recurrent(info.path)
    speculative = "no: a recurrent state per sequence (--mode iterative)" if recurrent else "yes"
    from ggpipe.models.row_probe import describe_rows  # noqa: PLC0415 (loads the model once, then cached)
    rows = [
        ("path", str(info.path)),
        ("arch", info.arch),
        ("layers", str(info.n_layer)),
        ("n_embd", str(info.n_embd)),
        ("vocab", str(info.n_vocab)),
        ("context (train)", str(info.n_ctx_train)),
        ("heads / kv heads", f"{info.n_head} / {info.n_head_kv}"),
        ("bos / eos", f"{info.bos_token_id} / {info.eos_token_id}"),
        ("chat template", "yes" if info.chat_template else "no"),
        ("size", human_size(info.file_size)),
        ("experts", experts),
        ("can be split", sliceable),
        ("speculative modes", speculative),
        ("batch rows", "not used (no speculation)" if recurrent else describe_rows(info.path)),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{w}}  {v}")


@click.command("split")
@click.argument("model")
@click.option("--split", "split_text", default=None, help="Stage weights, e.g. 0.3,0.7 (see `ggpipe run --split`).")
@click.option("--stages", type=int, default=None, help="Number of stages for an even split (instead of --split).")
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path), help="Directory for the stage files (created if missing).")
@click.option("--type", "out_type", type=click.Choice(_derive_mod.OUT_TYPES), default="keep", show_default=True, help="Tensor type of the stage files.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
def split_command(model: str, split_text: str | None, stages: int | None, out_dir: Path, out_type: str, quiet: bool) -> None:
    """Cut MODEL (registry name or .gguf) into one GGUF per pipeline stage.

    Writes DIR/<stem>.stage<i>-L<start>-<stop>.gguf (layers [start, stop))."""
    from ggpipe.cluster.loading import layer_ranges
    from ggpipe.cluster.split import parse_split
    from ggpipe.output_paths import check_output

    out_dir = check_output(out_dir, directory=True, what="the output folder")
    spec = parse_split(split_text)
    if spec.draft is not None:
        raise GGPipeError("split takes one model's weights: give --split without '/' and draft weights")
    weights = spec.target
    if weights is None and stages is None:
        raise GGPipeError("give --split WEIGHTS (e.g. 0.3,0.7) or --stages N (with --split prompts or none)")
    n_stages = len(weights) if weights is not None else int(stages)  # type: ignore[arg-type]
    if weights is not None and stages is not None and stages != n_stages:
        raise GGPipeError(f"--stages {stages} but --split has {n_stages} weights")

    src = _reg.resolve(model, progress=not quiet)
    info = read_model_info(src)
    from ggpipe.models.sizes import model_sizes

    ranges = layer_ranges(model_sizes(src) if weights is None and n_stages > 1 else None, info.n_layer, n_stages,
                          weights, head=spec.head)
    if n_stages > 1:
        check_sliceable(info)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GGPipeError(f"cannot create output directory {out_dir}: {e.strerror or e}") from None

    rows = []
    for i, (start, stop) in enumerate(ranges):
        out = out_dir / f"{src.stem}.stage{i}-L{start}-{stop}.gguf"
        _derive_mod.derive_gguf(src, range(start, stop), out, out_type, progress=not quiet)
        span = f"{start}-{stop - 1}" if stop - start > 1 else str(start)
        rows.append((str(i), span, str(stop - start), human_size(out.stat().st_size), str(out)))
    click.echo(_table(("stage", "layers", "count", "size", "file"), rows, right=frozenset({2, 3})))
