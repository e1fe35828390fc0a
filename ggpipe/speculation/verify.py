"""Token-tree verification (SpecInfer; PipeInfer IV.E). Pure numpy.

One *step* decides the token at one position, given the target's logits at
the parent and the draft children offered there: the token is the one the
target's sampler picks from those logits (:meth:`ggpipe.sampling.Sampler.sample`:
greedy, the argmax; sampled, one draw from the target's distribution with
the noise keyed by the request's seed and the position), and it is accepted
along the child that carries it, if any. This is llama.cpp's speculative
sampling (``common_sampler_sample_and_accept_n``: the target samples each
position once and a draft token is accepted only if it equals that sample),
not SpecInfer's multi-step speculative sampling, whose use of random numbers
depends on what was drafted:

* lossless whatever the tree: every decided token is the target's own pick,
  so greedy output equals the target's greedy decoding and sampled output
  has the target's distribution;
* drafter-invariant: with a seed, the decided tokens are those iterative
  decoding with that seed picks wherever the target's logits agree bit for
  bit, whoever drafted and whenever (the keyed noise, ggpipe.keyed_noise,
  makes a position's draw a function of (seed, position, distribution));
* a drafter that samples couples its proposals to the target's pick by
  drawing with the same keyed noise (Gumbel-max over its own distribution:
  Daliri, Musco and Suresh 2024), so a draft is accepted about as often as
  multi-step speculative sampling would accept it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ggpipe.sampling import Sampler


def verify_step(logits: np.ndarray, child_tokens: Sequence[int], sampler: Sampler) -> tuple[int, int | None]:
    """Decide one position.

    Args:
        logits: float32 (n_vocab,) target logits at the parent (greedy: or
            its compact form, ggpipe.logits.TopRow).
        child_tokens: the draft tokens offered as children (may be empty).
        sampler: the head's sampler of this sequence (its params, key and
            constraints); the decided token is accepted into it
            (:meth:`~ggpipe.sampling.Sampler.accept`), so positions must be
            decided in order.

    Returns:
        (token, k): the token at this position, and the index of the first
        child carrying it (None: no child carries it).

    Raises:
        ValueError: see :meth:`~ggpipe.sampling.Sampler.sample`.
    """
    t = sampler.sample(logits)
    for k, c in enumerate(child_tokens):
        if c == t:
            return t, k
    return t, None


def walk_tree(children_of: Callable[[int], list[int]], token_of: Callable[[int], int],
              logits_of: Callable[[int], np.ndarray | None], start: int,
              sampler: Sampler) -> tuple[list[int], list[int], bool]:
    """Walk down a tree from node ``start`` (whose logits must be known),
    deciding one position per step (:func:`verify_step`).

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
        t, k = verify_step(logits, [token_of(c) for c in kids], sampler)
        tokens.append(t)
        if k is None:
            return tokens, nodes, True
        cur = kids[k]
        nodes.append(cur)
