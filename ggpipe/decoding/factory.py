"""Build the loop requests go through (:func:`build_loop`: the scheduler's
slots, or one slot running the mode's decoder), the decoder of a mode over
a target pipeline and, for the speculative modes, a proposer: the one place
that wires them, shared by the engine (real pipelines) and the simulator
(ggpipe.sim, simulated ones)."""

from __future__ import annotations

from typing import Callable, Sequence

from ggpipe.decoding.mode import BuildContext, Mode, mode_class
from ggpipe.decoding.loop import RequestLoop
from ggpipe.decoding.settings import SpecSettings
from ggpipe.errors import ConfigError
from ggpipe.pipeline.waiting import Wait
from ggpipe.speculation.proposers.base import Proposer, ProposerConfig, make_proposer, proposer_class


def build_decoder(mode: str, spec: SpecSettings, target, draft, *, n_ubatch: int, n_seq_max: int,
                  is_eog: Callable[[int], bool], timeout_s: float,
                  idle: Wait | None = None, more_drafts: Sequence = ()) -> Mode:
    """The decoder of ``mode`` (a name in ``ggpipe.decoding.mode.MODES``).

    Args:
        target: the target pipeline (a ``ggpipe.backend.TargetBackend``:
            ``ggpipe.pipeline.driver.Pipeline``, ``ggpipe.sim.backend.SimPipeline``, ...).
        draft: the draft model's pipeline, or None (no draft model).
        more_drafts: further draft models' pipelines (``-md a,b``): only
            ``--spec-type vote`` drafts with several.
        n_ubatch: prefill chunk size (tokens).
        n_seq_max: KV sequence ids of the target contexts.
        timeout_s: bound of every wait for a result (seconds).
        idle: the speculative loops' wait for "any result" (see
            ``ggpipe.decoding.spec_core.SpecCore``): ``ggpipe.pipeline.waiting.EventWait``
            over the pipelines for real ones, the simulator's clock for
            simulated ones; None: back-off polling.

    Raises:
        ConfigError: unknown mode; a draft-model proposer without a draft
            model; several draft models outside a vote; a proposer that
            cannot be built from these settings.
    """
    cls = mode_class(mode)
    cls.check(spec, 1 + len(more_drafts))
    return cls.build(BuildContext(target=target, draft=draft, more_drafts=tuple(more_drafts), spec=spec,
                                  n_ubatch=n_ubatch, n_seq_max=n_seq_max, is_eog=is_eog, timeout_s=timeout_s,
                                  idle=idle))


def build_chain_drafter(mode: str, spec: SpecSettings, target, draft, *, n_ubatch: int, timeout_s: float,
                        idle: Wait | None = None, more_drafts: Sequence = ()):
    """The continuous-batching scheduler's drafting (``--parallel`` > 1 in a
    speculative mode): ``draft(context, k) -> tokens``, a chain below a
    request that generates alone (ggpipe.decoding.parallel.scheduler). A strategy
    that drafts from the context alone (``chain_lookup``: ``--spec-type
    ngram``'s prompt lookup) drafts instantly; any other (the draft model, ...), a
    :class:`~ggpipe.decoding.parallel.chain_draft.ChainDrafter` over the proposer
    :func:`build_proposer` makes, cut at ``--p-accept`` (with ``auto``, the
    adaptive depth's starting threshold).

    Raises:
        ConfigError: as :func:`build_proposer`."""
    from ggpipe.decoding.parallel.chain_draft import ChainDrafter, LookupDrafter  # noqa: PLC0415
    lookup = proposer_class(spec.spec_type).chain_lookup(spec.strategy_options)
    if lookup is not None:
        return LookupDrafter(lookup)
    mode_class(mode).check(spec, 1 + len(more_drafts))
    ctx = BuildContext(target=target, draft=draft, more_drafts=tuple(more_drafts), spec=spec, n_ubatch=n_ubatch,
                       n_seq_max=1, is_eog=lambda t: False, timeout_s=timeout_s, idle=idle)
    cutoff = spec.p_accept if spec.p_accept is not None else spec.default_threshold
    return ChainDrafter(build_proposer(ctx, mode), cutoff, idle=idle, timeout_s=timeout_s)


def build_scheduler(mode: str, spec: SpecSettings, target, drafts: Sequence = (), *, slots: int, n_ctx_slot: int,
                    n_batch: int, is_eog: Callable[[int], bool], depth: int | None, timeout_s: float,
                    idle: Wait | None = None, target_hosts: Sequence[str] = (), partial_reuse: bool = True,
                    doing: Callable[..., None] | None = None):
    """The continuous-batching scheduler of ``--parallel`` ``slots`` in
    ``mode`` (ggpipe.decoding.parallel.scheduler), as ``serve``, ``batch``
    and ``simulate`` run it: in a speculative mode with the chain drafter of
    :func:`build_chain_drafter` over ``drafts`` (the draft pipelines, the
    first drafting), and in a mode that declares ``lookahead_in_slots``
    with look-ahead rows where
    :func:`~ggpipe.decoding.parallel.lone_drafts.lookahead_wanted` says
    (``target_hosts``: each target rank's host).

    Args:
        n_ctx_slot: KV cells of one slot (tokens).
        n_batch: most tokens per micro-batch (``-b``; also the chain
            drafter's prefill chunk).
        depth: micro-batches in flight (None: the target's stages).
        timeout_s: bound of every wait (seconds).
        partial_reuse: the target's KV cells can be kept up to any position
            (False for recurrent and hybrid models; see the scheduler).
        doing: tells what the job is doing (see the scheduler), or None.

    Raises:
        ConfigError: as :func:`build_chain_drafter`; a bad ``GGPIPE_LOOKAHEAD``."""
    from ggpipe.decoding.parallel.lone_drafts import lookahead_wanted  # noqa: PLC0415
    from ggpipe.decoding.parallel.scheduler import Scheduler  # noqa: PLC0415
    declared = mode_class(mode)
    drafter = None
    if declared.speculates:
        drafter = build_chain_drafter(mode, spec, target, drafts[0] if drafts else None, more_drafts=drafts[1:],
                                      n_ubatch=n_batch, timeout_s=timeout_s, idle=idle)
    lookahead = declared.lookahead_in_slots and lookahead_wanted(list(target_hosts),
                                                                 drafter is not None and drafter.has_ranks)
    return Scheduler(target, slots, n_ctx_slot, n_batch, is_eog, depth=depth, timeout_s=timeout_s, idle=idle,
                     draft=drafter, draft_max=spec.draft_max, lookahead=lookahead, partial_reuse=partial_reuse,
                     doing=doing)


def build_loop(mode: str, spec: SpecSettings, target, drafts: Sequence = (), *, slots: int, n_ctx: int,
               n_batch: int, n_seq_max: int, is_eog: Callable[[int], bool], depth: int | None, timeout_s: float,
               idle: Wait | None = None, target_hosts: Sequence[str] = (), partial_reuse: bool = True,
               reuse_kv: bool = True, recover: Callable[[], None] = lambda: None,
               doing: Callable[..., None] | None = None) -> RequestLoop:
    """The one loop every front end's requests go through
    (:class:`~ggpipe.decoding.loop.RequestLoop`): with ``slots`` > 1 the
    continuous-batching scheduler (:func:`build_scheduler`; ``n_ctx``: the
    cells of one slot); with one slot,
    :class:`~ggpipe.decoding.one_at_a_time.OneAtATime` over the mode's own
    decoder (:func:`build_decoder`), each request run to its end in full
    (``n_ctx``: the context; ``reuse_kv``: keep a shared prefix's cells;
    ``recover``: after a request failed unexpectedly). ``n_batch``: the
    most tokens of one micro-batch (``-b``): the scheduler's token budget,
    and the decoders' prefill chunk.

    Raises:
        ConfigError: as :func:`build_scheduler` and :func:`build_decoder`."""
    if slots > 1:
        return build_scheduler(mode, spec, target, drafts, slots=slots, n_ctx_slot=n_ctx, n_batch=n_batch,
                               is_eog=is_eog, depth=depth, timeout_s=timeout_s, idle=idle,
                               target_hosts=target_hosts, partial_reuse=partial_reuse, doing=doing)
    from ggpipe.decoding.one_at_a_time import OneAtATime  # noqa: PLC0415
    decoder = build_decoder(mode, spec, target, drafts[0] if drafts else None, more_drafts=drafts[1:],
                            n_ubatch=n_batch, n_seq_max=n_seq_max, is_eog=is_eog, timeout_s=timeout_s, idle=idle)
    return OneAtATime(decoder, n_ctx, target, reuse_kv=reuse_kv, partial_reuse=partial_reuse, recover=recover,
                      doing=doing, n_batch=n_batch)


def build_proposer(ctx: BuildContext, mode: str) -> Proposer:
    """The drafting strategy ``--spec-type`` names, over the draft pipelines
    of ``ctx`` (the speculative and pipeinfer modes).

    Raises:
        ConfigError: a draft-model proposer without a draft model; a
            proposer that cannot be built from these settings."""
    spec = ctx.spec
    if spec.uses_draft_model and ctx.draft is None:
        what = "--spec-vote with a draft-model proposer" if spec.spec_type == "vote" else f"--mode {mode}"
        raise ConfigError(f"{what} needs a draft model: give one with -md (e.g. -md smollm2-135m), "
                          "or draft without one: --spec-type ngram")
    try:
        return make_proposer(spec.spec_type, ProposerConfig(
            backend=ctx.draft, n_vocab=ctx.target.n_vocab, n_ubatch=ctx.n_ubatch, p_split=spec.p_split,
            width=spec.branches, timeout_s=ctx.timeout_s, options=spec.strategy_options,
            more_backends=tuple(ctx.more_drafts)))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
