"""Which rank runs which stage of which model. Pure.

Layout (PipeInfer's ``--mpi-layer-split 0.5,0.5/1.0``): rank 0 is the head
and the target's first stage; ranks 1..T-1 are the target's other stages;
ranks T..T+D-1 are the draft pipeline. With a draft model but no draft rank
(D = 0) the head also holds the whole draft model.

Transactions of the target go 0 -> 1 -> ... -> T-1 -> (logits) 0; of the
draft, 0 -> T -> ... -> T+D-1 -> (logits) 0. Cancellations travel back up the
target pipeline: 0 -> T-1 -> T-2 -> ... -> 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from ggpipe.errors import ConfigError
from ggpipe.cluster.split import SplitSpec


@dataclass(frozen=True)
class Roles:
    """Attributes:
        size: ranks in the job.
        n_target: ranks running the target model (T >= 1, rank 0 first).
        n_draft: ranks running the draft model (D >= 0).
        has_draft: a draft model is used (on the head when n_draft == 0).
    """

    size: int
    n_target: int
    n_draft: int
    has_draft: bool

    @classmethod
    def plan(cls, size: int, split: SplitSpec, has_draft: bool) -> "Roles":
        """Decide T and D from the job size and ``--split``.

        Without weights: no draft → T = size; with a draft → one draft rank
        when size > 1 (T = size - 1), else the draft lives on the head.

        Raises:
            ConfigError: the split does not add up to the number of ranks, or
                names draft weights without a draft model.
        """
        if split.draft is not None and not has_draft:
            raise ConfigError("--split names draft stages ('/' part) but no draft model was given (-md)")
        if split.target is not None:
            t = len(split.target)
            d = len(split.draft) if split.draft is not None else (size - t if has_draft else 0)
        else:
            d = (1 if size > 1 else 0) if has_draft else 0
            if split.draft is not None:
                d = len(split.draft)
            t = size - d
        if t < 1:
            raise ConfigError(f"no rank left for the target model ({size} ranks, {d} for the draft)")
        if t + d != size:
            what = f"{t} target" + (f" + {d} draft" if has_draft else "")
            raise ConfigError(f"--split describes {what} stages but the job has {size} ranks (mpiexec -n {t + d})")
        return cls(size, t, d, has_draft)

    def model_of(self, rank: int) -> str:
        return "target" if rank < self.n_target else "draft"

    def stage_of(self, rank: int) -> tuple[int, int]:
        """(stage index, number of stages) of ``rank`` in its model's pipeline."""
        if rank < self.n_target:
            return rank, self.n_target
        return rank - self.n_target, self.n_draft

    @property
    def target_ranks(self) -> list[int]:
        """Target ranks after the head, in stage order."""
        return list(range(1, self.n_target))

    @property
    def draft_ranks(self) -> list[int]:
        return list(range(self.n_target, self.n_target + self.n_draft))

    def links(self, rank: int) -> dict:
        """A worker's neighbours: prev, next (None: last stage), head,
        cancel_src (None: never cancelled), cancel_fwd."""
        if rank == 0:
            raise ValueError("rank 0 is the head")
        if rank < self.n_target:
            last = rank == self.n_target - 1
            return {
                "prev": rank - 1,
                "next": None if last else rank + 1,
                "head": 0,
                "cancel_src": 0 if last else rank + 1,
                "cancel_fwd": rank - 1 if rank > 1 else None,
            }
        first = rank == self.n_target
        last = rank == self.size - 1
        return {"prev": 0 if first else rank - 1, "next": None if last else rank + 1, "head": 0,
                "cancel_src": None, "cancel_fwd": None}
