"""Decoding settings: the modes and the speculation knobs (CLI names in
brackets). Pure data; what a drafting strategy is and needs is asked of its
class (``ggpipe.speculation.proposers.base.REGISTRY``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ggpipe.errors import ConfigError
from ggpipe.speculation.adaptive import AdaptiveCutoff, Calibration
from ggpipe.speculation.cutoff import CutoffController
from ggpipe.speculation.proposers.base import proposer_class
from ggpipe.speculation.proposers.options import StrategyOptions


@dataclass(frozen=True)
class SpecSettings:
    """Speculation knobs (CLI names in brackets).

    Attributes:
        spec_type: the drafting strategy, a name in
            ``ggpipe.speculation.proposers.base.REGISTRY`` [--spec-type]:
            "draft" (the draft model, -md), "ngram" (prompt lookup, no model)
            "vote" (Minions' majority vote of its members) or "staged" (the
            draft model with n-gram draft-of-draft, Staged SD).
        draft_max: most draft tokens per tree / micro-batch (llama.cpp's
            ``--draft-max``) [--draft-max, --draft].
        p_accept: confidence cutoff [--p-accept]; None (``auto``):
            adaptive depth from the measured pass cost curve and calibrated
            draft acceptance (ggpipe.speculation.adaptive). The CLI's default
            is 0.3 for the draft model in pipeinfer mode (auto measured 3%
            slower there), auto for it in speculative mode (6% faster, with
            the look-ahead rule) and for n-gram drafts (7% faster);
            docs/user-guide/speculative.md (Knobs).
        p_split: runner-up probability that adds a sibling leaf [--p-split].
        p_recovery: cutoff increase per continued micro-batch [--p-recovery].
        p_decay: cutoff decrease per failed idle attempt [--p-decay].
        branches: leaves (KV sequences) per tree [--branches].
        continuous: continuous speculation (pipeinfer) [--no-continuous].
        cancel: early inference cancellation (pipeinfer) [--no-cancel].
        max_inflight: most speculative runs in flight (pipeinfer).
        strategy_options: each strategy's own settings, ``--spec-type``
            name -> its class's ``Options`` (absent: defaults), e.g.
            ``NgramProposer.Options(ngram_min, ngram_max)``
            [--spec-ngram-min, --spec-ngram-max], ``VoteProposer.Options(vote)``
            [--spec-vote], ``StagedProposer.Options(guesses)`` [--spec-guesses].
        tree_width: pipedec: most nodes per prediction-tree layer [--tree-width].
        max_children: pipedec: most children per tree node [--max-children].
        wait_draft: pipeinfer: when the head's target stage runs out of work
            while the draft decodes the next token, wait for it if that gives
            more expected tokens per second of the target
            (ggpipe.speculation.adaptive.wait_pays); False: hand over what is
            drafted at once [--wait-draft/--no-wait-draft].
    """

    spec_type: str = "draft"
    draft_max: int = 6
    p_accept: float | None = 0.3
    p_split: float = 0.2
    p_recovery: float = 0.05
    p_decay: float = 0.05
    branches: int = 1
    continuous: bool = True
    cancel: bool = True
    max_inflight: int = 8
    strategy_options: StrategyOptions = field(default_factory=StrategyOptions)
    tree_width: int = 1     # a chain: exact in every run (docs/user-guide/exactness.md); trees measured slower here
    max_children: int = 4
    wait_draft: bool = True
    default_threshold: float = 0.25  # adaptive: path probability worth a token until costs are measured

    @property
    def uses_draft_model(self) -> bool:
        """The strategy drafts with the draft model (-md), as its class says
        (a vote asks its members).

        Raises:
            ValueError: ``spec_type`` is not registered."""
        return proposer_class(self.spec_type).uses_draft_model(self.strategy_options)

    def cutoff(self, calibration: Calibration, draft_step: Callable[[], float | None] | None):
        """The confidence cutoff of a request's drafting (PipeInfer IV.B.2),
        as every loop that drafts uses it: with ``--p-accept auto``
        (``p_accept`` None), adaptive depth from ``calibration``'s
        measurements (:class:`~ggpipe.speculation.adaptive.AdaptiveCutoff`;
        ``draft_step``: the draft's seconds per drafted token where the
        target waits for the draft, None where drafting overlaps
        verification); otherwise the fixed
        :class:`~ggpipe.speculation.cutoff.CutoffController` of
        ``p_accept``, ``p_recovery`` and ``p_decay``."""
        if self.p_accept is None:
            return AdaptiveCutoff(calibration.acceptance, calibration.pass_cost, self.default_threshold, draft_step,
                                  calibration.decode_rate.rate)
        return CutoffController(self.p_accept, self.p_recovery, self.p_decay)


def check_draft_models(n: int, spec: SpecSettings) -> None:
    """For a mode that drafts with ``spec.spec_type`` (speculative,
    pipeinfer): refuse ``n`` > 1 draft models (``-md a,b``) unless the
    strategy says it drafts with each (``several_draft_models``: a vote with
    a ``draft`` member), and settings the strategy's class refuses with
    ``n`` models (``check_options``: a vote of fewer than two members once
    ``draft`` stands for each model).

    Raises:
        ConfigError: several draft models outside such a vote; a vote of
            one member; an unknown ``spec.spec_type``."""
    try:
        cls = proposer_class(spec.spec_type)
        if n > 1 and not cls.several_draft_models(spec.strategy_options):
            raise ConfigError(f"{n} draft models (-md a,b) draft only in a vote that has a draft member: "
                              "--mode pipeinfer --spec-type vote --spec-vote draft,ngram")
        cls.check_options(spec.strategy_options, n)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
