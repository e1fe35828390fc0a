"""Click parameter types shared by the ggpipe commands."""

from __future__ import annotations

import math

import click


class Finite(click.FloatRange):
    """A float in a range, refusing NaN and infinities (click's FloatRange
    lets NaN through: every comparison with it is false).

    ``Finite(min=0, min_open=True)`` -> (0, inf); ``Finite()`` -> any finite float.
    """

    name = "finite float"

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


#: Seconds a wait may last: a finite number >= 0.01 (a shorter wait cannot see
#: another rank's answer, and the job would blame that rank).
SECONDS = Finite(min=0.01)


class NumberOrAuto(click.ParamType):
    """A number in [``lo``, ``hi``] of type ``cast``, or ``auto`` (None);
    the words in ``keep`` pass through as they are.

    Args:
        name: the metavar (``N|auto``).
        noun: what a number is called in the error message ("a whole number")."""

    def __init__(self, cast: type = float, lo: float = 0.0, hi: float = 1.0, name: str = "X|auto",
                 noun: str = "a number", keep: tuple[str, ...] = ()):
        self.cast, self.lo, self.hi, self.name, self.noun, self.keep = cast, lo, hi, name, noun, keep

    def convert(self, value, param, ctx):
        if value is None or value == "auto":
            return None
        if value in self.keep or isinstance(value, self.cast):
            return value
        try:
            v = self.cast(value)
        except ValueError:
            self.fail(f"{value!r} is neither {self.noun} nor 'auto'", param, ctx)
        if not self.lo <= v <= self.hi:
            self.fail(f"{v} is not in [{self.lo:g}, {self.hi:g}]", param, ctx)
        return v
