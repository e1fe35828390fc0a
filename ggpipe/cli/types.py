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


#: Seconds a wait may last: a finite number > 0.
SECONDS = Finite(min=0, min_open=True)
