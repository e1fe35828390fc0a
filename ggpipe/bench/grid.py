"""What ``ggpipe bench`` runs: the grid of configurations (mode, ranks, link,
prompt, repeat) asked for (:class:`BenchSpec`, checked by its ``validate``),
and the ``ggpipe generate --json`` command line of each one under the
launcher."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ggpipe.child_process import ggpipe_command
from ggpipe.decoding.mode import MODES, mode_class
from ggpipe.errors import ConfigError
from ggpipe.speculation.proposers.base import proposer_classes
from ggpipe.transport.launcher_path import find_launcher
from ggpipe.transport.link import format_link, parse_link

def mode_args() -> dict[str, list[str]]:
    """``--modes`` name -> ``ggpipe generate`` arguments: the rows every
    registered mode (:meth:`ggpipe.decoding.mode.Mode.bench_variants`) and
    drafting strategy (``ProposerBase.bench_variants``) declares, in
    registration order."""
    out: dict[str, list[str]] = {}
    for name in MODES:
        out.update(mode_class(name).bench_variants())
    for cls in proposer_classes().values():
        out.update(cls.bench_variants)
    return out


def variant_speculates(name: str, default: bool = True) -> bool:
    """Whether the ``--modes`` row ``name`` runs a speculative mode (it
    takes the draft model); ``default`` for a name no longer registered
    (a stored result's)."""
    args = mode_args().get(name)
    if not args or "--mode" not in args:
        return default
    return mode_class(args[args.index("--mode") + 1]).speculates


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
        """The run's file name stem: ``<mode>_r<ranks>_<link slug>_<prompt>_<repeat>``
        (the link's characters other than letters, digits and dots become ``-``)."""
        slug = re.sub(r"[^A-Za-z0-9.]+", "-", self.link)
        return f"{self.mode}_r{self.ranks}_{slug}_{self.prompt}_{self.repeat}"


@dataclass
class BenchSpec:
    """Everything ``ggpipe bench`` was asked for.

    Attributes:
        target, draft: model names or paths (draft None: only iterative).
        modes: row names (keys of :func:`mode_args`); the first is the exactness reference.
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
        known = mode_args()
        for m in self.modes:
            if m not in known:
                raise ConfigError(f"unknown mode {m!r}: choose from {', '.join(known)}")
            if variant_speculates(m) and not self.draft:
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
            "-t", spec.threads, *mode_args()[cfg.mode]]
    if variant_speculates(cfg.mode):
        args += ["-md", spec.draft]
        if cfg.ranks >= 3:
            args += ["--split", ",".join(["1"] * (cfg.ranks - 1)) + "/1"]
    return args + list(spec.extra_args)


def launch_command(spec: BenchSpec, cfg: Config, prompt_file: Path) -> list[str]:
    """The full command line of one configuration: the spec's launcher (its
    ``{ranks}`` filled in; ``mpiexec``/``mpirun`` resolved to the installed
    launcher), the ggpipe command, and :func:`generate_args`."""
    prefix = shlex.split(spec.launcher.format(ranks=cfg.ranks))
    if prefix and prefix[0] in ("mpiexec", "mpirun"):
        prefix[0] = find_launcher(prefix[0])
    return [*prefix, *ggpipe_command(), *generate_args(spec, cfg, prompt_file)]
