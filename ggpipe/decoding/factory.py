"""Build the decoder of a mode over a target pipeline and, for the
speculative modes, a proposer: the one place that wires them, shared by the
engine (real pipelines) and the simulator (ggpipe.sim, simulated ones)."""

from __future__ import annotations

from typing import Callable, Sequence

from ggpipe.decoding.iterative import IterativeDecoder
from ggpipe.decoding.pipedec import PipeDecDecoder
from ggpipe.decoding.pipelined import SpeculativeDecoder
from ggpipe.decoding.settings import MODES, SpecSettings, check_draft_models
from ggpipe.errors import ConfigError
from ggpipe.pipeline.waiting import Wait
from ggpipe.speculation.layer_drafter import LayerDrafter
from ggpipe.speculation.proposers.base import ProposerConfig, make_proposer


def build_decoder(mode: str, spec: SpecSettings, target, draft, *, n_ubatch: int, n_seq_max: int,
                  is_eog: Callable[[int], bool], timeout_s: float,
                  idle: Wait | None = None, more_drafts: Sequence = ()):
    """The decoder of ``mode`` ("iterative", "speculative", "pipeinfer", "pipedec").

    Args:
        target: the target pipeline (``ggpipe.pipeline.driver.Pipeline`` or
            an object with its verbs, e.g. ``ggpipe.sim.backend.SimPipeline``).
        draft: the draft model's pipeline, or None (no draft model).
        more_drafts: further draft models' pipelines (``-md a,b``): only
            ``--spec-type vote`` drafts with several.
        n_ubatch: prefill chunk size (tokens).
        n_seq_max: KV sequence ids of the target contexts.
        timeout_s: bound of every wait for a result (seconds).
        idle: the speculative loops' wait for "any result" (see
            ``SpeculativeDecoder``): ``ggpipe.pipeline.waiting.EventWait``
            over the pipelines for real ones, the simulator's clock for
            simulated ones; None: back-off polling.

    Raises:
        ConfigError: unknown mode; a draft-model proposer without a draft
            model; several draft models outside a vote; a proposer that
            cannot be built from these settings.
    """
    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    check_draft_models(1 + len(more_drafts), mode, spec)
    if mode == "iterative":
        return IterativeDecoder(target, n_ubatch, is_eog)
    if mode == "pipedec":
        if draft is None:
            raise ConfigError("--mode pipedec needs a draft model: give one with -md (e.g. -md smollm2-135m)")
        try:
            drafter = LayerDrafter(draft, draft.n_seq_max, spec.tree_width, spec.max_children, n_ubatch)
        except ValueError as exc:
            raise ConfigError(f"{exc} (--n-seq-max)") from None
        return PipeDecDecoder(target, drafter, spec, n_seq_max, n_ubatch, is_eog, timeout_s=timeout_s, idle=idle)
    if spec.uses_draft_model and draft is None:
        what = "--spec-vote with a draft-model proposer" if spec.spec_type == "vote" else f"--mode {mode}"
        raise ConfigError(f"{what} needs a draft model: give one with -md (e.g. -md smollm2-135m), "
                          "or draft without one: --spec-type ngram")
    try:
        proposer = make_proposer(spec.spec_type, ProposerConfig(
            backend=draft, n_vocab=target.n_vocab, n_ubatch=n_ubatch, p_split=spec.p_split, width=spec.branches,
            timeout_s=timeout_s, options=spec.strategy_options, more_backends=tuple(more_drafts)))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return SpeculativeDecoder(target, proposer, spec, n_seq_max, n_ubatch, is_eog, timeout_s=timeout_s, idle=idle)
