"""Base classes of drafting strategies: the declarations the registry, the
command line and the settings read, and no-op defaults of every method the
loop may call, so that a strategy writes only what it uses (see
:mod:`ggpipe.speculation.proposers.base` for the protocol they implement).
"""

from __future__ import annotations

from collections.abc import Container
from typing import Callable, ClassVar

from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.cutoff import confident_depth
from ggpipe.speculation.proposers.options import NoOptions, StrategyOptions
from ggpipe.speculation.tree import SpecTree


class _EveryMode(Container[str]):
    def __contains__(self, mode: object) -> bool:
        return True

    def __repr__(self) -> str:
        return "EVERY_MODE"


#: ``p_accept_auto_in`` of a strategy whose --p-accept defaults to auto in every mode.
EVERY_MODE: Container[str] = _EveryMode()


class ProposerBase:
    """What a drafting strategy declares, and the defaults of the optional
    capabilities (``Cuttable``, ``Draining``: nothing to cut, nothing in
    flight) and of the core methods that may do nothing (``prefill``,
    ``observe``; ``settle`` and ``reset`` drop the micro-batch). A subclass
    writes ``start``, ``begin``, ``ready``, ``poll`` and ``abandon`` (or
    derives from :class:`InstantProposer`, which writes them).

    Class attributes (declarations):
        name: the ``--spec-type`` name (the registry key).
        summary: a phrase for ``--spec-type``'s help.
        aliases: further ``--spec-type`` names (llama.cpp's), e.g. ``draft-simple``.
        needs_draft_model: drafts with the draft model (``-md``); a proposer
            built without one raises ValueError.
        Options: a frozen dataclass of the strategy's own settings, whose
            fields declare their command-line options
            (:func:`ggpipe.speculation.proposers.options.option`).
        p_accept_auto_in: the modes in which ``--p-accept`` defaults to
            ``auto`` for this strategy (where it measured better,
            docs/user-guide/speculative.md, Knobs); elsewhere the fixed cutoff
            (``SpecSettings.p_accept``). :data:`EVERY_MODE`: everywhere.
        bench_variants: ``ggpipe bench --modes`` name -> ``ggpipe generate``
            arguments of the rows this strategy adds to the benchmark (none
            by default: the modes' rows draft with the default strategy).
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    needs_draft_model: ClassVar[bool] = False
    Options: ClassVar[type] = NoOptions
    p_accept_auto_in: ClassVar[Container[str]] = ()
    bench_variants: ClassVar[dict[str, list[str]]] = {}
    cursor: list[int] | None = None   # no KV of the context (a draft model's proposer keeps one)

    # -- declarations that depend on the settings (a vote asks its members) -----

    @classmethod
    def uses_draft_model(cls, options: StrategyOptions) -> bool:
        """Drafting with these settings needs the draft model (``-md``)."""
        return cls.needs_draft_model

    @classmethod
    def draft_model_wanted_by(cls, mode: str) -> str:
        """Who asks for the draft model, in the error a job without one
        gets (``--mode NAME`` by default)."""
        return f"--mode {mode}"

    @classmethod
    def chain_lookup(cls, options: StrategyOptions):
        """``draft(context, k) -> tokens`` where this strategy drafts a
        chain from the request's own tokens alone, in microseconds (the
        ``--parallel`` scheduler then drafts for many slots at no cost, and
        ``--parallel auto`` gives a speculative job many slots); None where
        drafting takes a model's passes (the default)."""
        return None

    @classmethod
    def p_accept_auto(cls, mode: str, options: StrategyOptions) -> bool:
        """``--p-accept`` defaults to ``auto`` (True) or to the fixed cutoff
        (False) for this strategy in ``mode`` (the CLI's mode name)."""
        return mode in cls.p_accept_auto_in

    @classmethod
    def several_draft_models(cls, options: StrategyOptions) -> bool:
        """Drafts with every draft model of ``-md a,b`` (only a vote does)."""
        return False

    @classmethod
    def check_options(cls, options: StrategyOptions, n_models: int) -> None:
        """Refuse settings that cannot work with ``n_models`` draft models,
        before anything is built (nothing to refuse here).

        Raises:
            ValueError: the message the user sees."""

    # -- core methods that may do nothing ---------------------------------------

    def prefill(self, context: list[int]) -> None:
        """The prompt is known (nothing to prepare)."""

    def observe(self, context: list[int]) -> None:
        """The tokens decided so far (nothing learnt from them)."""

    def settle(self, timeout_s: float) -> None:
        """The request ends: drop the micro-batch (nothing in flight)."""
        self.abandon()

    def reset(self) -> None:
        """The KV caches were cleared: drop the micro-batch (nothing cached)."""
        self.abandon()

    # -- Cuttable: continuous speculation (none) ---------------------------------

    def can_cut(self) -> bool:
        """False: this proposer drafts a whole micro-batch at once."""
        return False

    def cut(self, cutoff: float, room: Callable[[int], int]) -> tuple[SpecTree, int]:
        """Nothing to cut.

        Raises:
            RuntimeError: always (see :meth:`can_cut`)."""
        raise RuntimeError("nothing to cut: this proposer drafts a whole micro-batch at once")

    def salvage(self, decided: list[int]) -> tuple[SpecTree, int] | None:
        """None: nothing is drafted in the background."""
        return None

    def due_in(self) -> float | None:
        """Never waited for: nothing is drafted in the background."""
        return None

    def partial(self) -> SpecTree | None:
        """None: nothing grows in the background."""
        return None

    # -- Draining: work in flight (none) -----------------------------------------

    def busy(self) -> bool:
        """False: nothing in flight."""
        return False

    def drain_one(self, timeout_s: float) -> None:
        """Nothing to consume.

        Raises:
            RuntimeError: always (nothing in flight)."""
        raise RuntimeError("nothing in flight")

    def drain_ready(self) -> None:
        """Nothing to consume."""
        pass


class InstantProposer(ProposerBase):
    """Base of proposers that draft synchronously on the head from the
    context alone (no model, no backend): ``begin`` computes the tree with
    :meth:`propose`, ``poll`` hands it over. Subclasses implement
    ``propose(context, max_nodes) -> SpecTree`` (a tree below
    ``context[-1]``, at most ``max_nodes`` nodes)."""

    instant = True
    step_s = 0.0

    def __init__(self) -> None:
        self.active = False
        self.stats: dict = {}
        self._tree: SpecTree | None = None
        self.acceptance: Callable[[float], float] | None = None

    def start(self, params: SamplingParams, key: int,
              acceptance: Callable[[float], float] | None = None, *, first_pos: int = 0) -> None:
        """A new request: drop any micro-batch; keep ``acceptance`` for
        :meth:`begin`'s cutoff (``params``, ``key`` and ``first_pos`` are not used here)."""
        self.active = False
        self._tree = None
        self.acceptance = acceptance

    def begin(self, context: list[int], cutoff: float, max_nodes: int,
              first_cutoff: float | None = None, look_cutoff: float = 0.0) -> None:
        """Draft at once. With a calibration (``start(..., acceptance)``), a
        chain is cut where the product of calibrated acceptance of its nodes'
        confidences (``SpecTree.draft_p``) falls below ``cutoff``
        (``first_cutoff`` for its first node); without one, the cutoff (a
        draft model's probability) does not apply. ``look_cutoff`` does not
        apply (drafting costs no draft step)."""
        if self.active:
            raise RuntimeError("a micro-batch is already being drafted")
        tree = self.propose(list(context), max_nodes)
        if self.acceptance is not None:
            keep = confident_depth(tree.draft_p, cutoff, first_cutoff, self.acceptance)
            if keep < len(tree):
                tree = tree.prefix(keep)
        self._tree = tree
        self.active = True

    def propose(self, context: list[int], max_nodes: int) -> SpecTree:  # pragma: no cover - abstract
        """A tree below ``context[-1]`` of at most ``max_nodes`` nodes (each
        subclass's drafting rule)."""
        raise NotImplementedError

    def ready(self) -> bool:
        """True while a micro-batch is active: its tree was drafted in :meth:`begin`."""
        return self.active

    def poll(self) -> SpecTree | None:
        """The tree :meth:`begin` drafted (the micro-batch ends), or None when
        none is active."""
        if not self.active:
            return None
        self.active = False
        tree, self._tree = self._tree, None
        return tree

    def abandon(self) -> None:
        """Drop the drafted tree (nothing in flight)."""
        self.active = False
        self._tree = None
