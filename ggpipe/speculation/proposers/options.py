"""A drafting strategy's own settings, declared once, next to the strategy.

Each proposer class has an ``Options`` class: a frozen dataclass whose
fields are the strategy's knobs. A field made with :func:`option` carries
what the command line needs to offer it (flag, help, range, ``auto``, a
parser for list-valued settings); ``ggpipe.cli.strategies`` turns those
declarations into click options, so a new knob is one field. No click here:
the declarations are pure data.

Example (what ``ggpipe.speculation.proposers.ngram`` declares)::

    @dataclass(frozen=True)
    class Options:
        ngram_min: int = option(1, flag="--spec-ngram-min", range=(1, 64),
                                help="Shortest suffix the n-gram proposer matches (tokens).")

:class:`StrategyOptions` maps ``--spec-type`` names to such instances; it is
what ``SpecSettings.strategy_options`` and ``ProposerConfig.options`` hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class CliOption:
    """How one strategy setting appears on the command line.

    Attributes:
        flag: the option's name, e.g. ``"--spec-ngram-min"`` (unique among
            every registered strategy's options).
        help: its ``--help`` text.
        type: the Python type of a value given on the command line (``int``,
            ``float``); unused with ``parse``.
        range: (lowest, highest) accepted value, inclusive; None: any.
        auto: the word ``auto`` is accepted and stands for None (then the
            field's default is usually None, shown as ``auto``).
        parse: text -> value for settings that are not a number (raises
            ValueError with the message the user sees); None: ``type``.
        text: value -> text, to show a ``parse`` setting's default.
    """

    flag: str
    help: str
    type: type = int
    range: tuple[float, float] | None = None
    auto: bool = False
    parse: Callable[[str], Any] | None = None
    text: Callable[[Any], str] = str

    @property
    def dest(self) -> str:
        """The keyword the command passes the value under: the flag in
        snake case (``--spec-ngram-min`` -> ``spec_ngram_min``)."""
        return self.flag.lstrip("-").replace("-", "_")

    def shown_default(self, value: Any) -> Any:
        """``value`` as the command line shows and takes it."""
        if value is None and self.auto:
            return "auto"
        return self.text(value) if self.parse is not None else value


def option(default: Any, *, flag: str, help: str, type: type | None = None,
           range: tuple[float, float] | None = None, auto: bool = False,
           parse: Callable[[str], Any] | None = None, text: Callable[[Any], str] = str) -> Any:
    """A field of a strategy's ``Options`` dataclass, with its command-line
    declaration (see :class:`CliOption`; ``type`` defaults to the type of
    ``default``, or ``int`` when it is None)."""
    kind = type if type is not None else (int if default is None else default.__class__)
    cli = CliOption(flag, help, kind, range, auto, parse, text)
    return dataclasses.field(default=default, metadata={"cli": cli})


def cli_fields(options_cls: type) -> list[tuple[dataclasses.Field, CliOption]]:
    """The fields of an ``Options`` dataclass that carry a command-line
    declaration, in declaration order, with it."""
    return [(f, f.metadata["cli"]) for f in dataclasses.fields(options_cls) if "cli" in f.metadata]


@dataclass(frozen=True)
class NoOptions:
    """The ``Options`` of a strategy without settings of its own."""


class StrategyOptions(Mapping[str, Any]):
    """``--spec-type`` name -> that strategy's ``Options`` instance.
    Immutable and hashable; a name that is absent has its defaults
    (:meth:`of`).

    Example::

        >>> from ggpipe.speculation.proposers.ngram import NgramProposer
        >>> opts = StrategyOptions(ngram=NgramProposer.Options(ngram_min=2))
        >>> opts.of(NgramProposer).ngram_min, opts.of(NgramProposer).ngram_max
        (2, 4)
    """

    def __init__(self, items: Mapping[str, Any] | None = None, **by_name: Any):
        self._d = dict(items or {}, **by_name)

    def __getitem__(self, name: str) -> Any:
        return self._d[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        return hash(frozenset(self._d.items()))

    def __repr__(self) -> str:
        return f"StrategyOptions({self._d!r})"

    def of(self, cls: type) -> Any:
        """The options of the proposer class ``cls`` (by its ``name``): those
        held, else ``cls.Options()`` (the defaults)."""
        return self._d[cls.name] if cls.name in self._d else cls.Options()
