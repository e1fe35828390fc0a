"""The decoding plan: what the command line decides about decoding,
resolved once (:meth:`DecodingPlan.resolve`) and handed as one value to
the job (``ggpipe.service.job.JobSpec``), the engine, the loop's factory
(``ggpipe.decoding.factory``) and the simulator, so that no later code
looks a mode up by its name or asks ``--parallel`` what it means.

Pure data over the mode registry (``ggpipe.decoding.mode``); no MPI.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ggpipe.decoding.mode import Mode, mode_class
from ggpipe.decoding.settings import SpecSettings


@dataclass(frozen=True)
class DecodingPlan:
    """How a job decodes.

    Attributes:
        name: the ``--mode`` name the mode is registered under.
        mode: its class (``ggpipe.decoding.mode.Mode``), whose declarations
            the plan's properties read.
        spec: the speculation settings (read by the modes that draft).
        slots: requests at once (``--parallel``); 1: one request at a
            time, each run to its end by the mode's own decoder; above 1:
            the continuous-batching scheduler, one KV stream per slot.
        micro_batches: the scheduler's micro-batches in flight
            (``--micro-batches``); None: as many as the target's stages
            can compute at once.

    Build it with :meth:`resolve`, which checks the settings once.
    """

    name: str
    mode: type[Mode]
    spec: SpecSettings = field(default_factory=SpecSettings)
    slots: int = 1
    micro_batches: int | None = None

    @classmethod
    def resolve(cls, mode: str = "iterative", spec: SpecSettings | None = None, *, n_draft_models: int = 1,
                slots: int = 1, micro_batches: int | None = None) -> "DecodingPlan":
        """The plan of ``--mode mode`` with ``spec``, checked against the
        mode's own rules (``Mode.check``) for ``n_draft_models`` draft
        models (``-md a,b``: 2).

        Raises:
            ConfigError: an unknown mode; settings the mode refuses (several
                draft models outside a vote, an unknown ``--spec-type``)."""
        spec = spec if spec is not None else SpecSettings()
        declared = mode_class(mode)
        declared.check(spec, n_draft_models)
        return cls(mode, declared, spec, slots, micro_batches)

    def with_slots(self, slots: int, micro_batches: int | None = None) -> "DecodingPlan":
        """The same plan with ``slots`` slots and ``micro_batches`` in flight."""
        return replace(self, slots=slots, micro_batches=micro_batches)

    @property
    def speculates(self) -> bool:
        """The mode drafts tokens and verifies them (``Mode.speculates``)."""
        return self.mode.speculates

    @property
    def in_slots(self) -> bool:
        """Requests go through the continuous-batching scheduler (``slots`` > 1)."""
        return self.slots > 1

    @property
    def async_head(self) -> bool:
        """The head's own target stage runs on a thread of its own: the
        asynchronous modes, and the scheduler's micro-batches (the head
        samples one group while its stage computes the next)."""
        return self.mode.asynchronous or self.in_slots

    @property
    def cancels_runs(self) -> bool:
        """The head may cancel a run it submitted: one request at a time in
        a mode that declares it may (``Mode.may_cancel``). The scheduler
        never cancels a run (a dropped row's cells are removed after it)."""
        return not self.in_slots and self.mode.may_cancel(self.spec)

    @property
    def seq_ids(self) -> int:
        """KV sequence ids the target contexts need with ``--n-seq-max``
        unset and one slot (``Mode.seq_ids``); the scheduler's slots are
        its sequences."""
        return self.slots if self.in_slots else self.mode.seq_ids(self.spec)

    @property
    def start_note(self) -> str | None:
        """The line the head prints at start-up when the mode is not what it
        is one request at a time (``Mode.in_slots``), or None."""
        return self.mode.in_slots(self.spec) if self.in_slots else None
