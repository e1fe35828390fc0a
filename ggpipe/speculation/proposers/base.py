"""The proposer seam: what a drafting strategy offers the speculative decoding
loop, and what it may ask of a model's pipeline. No MPI, no model.

A *proposer* drafts speculation trees (micro-batches) below an anchor token.
The loop (:mod:`ggpipe.decoding`, PipeInfer section IV) knows only this
protocol; it never learns which strategy it holds. The shape follows
llama.cpp's ``common/speculative.h`` (strategies chosen by name,
``--spec-type``; a strategy is ``common_speculative_begin`` /
``common_speculative_draft`` / ``common_speculative_accept``) and vLLM's
n-gram proposer (a pure ``propose()`` tested without a model).

Core (:class:`Proposer`, what the loop always needs), one proposer per
decoder (it may keep caches across requests):

* llama.cpp's *begin* (``common_speculative_begin(spec, prompt)``):
  ``start(params, key, acceptance)`` at the start of each request (with
  ``acceptance``, a calibration draft probability -> P(accepted), the cutoff
  applies to the product of calibrated acceptance along a path), then
  ``prefill(context)`` once the prompt is known (may start work and return
  at once);
* llama.cpp's *draft* (``common_speculative_draft(spec, params, prompt,
  id_last)``), asynchronous here: ``begin(context, cutoff, max_nodes,
  first_cutoff, look_cutoff)`` starts a micro-batch below ``context[-1]``
  (the anchor, at position ``len(context) - 1``); ``first_cutoff`` (default
  ``cutoff``) applies to the first token below the anchor, which needs no
  draft step of its own; a proposer whose next token costs a draft step
  takes that step only while the chain's path probability is at least
  ``look_cutoff`` (0: always). While ``active``: ``ready()`` says ``poll()``
  would make progress without waiting; ``poll()`` makes it and returns the
  finished tree (possibly empty: nothing worth verifying), or None while
  drafting goes on; ``abandon()`` drops the micro-batch;
* llama.cpp's *accept* (``common_speculative_accept(spec, n_accepted)``):
  ``observe(context)``, the tokens decided so far (prompt and accepted
  tokens) after each decision, rather than a count (drafts are trees, and
  drafting runs ahead of the decisions); a proposer that learns from
  outcomes (the vote's member weights) reads them here;
* ``settle(timeout_s)``: the request ends (in-flight work consumed, the
  micro-batch dropped); ``reset()``: the KV caches were cleared (a new
  conversation).

Capabilities, optional (:class:`Cuttable`, :class:`Draining`; the loop may
call them on any proposer, and :class:`ProposerBase` answers "none" for a
strategy that does not have them; :func:`implements` tells which do):

* :class:`Cuttable`, continuous speculation (PipeInfer IV.B.1): ``can_cut()``
  / ``cut(cutoff, room)`` hand over the tree drafted so far and keep
  drafting below its tip (at most ``room(tip position)`` nodes);
  ``salvage(decided)``: the target decided ``decided`` below the anchor of
  the tree being drafted; the part of that tree below them, if they lead
  into it; ``due_in()`` / ``partial()``: when the next drafted token is
  expected and the tree as far as it has grown (the loop's "wait for the
  draft or send now" decision);
* :class:`Draining`, work in flight on another pipeline: ``busy()`` /
  ``drain_one()`` / ``drain_ready()`` consume results of work already
  started (e.g. of an abandoned micro-batch).

A proposer that drafts for another model talks to its pipeline only through
:class:`ggpipe.backend.DecodeBackend` (``ggpipe.pipeline.driver.Pipeline`` is one; the unit
tests use an in-memory fake).

A strategy is one class (usually one module here), which declares itself
(:class:`ProposerBase`: ``name``, ``summary``, ``aliases``,
``needs_draft_model``, ``Options``, ``p_accept_auto_in``), and one entry in
:data:`REGISTRY` (``"module:Class"``, imported on first use, or the class;
plug-ins and tests call :func:`register`). The command line
(``ggpipe.cli.strategies``), the settings (``SpecSettings``) and the
factory read those declarations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from ggpipe.backend import DecodeBackend
from ggpipe.errors import ConfigError
from ggpipe.kv_reuse import reusable_prefix
from ggpipe.plugins import registered
from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.proposers.defaults import EVERY_MODE, InstantProposer, ProposerBase
from ggpipe.speculation.proposers.options import StrategyOptions
from ggpipe.speculation.tree import SpecTree

__all__ = ["EVERY_MODE", "REGISTRY", "Cuttable", "Draining", "InstantProposer", "Proposer", "ProposerBase",
           "ProposerConfig", "canonical_name", "implements", "make_proposer", "proposer_class",
           "proposer_classes", "register", "strategy_aliases", "sync_kv", "unregister"]


def sync_kv(pipe: DecodeBackend, cursor: list[int], context: list[int], n_ubatch: int,
            want_logits: bool) -> tuple[int, bool]:
    """Make sequence 0 of a draft's KV, which holds ``cursor`` (positions
    0..), hold ``context`` instead: cells after the common prefix are removed
    and the rest of ``context`` is decoded (all of it when the logits of its
    last token are wanted: that token is decoded again). ``cursor`` is
    updated in place.

    Returns:
        (draft runs submitted, whether cells were removed)."""
    common = reusable_prefix(cursor, context, need_logits=want_logits)
    cut = common < len(cursor)
    if cut:
        pipe.seq_rm(0, common, -1)
        del cursor[common:]
    todo = context[common:]
    n = pipe.submit_prompt(todo, common, n_ubatch, want_logits=want_logits)
    cursor.extend(todo)
    return n, cut


@dataclass
class ProposerConfig:
    """What every proposer may be built from (each takes what it needs).

    Attributes:
        backend: the draft model's pipeline (None when the job has no draft model).
        n_vocab: vocabulary size (tokens), shared by target and draft.
        n_ubatch: largest decode a proposer may start (tokens).
        p_split: draft probability above which a runner-up becomes a sibling leaf.
        width: most leaves (KV sequences) per tree.
        timeout_s: bound of every wait for the backend (seconds).
        options: each strategy's own settings (``--spec-type`` name ->
            its ``Options``; absent: defaults); a proposer reads
            ``options.of(ItsClass)`` (and those of strategies it builds on).
        more_backends: the pipelines of further draft models (``-md a,b``:
            every one but the first); only a vote drafts with them (its
            ``draft`` member stands for one member per draft model).
    """

    backend: DecodeBackend | None = None
    n_vocab: int = 0
    n_ubatch: int = 512
    p_split: float = 0.2
    width: int = 1
    timeout_s: float = 60.0
    options: StrategyOptions = field(default_factory=StrategyOptions)
    more_backends: tuple = ()


@runtime_checkable
class Proposer(Protocol):
    """A drafting strategy, core (see the module docstring for the call
    order; :class:`ProposerBase` declares the rest of what a strategy is).

    Attributes:
        name: the ``--spec-type`` name.
        instant: drafting costs nothing worth overlapping (it happens on the
            head inside ``begin``; ``poll`` never waits).
        active: a micro-batch is being drafted (``begin`` .. ``poll``'s tree).
        stats: counters for ``--json`` (strategy specific).
        step_s: measured seconds per drafted token (a one-token draft
            decode from submission to result; 0 for an instant proposer;
            None until measured). Adaptive depth charges it when the target waits for
            the draft (synchronous speculation).
        cursor: the tokens in the draft's KV (sequence 0, positions
            0..len-1), or None where the proposer keeps no KV of the context
            (it drafts from the tokens themselves, or through members).
    """

    name: str
    instant: bool
    active: bool
    stats: dict
    step_s: float | None
    cursor: list[int] | None

    def start(self, params: SamplingParams, key: int,
              acceptance: Callable[[float], float] | None = None, *, first_pos: int = 0) -> None:
        """A new request (llama.cpp's ``common_speculative_begin``): its sampling
        parameters and the key of its sampler's noise (``Sampler.key``: a
        drafter that samples draws with the same keyed noise,
        ggpipe.keyed_noise, so its proposals follow the target's picks; the
        noise of the token at position ``p`` is keyed by its output index
        ``p - first_pos``, ``first_pos`` the position of the request's first
        generated token); ``acceptance`` (draft probability ->
        calibrated P(accepted)) makes the cutoff apply to the product of
        calibrated acceptance along a path, None to each token's draft
        probability. Any micro-batch is dropped."""

    def prefill(self, context: list[int]) -> None:
        """The request's prompt is known (``context``: every token so far):
        prepare for drafting (e.g. decode it into the draft's KV); may start work
        and return at once."""

    def begin(self, context: list[int], cutoff: float, max_nodes: int,
              first_cutoff: float | None = None, look_cutoff: float = 0.0) -> None:
        """Start a micro-batch below ``context[-1]`` (the anchor, at position
        ``len(context) - 1``; llama.cpp's ``common_speculative_draft``, made
        asynchronous): nodes whose confidence reaches ``cutoff`` (``first_cutoff``,
        default ``cutoff``, for the first token below the anchor), at most
        ``max_nodes``; a token that costs a draft step is drafted only while the
        chain's path probability is at least ``look_cutoff`` (0: always).

        Raises:
            RuntimeError: a micro-batch is already being drafted."""

    def ready(self) -> bool:
        """:meth:`poll` would make progress now, without waiting."""

    def poll(self) -> SpecTree | None:
        """Make progress without blocking: the finished tree (possibly empty:
        nothing worth verifying), or None while drafting goes on or when no
        micro-batch is being drafted."""

    def abandon(self) -> None:
        """Drop the micro-batch being drafted (work it left in flight is consumed
        later: :class:`Draining`, :meth:`settle`)."""

    def observe(self, context: list[int]) -> None:
        """The tokens decided so far (prompt and accepted tokens), after each
        decision (llama.cpp's ``common_speculative_accept``, with the tokens
        rather than a count); a proposer that learns from outcomes reads them."""

    def settle(self, timeout_s: float) -> None:
        """The request ends: consume the work in flight (each wait at most
        ``timeout_s`` seconds) and drop the micro-batch."""

    def reset(self) -> None:
        """The KV caches were cleared (a new conversation): forget what the
        draft's KV held and drop the micro-batch."""


@runtime_checkable
class Cuttable(Protocol):
    """Continuous speculation (PipeInfer IV.B.1): the tree being drafted can
    be handed over while drafting goes on below its tip.

    ``due_in()``: seconds until the next drafted token is expected (<= 0:
    overdue), or None (nothing being drafted, or no estimate yet);
    ``partial()``: the tree being drafted as far as it has grown (read
    only), or None. The loop's per-pass "wait for the draft or send now"
    decision reads both; a proposer whose ``due_in()`` is None is never
    waited for."""

    def can_cut(self) -> bool:
        """A tree with nodes is being drafted and :meth:`cut` can hand it over now."""

    def cut(self, cutoff: float, room: Callable[[int], int]) -> tuple[SpecTree, int]:
        """Hand over the tree drafted so far and its chain tip's node index; keep
        drafting a new micro-batch below the tip under ``cutoff``, of at most
        ``room(tip position)`` nodes (PipeInfer IV.B.1).

        Raises:
            RuntimeError: nothing to cut (:meth:`can_cut` is False)."""

    def salvage(self, decided: list[int]) -> tuple[SpecTree, int] | None:
        """The target decided ``decided`` (tokens below the anchor of the tree
        being drafted): if they lead into that tree, the part of it below them
        and the tip's index in that part (-1: its anchor); else None. Changes
        nothing (:meth:`cut` then hands the tree over)."""

    def due_in(self) -> float | None:
        """Seconds until the next drafted token is expected (<= 0: overdue), or
        None (nothing being drafted, or no estimate yet: never waited for)."""

    def partial(self) -> SpecTree | None:
        """The tree being drafted as far as it has grown (read only), or None."""


@runtime_checkable
class Draining(Protocol):
    """Work in flight on another pipeline (a draft model's), whose results
    must be consumed even when the micro-batch they were for was abandoned:
    ``busy()`` (some are in flight), ``drain_one(timeout_s)`` (wait, bounded,
    for the oldest and consume it), ``drain_ready()`` (consume those that
    have arrived, never blocking)."""

    def busy(self) -> bool:
        """Results of work this proposer started are still in flight."""

    def drain_one(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s`` seconds) for the oldest result in
        flight and consume it.

        Raises:
            RuntimeError: nothing in flight.
            RankTimeoutError: the result did not come in time."""

    def drain_ready(self) -> None:
        """Consume the results that have already arrived, never blocking."""


def implements(proposer: object, capability: type) -> bool:
    """``proposer`` has ``capability`` (:class:`Cuttable`, :class:`Draining`)
    of its own: every method of it, none of them :class:`ProposerBase`'s
    "none" default."""
    methods = [n for n in vars(capability) if not n.startswith("_")]
    cls = type(proposer)
    return all(callable(getattr(cls, n, None)) and getattr(cls, n) is not getattr(ProposerBase, n, None)
               for n in methods)


REGISTRY: dict[str, str | type] = {
    "draft": "ggpipe.speculation.proposers.draft_model:DraftModelProposer",
    "ngram": "ggpipe.speculation.proposers.ngram:NgramProposer",
    "vote": "ggpipe.speculation.proposers.vote:VoteProposer",
    "staged": "ggpipe.speculation.proposers.staged:StagedProposer",
}


def register(name: str, cls: str | type) -> None:
    """Add the strategy ``name`` (``--spec-type name``): its class, or
    ``"module:Class"`` (imported on first use). The command line, the
    settings and the factory see it from then on.

    Raises:
        ValueError: ``name`` empty or taken, ``cls`` neither a class named
            ``name`` nor a ``"module:Class"`` string."""
    if not name or name in REGISTRY:
        raise ValueError(f"cannot register a proposer as {name!r}: " + ("taken" if name else "no name"))
    if isinstance(cls, type) and getattr(cls, "name", None) != name:
        raise ValueError(f"{cls.__name__}.name is {getattr(cls, 'name', None)!r}, not {name!r}")
    if not isinstance(cls, (str, type)) or (isinstance(cls, str) and cls.count(":") != 1):
        raise ValueError(f"register {name!r} as a class or 'module:Class', not {cls!r}")
    REGISTRY[name] = cls


def unregister(name: str) -> None:
    """Remove the strategy ``name`` (undoes :func:`register`).

    Raises:
        ValueError: no proposer of that name."""
    if REGISTRY.pop(name, None) is None:
        raise ValueError(f"no proposer registered as {name!r}")


def proposer_class(name: str) -> type:
    """The class registered as ``name``.

    Raises:
        ValueError: no proposer of that name."""
    try:
        return registered(REGISTRY, name)
    except KeyError:
        raise ValueError(f"unknown speculation type {name!r}: choose one of {', '.join(REGISTRY)}") from None


def proposer_classes() -> dict[str, type]:
    """Every registered strategy: name -> class, in registration order."""
    return {name: proposer_class(name) for name in REGISTRY}


def strategy_aliases() -> dict[str, str]:
    """Every alias a registered class declares (``aliases``) -> its name.

    Raises:
        ValueError: an alias claimed twice, or that is a registered name."""
    out: dict[str, str] = {}
    for name, cls in proposer_classes().items():
        for alias in cls.aliases:
            if alias in out or alias in REGISTRY:
                raise ValueError(f"--spec-type alias {alias!r} of {name!r} is taken")
            out[alias] = name
    return out


def canonical_name(name: str) -> str:
    """The registered name ``name`` stands for (an alias's, e.g.
    ``draft-simple`` -> ``draft``); anything else unchanged."""
    return name if name in REGISTRY else strategy_aliases().get(name, name)


def make_proposer(name: str, cfg: ProposerConfig) -> Proposer:
    """Build the proposer registered as ``name`` from ``cfg``.

    Raises:
        ValueError: unknown name, or the proposer needs what ``cfg`` lacks
            (e.g. ``draft`` without a draft model)."""
    return proposer_class(name)(cfg)


def build_proposer(name: str, cfg: ProposerConfig, mode: str) -> Proposer:
    """:func:`make_proposer` for a job in ``--mode mode``, with the errors a
    user reads: a strategy that drafts with the draft model but has none
    names who asked for it (``draft_model_wanted_by``) and how to draft
    without one.

    Raises:
        ConfigError: no draft model where the strategy needs one; a
            proposer that cannot be built from ``cfg`` (its ValueError's
            message)."""
    try:
        cls = proposer_class(name)
        if cls.uses_draft_model(cfg.options) and cfg.backend is None:
            raise ConfigError(f"{cls.draft_model_wanted_by(mode)} needs a draft model: give one with -md "
                              "(e.g. -md smollm2-135m), or draft without one: --spec-type ngram")
        return cls(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
