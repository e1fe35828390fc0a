"""What a decoding mode is: a policy that decides what to submit to the
target next, behind one loop every mode shares, and the registry of modes.

Every mode (``--mode NAME``) is one class in one module of this package,
registered in :data:`MODES` as ``"module:Class"`` (imported on first use):

* it declares itself: ``name``, ``asynchronous`` (the head's own target
  stage runs on an executor thread beside the loop, so the head can draft,
  verify and probe while it computes), ``speculates`` (it drafts tokens
  and verifies them: a draft rank, the speculative overhead, the checks of
  recurrent models), ``tokens_per_pass`` and ``pace`` (what the placement
  balances the stages for), ``lookahead_in_slots`` and ``in_slots(spec)``
  (what it becomes under ``--parallel``, said at start-up),
  ``may_cancel(spec)`` (the workers listen for cancellations),
  ``bench_variants()`` (its rows in ``ggpipe bench``), ``seq_ids(spec)`` (the KV sequence
  ids its target contexts need), ``check(spec, n_draft_models)`` (refuse
  settings it cannot run) and ``build(ctx)`` (its instance over the
  target, the draft pipelines and the settings of :class:`BuildContext`);
* it implements ``open`` (a request's prompt and first token), ``step``
  (one turn of the loop: take a result, submit a run, or wait) and
  ``close`` (the end of a request: runs drained, statistics);
  :meth:`Mode.generate` runs them.

The CLI's ``--mode`` choices, ``ggpipe simulate``, ``plan --balance``,
``bench`` and the session (does the head's stage need its own thread?) read
the registry and these declarations, never a mode's name; a new mode is one
new module plus :func:`register_mode` (``tests/test_toy_mode.py`` adds one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ggpipe.backend import DecodeBackend, TargetBackend
from ggpipe.decoding.request import Emit, Request, _never_stop
from ggpipe.decoding.settings import SpecSettings
from ggpipe.errors import ConfigError
from ggpipe.metrics import GenerationClock
from ggpipe.pipeline.waiting import Wait
from ggpipe.speculation.draft_stats import DraftStats
from ggpipe.speculation.proposers.base import Proposer, ProposerConfig, build_proposer
from ggpipe.plugins import registered
from ggpipe.sampling import Sampler


@dataclass(frozen=True)
class BuildContext:
    """What a mode may be built from.

    Attributes:
        target: the target model's pipeline.
        draft: the first draft model's pipeline, or None (no draft model).
        more_drafts: further draft models' pipelines (``-md a,b``).
        spec: the speculation settings.
        n_ubatch: prefill chunk size (tokens).
        n_seq_max: KV sequence ids of the target contexts.
        is_eog: token -> end of generation?
        timeout_s: bound of every wait for a result (seconds).
        idle: the wait for "any result" (``ggpipe.pipeline.waiting``); None:
            back-off polling.
        n_cells: the target's KV cells (llama.cpp's, ``-c`` rounded up to
            256); None: what the target declares (``n_cells``), or
            unbounded.
    """

    target: TargetBackend
    draft: DecodeBackend | None
    spec: SpecSettings
    n_ubatch: int
    n_seq_max: int
    is_eog: Callable[[int], bool]
    timeout_s: float = 60.0
    idle: Wait | None = None
    more_drafts: Sequence[DecodeBackend] = field(default_factory=tuple)
    n_cells: int | None = None

    def __post_init__(self):
        if self.n_cells is None:
            object.__setattr__(self, "n_cells", self.target.n_cells)

    def proposer(self, mode: str) -> Proposer:
        """The drafting strategy ``--spec-type`` names, over the draft
        pipelines (a mode that drafts; ``mode``: its ``--mode`` name, for
        the errors).

        Raises:
            ConfigError: a draft-model proposer without a draft model; a
                proposer that cannot be built from these settings."""
        spec = self.spec
        return build_proposer(spec.spec_type, ProposerConfig(
            backend=self.draft, n_vocab=self.target.n_vocab, n_ubatch=self.n_ubatch, p_split=spec.p_split,
            width=spec.branches, timeout_s=self.timeout_s, options=spec.strategy_options,
            more_backends=tuple(self.more_drafts)), mode)


class Mode:
    """Base of every mode's policy: the loop they share.

    Attributes:
        name: the ``--mode`` name.
        asynchronous: the head's own target stage runs on an executor thread.
        speculates: drafts tokens and verifies them in target passes (a draft
            model's rank, the speculative per-token overhead in the simulator,
            the refusal of recurrent models); False: one token per pass.
        tokens_per_pass: the tokens a target pass carries, as the placement
            (``plan --balance``) costs a stage.
        pace: what sets the time of a token when the placement balances the
            stages: ``"latency"`` (the stages' sum: one run at a time) or
            ``"bottleneck"`` (the slowest stage: runs overlap, PipeInfer
            section IV).
        lookahead_in_slots: under ``--parallel``, a request alone keeps the
            stages busy with look-ahead rows (the scheduler's form of the
            mode's asynchronous speculation).
        stats: the last request's statistics (``--json``'s ``decoder``).
    """

    name = ""
    asynchronous = False
    speculates = False
    tokens_per_pass = 1
    pace = "latency"
    lookahead_in_slots = False

    def __init__(self) -> None:
        self.stats: dict = {}
        self.r: Request | None = None
        self.core = None     # the speculative core a drafting mode drives (:meth:`_drive`)

    # -- declarations -------------------------------------------------------

    @classmethod
    def seq_ids(cls, spec: SpecSettings) -> int:
        """KV sequence ids the target contexts need for ``spec`` (``--n-seq-max`` unset)."""
        return 1

    @classmethod
    def check(cls, spec: SpecSettings, n_draft_models: int) -> None:
        """Refuse settings this mode cannot run (raises ConfigError)."""
        if n_draft_models > 1:
            raise ConfigError(f"{n_draft_models} draft models (-md a,b) draft only in a vote that has a draft "
                              "member: --mode pipeinfer --spec-type vote --spec-vote draft,ngram")

    @classmethod
    def may_cancel(cls, spec: SpecSettings) -> bool:
        """Whether the head may cancel a run it submitted, one request at a
        time (the workers then listen for cancellations mid-run)."""
        return False

    @classmethod
    def in_slots(cls, spec: SpecSettings) -> str | None:
        """What this mode becomes beside other requests (``--parallel`` > 1,
        the continuous-batching scheduler), in one sentence the head prints
        at start-up; None: the same as one request at a time. A speculating
        mode drafts a chain with its ``--spec-type`` for a request that
        generates alone, verified in a micro-batch of its own, and decodes
        plainly beside other generating requests
        (ggpipe.decoding.parallel.scheduler)."""
        if not cls.speculates:
            return None
        return (f"--mode {cls.name} under --parallel: a request that generates alone gets chains drafted with "
                f"--spec-type {spec.spec_type}, verified in a micro-batch of their own; beside other generating "
                "requests it decodes plainly")

    @classmethod
    def bench_variants(cls) -> dict[str, list[str]]:
        """``ggpipe bench --modes`` name -> ``ggpipe generate`` arguments of
        this mode's rows (its name alone by default)."""
        return {cls.name: ["--mode", cls.name]}

    @classmethod
    def build(cls, ctx: BuildContext) -> "Mode":  # pragma: no cover - abstract
        """The mode's instance over ``ctx``'s target (and, for a mode that drafts,
        its draft pipelines and speculation settings).

        Raises:
            ConfigError: settings the mode cannot be built from."""
        raise NotImplementedError

    # -- the loop -----------------------------------------------------------

    def generate(self, prompt: np.ndarray, n_predict: int, sampler: Sampler, start_pos: int = 0,
                 emit: Emit = _never_stop, clock: GenerationClock | None = None,
                 history: list[int] | None = None) -> list[int]:
        """Generate up to ``n_predict`` tokens after ``prompt`` (int32 (n,)),
        whose first token goes at ``start_pos`` of sequence 0; positions
        0..start_pos-1 of sequence 0 already hold ``history`` (the tokens
        before it; the speculative modes bring their drafts to the same
        context). Stops after an end-of-generation token (included in the
        result). ``emit`` is called with each accepted token list as soon
        as it is accepted; a true return value stops the generation there
        (a stop string, Ctrl-C).

        Raises:
            ValueError: ``history`` does not have ``start_pos`` tokens.
            RankTimeoutError, ProtocolError: from the pipelines."""
        history = list(history or [])
        if len(history) != start_pos:
            raise ValueError(f"history has {len(history)} tokens, start_pos is {start_pos}")
        clock = clock or GenerationClock()
        clock.start()
        r = self.open(prompt, n_predict, sampler, start_pos, emit, clock, history)
        while not r.done:
            self.step()
        self.close()
        r.clock.finish()
        return r.out

    def open(self, prompt: np.ndarray, n_predict: int, sampler: Sampler, start_pos: int, emit: Emit,
             clock: GenerationClock, history: list[int]) -> Request:  # pragma: no cover - abstract
        """Start a request: its prompt through the pipeline and its first token."""
        raise NotImplementedError

    def step(self) -> None:  # pragma: no cover - abstract
        """One turn of the loop (the request is not done)."""
        raise NotImplementedError

    def close(self) -> None:
        """The request is done: settle what is in flight, set ``stats``."""

    def reset(self) -> None:
        """The KV caches were cleared (target and draft)."""

    def drafting(self) -> DraftStats:
        """The running (or last) request's drafting (``/slots`` reads it
        while the request runs, from another thread): its speculation
        graph's counters, or none drafted for a mode without one."""
        if self.core is None or self.r is None:
            return DraftStats()
        return self.r.graph.draft_stats

    def _drive(self, core, observe: Callable[[list[int]], None]) -> None:
        """Drive ``core`` (the speculative modes' core,
        :class:`ggpipe.decoding.spec_core.SpecCore`): its target pipeline
        and counters become this mode's (``target``, ``s``), each root the
        core decides goes to the mode's ``_new_root(token)``, and the
        context to ``observe(tokens)`` (the drafter's)."""
        self.core, self.target, self.s = core, core.target, core.s
        core.on_root = self._new_root
        core.observe = observe


MODES: dict[str, str | type] = {
    "iterative": "ggpipe.decoding.iterative:Iterative",
    "speculative": "ggpipe.decoding.speculative:Speculative",
    "pipeinfer": "ggpipe.decoding.pipeinfer:PipeInfer",
    "pipedec": "ggpipe.decoding.pipedec:PipeDec",
}


def mode_class(name: str) -> type[Mode]:
    """The class registered as ``--mode name``.

    Raises:
        ConfigError: no mode of that name."""
    try:
        return registered(MODES, name)
    except KeyError:
        raise ConfigError(f"unknown mode {name!r}: choose one of {', '.join(MODES)}") from None


def register_mode(name: str, cls: type[Mode] | str) -> None:
    """Register a mode (a class, or ``"module:Class"``) as ``--mode name``
    (plug-ins and tests; the built-in ones are listed in :data:`MODES`)."""
    MODES[name] = cls
