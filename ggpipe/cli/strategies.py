"""The drafting strategies' command-line options, generated from what the
registered proposer classes declare (``ggpipe.speculation.proposers``):
``--spec-type`` (their names, aliases and summaries) and one option per
field of each class's ``Options`` (``--spec-vote``, ``--spec-ngram-min``,
``--spec-guesses``, ...). The job commands are :class:`JobCommand`, which
asks for them each time it parses or shows help, so a strategy registered
after import (a plug-in, a test) is offered like the built-in ones.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import click

from ggpipe.cli.types import Finite, NumberOrAuto
from ggpipe.decoding.settings import SpecSettings
from ggpipe.speculation.proposers.base import REGISTRY, proposer_classes, strategy_aliases
from ggpipe.speculation.proposers.options import CliOption, StrategyOptions, cli_fields


class ParsedText(click.ParamType):
    """Text turned into a value by a strategy's ``parse`` (a ValueError is
    the user's one-line error); a value that is not text passes as it is."""

    name = "text"

    def __init__(self, parse):
        self.parse = parse

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            return self.parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def click_type(cli: CliOption) -> click.ParamType | type:
    """The click type of a declared strategy option."""
    if cli.parse is not None:
        return ParsedText(cli.parse)
    lo, hi = cli.range if cli.range is not None else (None, None)
    if cli.auto:
        whole = cli.type is int
        return NumberOrAuto(cli.type, float("-inf") if lo is None else lo, float("inf") if hi is None else hi,
                            "N|auto" if whole else "X|auto", "a whole number" if whole else "a number")
    if cli.range is None:
        return cli.type
    return click.IntRange(lo, hi) if cli.type is int else Finite(lo, hi)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _spec_type_option(classes: dict[str, type]) -> click.Option:
    aliases = strategy_aliases()
    told = ", ".join(f"{n} ({cls.summary})" if cls.summary else n for n, cls in classes.items())
    other = f" Other names (llama.cpp's): {', '.join(f'{a} = {n}' for a, n in aliases.items())}." if aliases else ""
    return click.Option(["--spec-type"], type=click.Choice([*classes, *aliases]), default=SpecSettings.spec_type,
                        show_default=True, help=f"Drafting strategy of the speculative modes: {told}.{other}")


def _declared(classes: dict[str, type]) -> list[tuple[str, dataclasses.Field, CliOption]]:
    """(strategy, field, declaration) of every strategy option, each
    ``Options`` class once (a subclass may share its base's).

    Raises:
        ValueError: two strategies declare the same flag."""
    out, seen, owner = [], set(), {}
    for name, cls in classes.items():
        if cls.Options in seen:
            continue
        seen.add(cls.Options)
        for f, cli in cli_fields(cls.Options):
            if cli.flag in owner:
                raise ValueError(f"{cli.flag} is declared by both --spec-type {owner[cli.flag]} and {name}")
            owner[cli.flag] = name
            out.append((name, f, cli))
    return out


@functools.lru_cache(maxsize=4)
def _params(registry: tuple) -> tuple[click.Option, ...]:
    classes = proposer_classes()
    return (_spec_type_option(classes), *(
        click.Option([cli.flag, cli.dest], type=click_type(cli), default=cli.shown_default(_default(f)),
                     show_default=True, help=cli.help)
        for _, f, cli in _declared(classes)))


def strategy_params() -> list[click.Option]:
    """``--spec-type`` and every registered strategy's options, in
    registration order (built once per state of the registry)."""
    return list(_params(tuple(REGISTRY.items())))


def strategy_keys() -> list[str]:
    """The keywords the strategy options (not ``--spec-type``) pass their values under."""
    return [p.name for p in strategy_params()[1:]]


def strategy_options(values: Mapping[str, Any]) -> StrategyOptions:
    """Each registered strategy's ``Options`` from a command's values (by
    the keyword of each option; absent ones keep their defaults).

    Raises:
        ValueError: a value the ``Options`` dataclass refuses."""
    out = {}
    for name, cls in proposer_classes().items():
        fields = cli_fields(cls.Options)
        if fields:
            out[name] = cls.Options(**{f.name: values[cli.dest] for f, cli in fields if cli.dest in values})
    return StrategyOptions(out)


class JobCommand(click.Command):
    """A job command (generate, chat, batch, serve): the strategy options
    (:func:`strategy_params`) of the strategies registered when it parses
    its arguments or shows its help, placed after ``--mode``."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        """click's parameters of the command, with every registered strategy's
        options (:func:`strategy_params`) inserted right after ``--mode`` (at the
        end when the command has no ``--mode``)."""
        params = super().get_params(ctx)
        at = next((i + 1 for i, p in enumerate(params) if p.name == "mode"), len(params))
        return [*params[:at], *strategy_params(), *params[at:]]
