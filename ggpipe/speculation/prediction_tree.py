"""PipeDec's dynamic prediction tree: which draft candidates form the next
tree layer (PipeDec section 3.3.3, "Tree Update Process"). Pure numpy.

The paper's inline math was lost in extraction; reconstructed from its prose:

* every node of the newest layer offers the draft's ``max_children`` most
  probable next tokens ("Draft Model Inference": a probability matrix of the
  layer's nodes x branches);
* a candidate's cumulative probability is its parent's times its own draft
  probability ("Cumulative Probability Calculation": log-probabilities summed
  along the ancestor mask);
* the next layer is the ``width`` candidates of highest cumulative
  probability over the whole layer ("Tree Layer Generation": top-W of the
  flattened matrix), so the bound is on a layer, not on the whole tree.

Where the prose is silent, ggpipe chose: ties go to the earlier parent (BFS
order), then to the more probable branch; candidates of draft probability 0
are never taken; the layer comes out in BFS order (by parent, then by
probability), as the paper stores the tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Candidate:
    """A node of the next layer.

    Attributes:
        parent: index of its parent in the frontier passed to :func:`next_layer`.
        token: draft token id.
        p: draft probability of ``token`` after its parent (0..1].
        logp: cumulative log-probability from the tree's root (natural log, <= 0).
    """

    parent: int
    token: int
    p: float
    logp: float


def next_layer(frontier_logp: Sequence[float], branches: Sequence[tuple[np.ndarray, np.ndarray]],
               width: int, max_children: int) -> list[Candidate]:
    """The next layer of the prediction tree.

    Args:
        frontier_logp: cumulative log-probability of each node of the newest
            layer (the tree's root: 0.0).
        branches: per frontier node, its draft's best tokens and their
            probabilities, best first (int (k,), float (k,); ggpipe.logits.best).
        width: most nodes in the layer (``--tree-width``, the paper's maximum
            layer width).
        max_children: most children per node (``--max-children``).

    Returns:
        At most ``width`` candidates, in BFS order.

    Raises:
        ValueError: ``width`` or ``max_children`` < 1, or the two sequences
            differ in length.
    """
    if width < 1 or max_children < 1:
        raise ValueError(f"tree width and children per node must be >= 1 (got {width}, {max_children})")
    if len(frontier_logp) != len(branches):
        raise ValueError(f"{len(frontier_logp)} frontier nodes but {len(branches)} branch lists")
    pool: list[tuple[float, int, int, int, float]] = []   # (-logp, parent, rank, token, p)
    for i, (lp, (toks, ps)) in enumerate(zip(frontier_logp, branches)):
        for rank, (t, p) in enumerate(zip(toks[:max_children], ps[:max_children])):
            p = float(p)
            if p <= 0.0:
                continue
            pool.append((-(float(lp) + math.log(p)), i, rank, int(t), p))
    pool.sort()
    chosen = sorted(pool[:width], key=lambda c: (c[1], c[2]))
    return [Candidate(parent=i, token=t, p=p, logp=-nlp) for nlp, i, _, t, p in chosen]
