"""The proposer seam: what a drafting strategy offers the speculative decoding
loop, and what it may ask of a model's pipeline. No MPI, no model.

A *proposer* drafts speculation trees (micro-batches) below an anchor token.
The loop (:mod:`ggpipe.decoding.pipelined`, PipeInfer section IV) knows only
this protocol; it never learns which strategy it holds. The shape follows
llama.cpp's ``common/speculative.h`` (begin / draft / accept, strategies
chosen by name) and vLLM's n-gram proposer (a pure ``propose()`` tested
without a model).

Life of a proposer (one per decoder; it may keep caches across requests):

* ``start(params, rng, acceptance)`` at the start of each request (with
  ``acceptance``, a calibration draft probability -> P(accepted), the cutoff
  applies to the product of calibrated acceptance along a path), ``prefill(context)``
  once the prompt is known (may start work and return at once);
* ``begin(context, cutoff, max_nodes, first_cutoff, look_cutoff)`` starts a
  micro-batch below ``context[-1]`` (the anchor, at position
  ``len(context) - 1``); ``first_cutoff`` (default ``cutoff``) applies to the
  first token below the anchor, which needs no draft step of its own; a
  proposer whose next token costs a draft step takes that step only while
  the chain's path probability is at least ``look_cutoff`` (0: always);
* while ``active``: ``ready()`` says ``poll()`` would make progress without
  waiting; ``poll()`` makes it and returns the finished tree (possibly empty:
  nothing worth verifying), or None while drafting goes on;
* continuous speculation (PipeInfer IV.B.1): ``can_cut()`` / ``cut(cutoff,
  room)`` hand over the tree drafted so far and keep drafting below its tip
  (at most ``room(tip position)`` nodes);
* ``salvage(decided)``: the target decided ``decided`` below the anchor of the
  tree being drafted; the part of that tree below them, if they lead into it;
* ``observe(context)``: the tokens decided so far (prompt and accepted
  tokens), after each decision; a proposer that learns from outcomes
  (the vote's member weights) reads them here;
* ``abandon()`` drops the micro-batch; ``busy()`` / ``drain_one()`` consume
  results of work already started; ``settle()`` consumes all of them;
* ``reset()``: the KV caches were cleared (a new conversation).

A proposer that drafts for another model talks to its pipeline only through
:class:`ggpipe.backend.DecodeBackend` (``ggpipe.pipeline.driver.Pipeline`` is one; the unit
tests use an in-memory fake).

Registration: :data:`REGISTRY` maps a ``--spec-type`` name to the class that
implements it, as ``"module:Class"`` (imported on first use); a new strategy
is one new module here plus one line in that table.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from ggpipe.backend import DecodeBackend
from ggpipe.kv_reuse import reusable_prefix
from ggpipe.sampling import SamplingParams
from ggpipe.speculation.cutoff import confident_depth
from ggpipe.speculation.tree import SpecTree


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
        ngram_min, ngram_max: shortest / longest suffix an n-gram lookup matches (tokens).
        timeout_s: bound of every wait for the backend (seconds).
        vote: the members of ``--spec-type vote`` (registered names, in
            tie-break order).
        guesses: staged: most n-gram guesses per draft run (tokens); None:
            the guess budget decides.
        more_backends: the pipelines of further draft models (``-md a,b``:
            every one but the first); only a vote drafts with them (its
            ``draft`` member stands for one member per draft model).
    """

    backend: DecodeBackend | None = None
    n_vocab: int = 0
    n_ubatch: int = 512
    p_split: float = 0.2
    width: int = 1
    ngram_min: int = 1
    ngram_max: int = 4
    timeout_s: float = 60.0
    vote: tuple[str, ...] = ("draft", "ngram")
    guesses: int | None = None
    more_backends: tuple = ()


@runtime_checkable
class Proposer(Protocol):
    """A drafting strategy (see the module docstring for the call order).

    Attributes:
        name: the ``--spec-type`` name.
        iid_children: every child a tree offers is an independent draw from
            the distribution it carries (``SpecTree.draft_probs``), so
            stochastic (SpecInfer MSS) verification stays exact.
        instant: drafting costs nothing worth overlapping (it happens on the
            head inside ``begin``; ``poll`` never waits).
        stats: counters for ``--json`` (strategy specific).
        step_s: measured seconds per drafted token (a one-token draft
            decode from submission to result; 0 for an instant proposer;
            None until measured). Adaptive depth charges it when the target waits for
            the draft (synchronous speculation).

    ``due_in()``: seconds until the next drafted token is expected (<= 0:
    overdue), or None (nothing being drafted, an instant proposer, or no
    estimate yet); ``partial()``: the tree being drafted as far as it has
    grown (read only), or None. The loop's per-pass "wait for the draft or
    send now" decision reads both; a proposer whose ``due_in()`` is None is
    never waited for.
    """

    name: str
    iid_children: bool
    instant: bool
    active: bool
    stats: dict
    step_s: float | None

    def start(self, params: SamplingParams, rng: np.random.Generator,
              acceptance: Callable[[float], float] | None = None) -> None: ...
    def prefill(self, context: list[int]) -> None: ...
    def begin(self, context: list[int], cutoff: float, max_nodes: int,
              first_cutoff: float | None = None, look_cutoff: float = 0.0) -> None: ...
    def ready(self) -> bool: ...
    def poll(self) -> SpecTree | None: ...
    def can_cut(self) -> bool: ...
    def cut(self, cutoff: float, room: Callable[[int], int]) -> tuple[SpecTree, int]: ...
    def salvage(self, decided: list[int]) -> tuple[SpecTree, int] | None: ...
    def observe(self, context: list[int]) -> None: ...
    def abandon(self) -> None: ...
    def busy(self) -> bool: ...
    def drain_one(self, timeout_s: float) -> None: ...
    def drain_ready(self) -> None: ...
    def settle(self, timeout_s: float) -> None: ...
    def reset(self) -> None: ...
    def due_in(self) -> float | None: ...
    def partial(self) -> SpecTree | None: ...


REGISTRY: dict[str, str] = {
    "draft": "ggpipe.speculation.proposers.draft_model:DraftModelProposer",
    "ngram": "ggpipe.speculation.proposers.ngram:NgramProposer",
    "vote": "ggpipe.speculation.proposers.vote:VoteProposer",
    "staged": "ggpipe.speculation.proposers.staged:StagedProposer",
}


def proposer_class(name: str) -> type:
    """The class registered as ``name``.

    Raises:
        ValueError: no proposer of that name."""
    try:
        mod, cls = REGISTRY[name].split(":")
    except KeyError:
        raise ValueError(f"unknown speculation type {name!r}: choose one of {', '.join(REGISTRY)}") from None
    return getattr(importlib.import_module(mod), cls)


def make_proposer(name: str, cfg: ProposerConfig) -> Proposer:
    """Build the proposer registered as ``name`` from ``cfg``.

    Raises:
        ValueError: unknown name, or the proposer needs what ``cfg`` lacks
            (e.g. ``draft`` without a draft model)."""
    return proposer_class(name)(cfg)


class InstantProposer:
    """Base of proposers that draft synchronously on the head from the
    context alone (no model, no backend): ``begin`` computes the tree with
    :meth:`propose`, ``poll`` hands it over. Subclasses implement
    ``propose(context, max_nodes) -> SpecTree``."""

    iid_children = True
    instant = True
    step_s = 0.0

    def __init__(self) -> None:
        self.active = False
        self.stats: dict = {}
        self._tree: SpecTree | None = None
        self.acceptance: Callable[[float], float] | None = None

    def start(self, params: SamplingParams, rng: np.random.Generator,
              acceptance: Callable[[float], float] | None = None) -> None:
        self.active = False
        self._tree = None
        self.acceptance = acceptance

    def prefill(self, context: list[int]) -> None:
        pass

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
        raise NotImplementedError

    def ready(self) -> bool:
        return self.active

    def poll(self) -> SpecTree | None:
        if not self.active:
            return None
        self.active = False
        tree, self._tree = self._tree, None
        return tree

    def due_in(self) -> float | None:
        """Never waited for: the tree is there as soon as it is begun."""
        return None

    def partial(self) -> SpecTree | None:
        """None: nothing grows in the background."""
        return None

    def can_cut(self) -> bool:
        return False

    def cut(self, cutoff: float, room: Callable[[int], int]) -> tuple[SpecTree, int]:
        raise RuntimeError("nothing to cut: this proposer drafts a whole micro-batch at once")

    def salvage(self, decided: list[int]) -> tuple[SpecTree, int] | None:
        return None

    def observe(self, context: list[int]) -> None:
        pass

    def abandon(self) -> None:
        self.active = False
        self._tree = None

    def busy(self) -> bool:
        return False

    def drain_one(self, timeout_s: float) -> None:
        raise RuntimeError("nothing in flight")

    def drain_ready(self) -> None:
        pass

    def settle(self, timeout_s: float) -> None:
        self.abandon()

    def reset(self) -> None:
        self.abandon()
