"""Token-tree verification (SpecInfer; PipeInfer IV.E). Pure numpy.

One *step* decides the token at one position, given the target's logits at
the parent and the draft children offered there:

* greedy (temperature 0): the token is the target's argmax; it is accepted
  along the child that carries it, if any. Output equals plain greedy
  decoding of the target whatever the tree.
* stochastic: SpecInfer's multi-step speculative sampling (MSS). With p the
  target's sampling distribution (``target_probs``, full vocabulary) and the
  children x_1..x_k drawn i.i.d. from the draft's distribution q at the
  parent: for each child in turn, accept x_j with probability
  min(1, p(x_j) / q(x_j)); on rejection p <- normalise(max(p - q, 0)). If no
  child is accepted, the token is drawn from the final p. The token's
  distribution is exactly the target's (SpecInfer, Theorem 4.2), so the
  output distribution equals non-speculative sampling.
* stochastic, children *chosen* by the draft rather than drawn from it
  (PipeDec's layers: the best tokens by cumulative draft probability, a
  deterministic function of the context): each child is a point mass, and
  MSS with q = 1{x_j} accepts x_j with probability p_j(x_j) and on rejection
  zeroes x_j in p and renormalises (sampling without replacement). Its
  outcome has the same law as one draw y ~ p matched against the children
  (accept the child carrying y, else y is the token), with the same
  acceptance probability, sum of p(x_j); the draw is taken directly, so each
  position spends exactly one uniform, as plain sampling does
  (:meth:`~ggpipe.sampling.Sampler.sample`): a seeded run decides the same
  tokens as iterative decoding with that seed wherever the target's logits
  agree bit for bit.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ggpipe.sampling import Sampler, target_probs


def verify_step(logits: np.ndarray, child_tokens: Sequence[int], child_q: Sequence[np.ndarray | None],
                sampler: Sampler, chosen: bool = False) -> tuple[int, int | None]:
    """Decide one position.

    Args:
        logits: float32 (n_vocab,) target logits at the parent (greedy: or
            its compact form, ggpipe.logits.TopRow).
        child_tokens: the draft tokens offered as children (may be empty).
        child_q: per child, the draft distribution (float64 (n_vocab,)) it
            was drawn from; only read when sampling is stochastic and the
            children were drawn (not ``chosen``).
        sampler: the head's sampler of this sequence (its params, seeded
            RNG and constraints); the decided token is accepted into it
            (:meth:`~ggpipe.sampling.Sampler.accept`), so positions must be
            decided in order.
        chosen: the children were chosen deterministically by the draft
            (distinct tokens, no q): point masses (module docstring).

    Returns:
        (token, k): the token at this position, and the index of the child
        carrying it (None: no child accepted; the token was drawn from the
        target, or the residual distribution).

    Raises:
        ValueError: stochastic sampling with a child lacking its q.
    """
    params = sampler.params
    if params.greedy or chosen:
        # greedy: the argmax, of a full row or a compact one (ggpipe.logits); chosen children: one draw from p
        t = sampler.sample(logits)
        for k, c in enumerate(child_tokens):
            if c == t:
                return t, k
        return t, None
    # p: the target's distribution at this position, its constraints (bias, penalties, grammar) included
    p = target_probs(sampler.constrain(logits), params)
    rng = sampler.rng
    for k, (x, q) in enumerate(zip(child_tokens, child_q)):
        if q is None:
            raise ValueError("stochastic verification needs the draft distribution of every child")
        qx = float(q[x])
        if qx > 0.0 and rng.random() * qx < p[x]:  # r < p(x)/q(x), without dividing
            sampler.accept(int(x))
            return int(x), k
        resid = np.maximum(p - q, 0.0)
        total = resid.sum()
        if total <= 0.0:  # p <= q everywhere: p == q; any draw from p is fine
            break
        p = resid / total
    t = sampler.sample_from(p)
    sampler.accept(t)
    return t, None


def walk_tree(children_of: Callable[[int], list[int]], token_of: Callable[[int], int],
              q_of: Callable[[int], np.ndarray | None], logits_of: Callable[[int], np.ndarray | None],
              start: int, sampler: Sampler, chosen: bool = False) -> tuple[list[int], list[int], bool]:
    """Walk down a tree from node ``start`` (whose logits must be known),
    deciding one position per step (:func:`verify_step`; ``chosen``: the
    nodes were chosen by the draft, point masses, and ``q_of`` is not read).

    Returns:
        (tokens, nodes, complete): the accepted tokens in order; the nodes
        that carried them (a decided token that no node carries ends the walk
        and is the last token, without a node); ``complete`` is False when
        the walk stopped at an accepted node whose logits are not available
        (they will come with a later run).
    """
    tokens: list[int] = []
    nodes: list[int] = []
    cur = start
    while True:
        logits = logits_of(cur)
        if logits is None:
            return tokens, nodes, False
        kids = children_of(cur)
        t, k = verify_step(logits, [token_of(c) for c in kids], [q_of(c) for c in kids], sampler, chosen)
        tokens.append(t)
        if k is None:
            return tokens, nodes, True
        cur = kids[k]
        nodes.append(cur)
