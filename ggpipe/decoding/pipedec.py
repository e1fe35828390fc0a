"""``--mode pipedec``: pipeline-parallel decoding over a dynamic prediction
tree (PipeDec, Yin et al. 2025, sections 3.1-3.4).

The draft grows the tree one layer per draft run
(:class:`~ggpipe.speculation.layer_drafter.LayerDrafter`) and each layer
enters the target pipeline as one run as soon as the layer above it did, so
every target stage works on another layer of the same request at the same
time. Every node has its own KV sequence in the target contexts: a copy of its
parent's sequence up to the parent (``seq_cp``, metadata only), so nodes of
one layer below different parents attend to their own ancestors only (tree
attention through llama.cpp's per-sequence mask), and the tree's cells stay
apart from the accepted sequence 0 until a hit copies one over.

When the last stage's logits of a node come back, the head decides the next
token (:class:`~ggpipe.speculation.graph.SpecGraph`, shared with
pipeinfer): greedily, or with a temperature by one draw from the target's
distribution matched against the node's children, which the draft chose
rather than sampled (exact: ggpipe.speculation.verify; a seeded run gives
iterative mode's tokens for that seed). A *hit* (a child carries it) keeps only that child's subtree;
in-flight runs whose every node died are cancelled (PipeInfer IV.D), and the
dead rows of runs that keep a live node are masked by every stage that has
not started them (ggpipe.pipeline.masking); a *miss* starts a
non-speculative root run for the decided token and a new tree at it.

Ggpipe's choices where the paper leaves room: the paper advances all stages
in lockstep timesteps; here each layer is sent when formed, with at most
``n_stages + 1`` target runs in flight (the pipeline's depth plus one
queued behind the first stage); a decided token carried by a formed layer
that was not yet sent is a hit as well (the paper checks the draft's tree);
the paper verifies greedily, sampling is ggpipe's addition.

Everything that is not the layer policy (results, swaps into sequence 0,
cancellation, retirement of KV sequences, statistics) is the core's
(:class:`~ggpipe.decoding.spec_core.SpecCore`).
"""

from __future__ import annotations

import numpy as np

from ggpipe.decoding.spec_core import SpecCore
from ggpipe.decoding.mode import BuildContext, Mode
from ggpipe.decoding.request import Emit, SpecRequest
from ggpipe.decoding.settings import SpecSettings
from ggpipe.errors import ConfigError, ProtocolError
from ggpipe.metrics import GenerationClock
from ggpipe.sampling import Sampler
from ggpipe.speculation.cutoff import CutoffController
from ggpipe.speculation.layer_drafter import LayerDrafter
from ggpipe.speculation.partitions import PartitionPool
from ggpipe.speculation.tree import SpecTree


class PipeDec(Mode):
    """Args:
        core: the speculative core over the target pipeline; its pool has
            one partition per layer run, one sequence of it per node
            (retired with the run).
        drafter: the draft side.
    """

    name = "pipedec"
    asynchronous = True
    speculates = True
    tokens_per_pass = 4

    @classmethod
    def may_cancel(cls, spec: SpecSettings) -> bool:
        return spec.cancel

    @classmethod
    def in_slots(cls, spec: SpecSettings) -> str | None:
        """Chains as every speculating mode (:meth:`Mode.in_slots`): PipeDec's
        speculation tree runs one request at a time only (its nodes are KV
        sequences of their own, which the slots are)."""
        return (super().in_slots(spec) + "; PipeDec's speculation tree runs only with --parallel 1 (its nodes are "
                "KV sequences of their own, and under --parallel the sequences are the slots)")

    @classmethod
    def bench_variants(cls) -> dict[str, list[str]]:
        """A chain (tree width 1), and a tree of 4 x 4."""
        return {"pipedec": ["--mode", "pipedec"],
                "pipedec-tree": ["--mode", "pipedec", "--tree-width", "4", "--max-children", "4"]}

    def __init__(self, core: SpecCore, drafter: LayerDrafter):
        super().__init__()
        self.drafter = drafter
        self._drive(core, drafter.observe)

    @classmethod
    def seq_ids(cls, spec: SpecSettings) -> int:
        """One per live tree node: a layer per run in flight, and the layers formed ahead (at most 256)."""
        return min(256, 1 + spec.tree_width * (spec.max_inflight + 3))

    @classmethod
    def build(cls, ctx: BuildContext) -> "PipeDec":
        """Raises:
            ConfigError: no draft model; a draft context without room for a tree."""
        if ctx.draft is None:
            raise ConfigError("--mode pipedec needs a draft model: give one with -md (e.g. -md smollm2-135m)")
        spec = ctx.spec
        try:
            drafter = LayerDrafter(ctx.draft, ctx.draft.n_seq_max, spec.tree_width, spec.max_children, ctx.n_ubatch)
        except ValueError as exc:
            raise ConfigError(f"{exc} (--n-seq-max)") from None
        pool = PartitionPool(ctx.n_seq_max, max(1, min(spec.tree_width, ctx.n_seq_max - 1)))
        core = SpecCore(ctx.target, spec, pool, ctx.n_ubatch, ctx.is_eog, timeout_s=ctx.timeout_s, idle=ctx.idle,
                        cancels=cls.may_cancel(spec), n_cells=ctx.n_cells)
        # the draft's context has the target's -c (ggpipe.cluster.loading) unless its pipeline says
        drafter.n_cells = ctx.draft.n_cells or ctx.n_cells
        return cls(core, drafter)

    @property
    def max_runs(self) -> int:
        """Most target runs in flight: the pipeline's depth plus one."""
        return min(self.s.max_inflight, self.target.n_stages + 1)

    def open(self, prompt: np.ndarray, n_predict: int, sampler: Sampler, start_pos: int, emit: Emit,
             clock: GenerationClock, history: list[int]) -> SpecRequest:
        """The tree's shape is --tree-width / --max-children, not a cutoff; a
        fixed controller keeps the core's bookkeeping. The loop takes the
        draft's prefill results as they come."""
        core = self.core
        r = self.r = core.begin(prompt, n_predict, sampler, emit, clock, history, CutoffController(0.0, 0.0, 0.0))
        self.drafter.start(sampler.params)
        core.submit_prompt(len(prompt), start_pos)
        self.drafter.prefill(r.context[:-1])
        core.first_token(sampler, core.prompt_logits())
        return r

    def step(self) -> None:
        """One turn: a target result first; then a formed layer, while the
        target has room (the target pipeline is what must not idle); then
        the draft's results; else wait for either."""
        r, d, t = self.r, self.drafter, self.target
        if t.ready():
            self.core.handle(t.poll())
            if not r.done:
                d.follow(r.graph)
                self._set_depth()
        elif (len(t.inflight) < self.max_runs and self.core.pool.n_free and self.core.spec_room()
              and d.layer_for_target()):
            self._submit_layer()
        elif d.ready():
            d.poll()
        elif t.inflight or d.busy():
            self.core.idle(lambda: t.ready() or d.ready(), self.core.timeout_s)
        else:
            raise ProtocolError("pipedec: no target or draft run in flight and no layer to send")

    def close(self) -> None:
        self.stats = self.core.finish(self.drafter, adaptive=False)

    def reset(self) -> None:
        """The KV caches were cleared (target and draft)."""
        self.drafter.reset()

    def _set_depth(self) -> None:
        """Nodes deeper than the tokens still to generate are not worth drafting."""
        r = self.r
        self.drafter.max_pos = len(r.context) - 1 + r.n_predict - len(r.out) - 1

    def _new_root(self, token: int) -> None:
        """A decided token no sent node carries (context[-1] == token): a
        non-speculative run evaluates it in sequence 0 at once, and the tree
        goes on below it (or starts anew)."""
        r = self.r
        r.pending_root = token
        self.core.submit_tree(None, SpecTree(anchor_pos=len(r.context) - 1))   # the root alone, in sequence 0
        self._set_depth()
        self.drafter.reroot(r.context, r.graph, r.graph.committed)

    def _submit_layer(self) -> None:
        """Send the next formed layer as one speculative run in a free KV
        partition (the loop checked there is one); nodes beyond the
        partition's width, or beyond the cells the target's KV cache has
        left, are dropped."""
        d = self.drafter
        ids = d.layer_for_target()[: min(self.core.pool.width, self.core.spec_room())]
        nodes = [d.nodes[i] for i in ids]
        gids = self.core.submit_layer([n.token for n in nodes], nodes[0].pos, [d.nodes[n.parent].gid for n in nodes],
                                      [n.p for n in nodes])
        d.sent(ids, gids)
