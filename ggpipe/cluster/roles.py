"""Which rank runs which stage of which model. Pure.

Layout (PipeInfer's ``--mpi-layer-split 0.5,0.5/1.0``): rank 0 is the head
and the target's first stage; ranks 1..T-1 are the target's other stages;
ranks T..T+D-1 are the draft pipeline. With a draft model but no draft rank
(D = 0) the head also holds the whole draft model. Several draft models
(``-md a,b``, for a vote; ``--split 1,1/1/1``) each get their own ranks,
one pipeline after the other: draft model k's ranks follow draft model k-1's.

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
        n_draft: ranks running draft models (D >= 0, every draft model's).
        has_draft: a draft model is used (on the head when n_draft == 0).
        drafts: ranks per draft model, in ``-md`` order (their sum is
            n_draft; () without a draft model, (0,) for a draft on the head).
            Draft model k's ranks follow draft model k-1's.
    """

    size: int
    n_target: int
    n_draft: int
    has_draft: bool
    drafts: tuple[int, ...] = ()

    @classmethod
    def plan(cls, size: int, split: SplitSpec, has_draft: bool, n_draft_models: int | None = None) -> "Roles":
        """Decide T and D from the job size and ``--split``.

        Without weights: no draft → T = size; with a draft → one draft rank
        when size > 1 (T = size - 1), else the draft lives on the head. With
        several draft models (``n_draft_models`` > 1, ``-md a,b``): one rank
        each unless ``--split`` names their weights (one ``/`` part each);
        none may live on the head.

        Raises:
            ConfigError: the split does not add up to the number of ranks,
                names draft weights without a draft model, or names another
                number of draft models than ``-md``; several draft models and
                no rank left for one of them.
        """
        k = (1 if has_draft else 0) if n_draft_models is None else n_draft_models
        if split.draft is not None and not has_draft:
            raise ConfigError("--split names draft stages ('/' part) but no draft model was given (-md)")
        named = split.drafts
        if k > 1 and named and len(named) != k:
            raise ConfigError(f"--split names {len(named)} draft models ('/' parts) but -md gives {k}")
        if k <= 1 and len(named) > 1:
            raise ConfigError(f"--split names {len(named)} draft models ('/' parts) but -md gives "
                              f"{k or 'none'} (several draft models: -md a,b)")
        if k > 1:
            per = [len(w) for w in named] if named else [1] * k
            d = sum(per)
            t = len(split.target) if split.target is not None else size - d
            if t < 1 or t + d != size:
                raise ConfigError(f"{k} draft models on {d} rank{'s' if d > 1 else ''} and "
                                  f"{max(t, 1)} or more for the target need mpiexec -n {max(t, 1) + d} "
                                  f"(the job has {size}); each draft model needs a rank of its own")
            return cls(size, t, d, True, tuple(per))
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
        return cls(size, t, d, has_draft, (d,) if has_draft else ())

    def draft_of(self, rank: int) -> int:
        """Which draft model (index in ``-md`` order) ``rank`` runs."""
        first = self.n_target
        for k, n in enumerate(self.drafts):
            if rank < first + n:
                return k
            first += n
        raise ValueError(f"rank {rank} runs no draft model")

    @staticmethod
    def draft_name(k: int) -> str:
        """Draft model ``k``'s name: "draft" (the first), "draft2", ..."""
        return "draft" if k == 0 else f"draft{k + 1}"

    def model_of(self, rank: int) -> str:
        """"target", or its draft model's :meth:`draft_name`."""
        if rank < self.n_target:
            return "target"
        return self.draft_name(self.draft_of(rank))

    def stage_of(self, rank: int) -> tuple[int, int]:
        """(stage index, number of stages) of ``rank`` in its model's pipeline."""
        if rank < self.n_target:
            return rank, self.n_target
        k = self.draft_of(rank)
        first = self.draft_ranks_of(k)[0]
        return rank - first, self.drafts[k]

    @property
    def target_ranks(self) -> list[int]:
        """Target ranks after the head, in stage order."""
        return list(range(1, self.n_target))

    @property
    def draft_ranks(self) -> list[int]:
        """Every draft model's ranks."""
        return list(range(self.n_target, self.n_target + self.n_draft))

    def draft_ranks_of(self, k: int) -> list[int]:
        """Draft model ``k``'s ranks, in stage order."""
        first = self.n_target + sum(self.drafts[:k])
        return list(range(first, first + self.drafts[k]))

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
        mine = self.draft_ranks_of(self.draft_of(rank))
        first, last = rank == mine[0], rank == mine[-1]
        return {"prev": 0 if first else rank - 1, "next": None if last else rank + 1, "head": 0,
                "cancel_src": None, "cancel_fwd": None}
