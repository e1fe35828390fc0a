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
cancellation, retirement of KV sequences, statistics) is
:class:`~ggpipe.decoding.pipelined.SpeculativeDecoder`'s.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ggpipe.decoding.pipelined import SpeculativeDecoder
from ggpipe.decoding.settings import SpecSettings
from ggpipe.errors import ProtocolError
from ggpipe.metrics import GenerationClock
from ggpipe.runs import Run, RunResult, next_run_id
from ggpipe.pipeline.waiting import Wait
from ggpipe.sampling import Sampler
from ggpipe.speculation.cutoff import CutoffController
from ggpipe.speculation.layer_drafter import LayerDrafter
from ggpipe.speculation.partitions import PartitionPool
from ggpipe.speculation.tree import SpecTree


class PipeDecDecoder(SpeculativeDecoder):
    """Args:
        target: the target pipeline (``ggpipe.pipeline.driver.Pipeline`` or
            a fake with its verbs); its ``n_stages`` (default 1) bounds the
            runs in flight.
        drafter: the draft side.
        settings: speculation knobs (``max_inflight`` also bounds the runs in flight).
        n_seq_max: KV sequence ids of the target contexts (one per live tree node, plus sequence 0).
        n_ubatch, is_eog, timeout_s, idle: as :class:`SpeculativeDecoder`.
    """

    def __init__(self, target, drafter: LayerDrafter, settings: SpecSettings, n_seq_max: int, n_ubatch: int,
                 is_eog: Callable[[int], bool], timeout_s: float = 60.0, idle: Wait | None = None):
        super().__init__(target, drafter, settings, n_seq_max, n_ubatch, is_eog, timeout_s=timeout_s, idle=idle)
        self.drafter = drafter
        # one partition per layer run, one sequence of it per node (retired with the run)
        self.pool = PartitionPool(n_seq_max, max(1, min(settings.tree_width, n_seq_max - 1)))
        self.name = "pipedec"

    @property
    def adaptive(self) -> bool:
        return False   # the tree's shape is --tree-width / --max-children, not a cutoff

    @property
    def max_runs(self) -> int:
        """Most target runs in flight: the pipeline's depth plus one."""
        return min(self.s.max_inflight, self.target.n_stages + 1)

    def generate(self, prompt: np.ndarray, n_predict: int, sampler: Sampler, start_pos: int = 0,
                 emit: Callable[[list[int]], bool | None] = lambda toks: None,
                 clock: GenerationClock | None = None, history: list[int] | None = None) -> list[int]:
        """As :meth:`SpeculativeDecoder.generate`.

        Raises:
            ValueError: ``history`` does not have ``start_pos`` tokens.
            RankTimeoutError, ProtocolError: from the pipelines."""
        self._open(prompt, n_predict, sampler, start_pos, emit, clock, history)
        r, d = self.r, self.drafter
        while not r.done:
            if self.target.ready():
                self._handle(self.target.poll())
            elif len(self.target.inflight) < self.max_runs and self.pool.n_free and d.layer_for_target():
                self._submit_layer()    # before the draft's results: the target pipeline is what must not idle
            elif d.ready():
                d.poll()
            elif self.target.inflight or d.busy():
                self._wait_any()
            else:
                raise ProtocolError("pipedec: no target or draft run in flight and no layer to send")
        self._finish()
        r.clock.finish()
        return r.out

    _settle_after_prefill = False   # the loop takes the draft's prefill results as they come

    def _cutoff(self):
        """Not read by the layer policy (the tree's shape is --tree-width /
        --max-children); a fixed controller keeps the shared result handling's
        bookkeeping."""
        return CutoffController(0.0, 0.0, 0.0)

    def _start_proposer(self, params) -> None:
        self.drafter.start(params)

    def _handle(self, res: RunResult) -> None:
        super()._handle(res)
        if not self.r.done:
            self.drafter.follow(self.r.graph)
            self._set_depth()

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
        self._submit_spec(None, SpecTree(anchor_pos=len(r.context) - 1))   # the root alone, in sequence 0
        gid = r.graph.committed
        self._set_depth()
        self.drafter.reroot(r.context, r.graph, gid)

    def _submit_layer(self) -> None:
        """Send the next formed layer as one speculative run in a free KV
        partition (the loop checked there is one), each node in a sequence of
        it copied from its parent's up to the parent; nodes beyond the
        partition's width are dropped."""
        r, g, d = self.r, self.r.graph, self.drafter
        part = self.pool.acquire()
        ids = d.layer_for_target()[: self.pool.width]
        nodes = [d.nodes[i] for i in ids]
        pos = nodes[0].pos
        parents = [d.nodes[n.parent].gid for n in nodes]
        seqs = self.pool.seqs(part)[: len(nodes)]
        self._trim_kv(pos)
        for parent, s in zip(parents, seqs):
            self.target.seq_cp(g.nodes[parent].seq, s, 0, pos)
        rid = next_run_id()
        tokens = [n.token for n in nodes]
        gids = g.add_layer(rid, parents, tokens, [n.p for n in nodes], seqs, part)
        self.target.submit(Run.layer(tokens, pos, seqs, run_id=rid, speculative=True))
        r.kv_top = max(r.kv_top, pos + 1)
        r.counts["target_runs"] += 1
        r.counts["spec_runs"] += 1
        d.sent(ids, gids)
