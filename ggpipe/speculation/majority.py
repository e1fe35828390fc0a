"""Minions' majority-voted speculator, the pure part (Minions, section 3.2).
No MPI, no model.

Several proposers (*members*) draft a token sequence each below the same
anchor. :func:`majority_path` merges them into a token tree whose node
weight is the sum of the weights of the members whose sequence passes
through it, and follows the heaviest child level by level down to a leaf:
the *majority-approved output*, which is one member's whole sequence (the
*voted* member).

:class:`WeightedMajority` keeps the members' weights and learns them with
Littlestone and Warmuth's weighted-majority algorithm (the paper's [21]):
once the target has decided the tokens a vote was about, every level at
which the members that were still right disagreed is a *trial*, and each
member whose token lost it has its weight multiplied by ``beta``. Levels
where all agree say nothing about whom to follow and change nothing.

Where we had to choose (the paper gives thresholds on each voted member's
average acceptance rate, ACR, but not their values, and scores only the
voted member): the decided text tells what the target would have accepted
of *every* member's sequence (under greedy verification, its longest prefix
that matches), so every member is scored at every vote, and the updates are
the algorithm's own multiplicative penalty per lost trial. The per-member
counterfactual acceptance (``acceptance()``) is the paper's ACR over all of
a member's sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

BETA = 0.5          # weight kept by a member that lost a trial (Littlestone & Warmuth's beta)
MAX_PENDING = 256   # votes waiting for the target's decision, oldest dropped first


def check_members(names: Sequence[str]) -> list[str]:
    """The members of a vote (``--spec-vote``), in order.

    Raises:
        ValueError: fewer than two, one named twice, or a vote among them."""
    names = list(names)
    if len(names) < 2 or len(set(names)) != len(names) or "vote" in names:
        raise ValueError(f"--spec-vote needs two or more distinct proposers (e.g. draft,ngram), "
                         f"got {','.join(names) or 'none'}")
    return names


def expand_members(names: Sequence[str], n_models: int = 1) -> list[str]:
    """The members of a vote with ``n_models`` draft models (``-md a,b``):
    ``draft`` stands for one member per model, ``draft``, ``draft2``, ...
    (``["draft", "ngram"]``, 2 -> ``["draft", "draft2", "ngram"]``).

    Raises:
        ValueError: as :func:`check_members`, for the expanded list."""
    out = []
    for n in names:
        out += [n] + ([f"{n}{k + 1}" for k in range(1, n_models)] if n == "draft" else [])
    return check_members(out)


def member_of(label: str) -> tuple[str, int]:
    """A member label of :func:`expand_members` -> (proposer name, draft
    model index): ``"draft2"`` -> ``("draft", 1)``, ``"ngram"`` -> ``("ngram", 0)``."""
    if label.startswith("draft") and label[5:].isdigit():
        return "draft", int(label[5:]) - 1
    return label, 0


def majority_path(seqs: Sequence[Sequence[int]], weights: Sequence[float]) -> tuple[list[int], int]:
    """The majority-approved output of the members' sequences.

    Args:
        seqs: per member, the token ids it drafted below the anchor (may be empty).
        weights: per member, its weight (> 0).

    Returns:
        (the voted member's sequence, its index); ([], -1) when every
        sequence is empty. At each level the child of largest weight wins;
        a tie goes to the child carrying the lowest member index.

    Example::

        >>> majority_path([[1, 2, 3], [1, 5], [1, 5, 6, 7]], [1.0, 0.6, 0.6])
        ([1, 5, 6, 7], 2)
        >>> majority_path([[1, 2, 3], [1, 5]], [1.0, 0.6])
        ([1, 2, 3], 0)
    """
    if len(seqs) != len(weights):
        raise ValueError(f"{len(seqs)} sequences but {len(weights)} weights")
    alive = [i for i, s in enumerate(seqs) if len(s)]
    depth = 0
    while True:
        cont = [i for i in alive if len(seqs[i]) > depth]
        if not cont:
            break
        groups: dict[int, list[int]] = {}
        for i in cont:
            groups.setdefault(int(seqs[i][depth]), []).append(i)
        tok = max(groups, key=lambda t: (sum(weights[i] for i in groups[t]), -min(groups[t])))
        alive = groups[tok]
        depth += 1
    if depth == 0:
        return [], -1
    voted = min(alive)   # every member left ends exactly here (a leaf)
    return [int(t) for t in seqs[voted]], voted


def support(seqs: Sequence[Sequence[int]], path: Sequence[int], level: int) -> list[int]:
    """Members whose sequence passes through ``path``'s node at ``level``
    (0-based): their first ``level + 1`` tokens equal the path's."""
    want = list(path[:level + 1])
    return [i for i, s in enumerate(seqs) if len(s) > level and list(s[:level + 1]) == want]


@dataclass
class _Vote:
    start: int                 # decided tokens when the vote was taken
    spec: tuple[int, ...]      # the anchor's context beyond them (not yet decided then)
    anchor_pos: int
    seqs: tuple[tuple[int, ...], ...]
    voted: int


class WeightedMajority:
    """The members' weights and their record (see the module docstring).

    Args:
        names: the members, in order (ties go to the first).
        beta: weight kept per lost trial (0 < beta < 1).

    Attributes:
        weights: per member, normalised so that the largest is 1.
        proposed, accepted: per member, tokens drafted in scored votes and how
            many of them the target would have accepted (its longest prefix
            that matches the decided tokens).
        judged: per member, tokens whose rightness was decided (the accepted
            ones and the first wrong one of each sequence).
        voted: per member, votes whose output was its sequence.
        trials, lost: per member, trials it took part in / lost.
    """

    def __init__(self, names: Sequence[str], beta: float = BETA):
        if not 0.0 < beta < 1.0:
            raise ValueError(f"beta must be in (0, 1), got {beta}")
        self.names = list(names)
        self.beta = beta
        n = len(self.names)
        self.weights = [1.0] * n
        self.proposed = [0] * n
        self.accepted = [0] * n
        self.voted = [0] * n
        self.trials = [0] * n
        self.lost = [0] * n
        self.judged = [0] * n
        self._pending: list[_Vote] = []
        self._decided = 0

    def start(self) -> None:
        """A new request: positions start over; votes not yet scored are dropped
        (weights are kept: they are learnt across requests)."""
        self._pending.clear()
        self._decided = 0

    def record(self, context: Sequence[int], seqs: Sequence[Sequence[int]], voted: int) -> None:
        """A vote below ``context[-1]`` (the anchor): each member's sequence
        and the index of the voted one (-1: none). ``context`` may run past
        the decided tokens (PipeInfer drafts below tokens still in flight);
        the vote is scored only if those turn out to be decided."""
        if voted >= 0:
            self.voted[voted] += 1
        self._pending.append(_Vote(self._decided, tuple(context[self._decided:]), len(context) - 1,
                                   tuple(tuple(int(t) for t in s) for s in seqs), voted))
        del self._pending[:-MAX_PENDING]

    def observe(self, decided: Sequence[int]) -> None:
        """The tokens decided so far (prompt and accepted tokens, positions
        0..len-1): score every vote they settle."""
        self._decided = len(decided)
        keep = []
        for v in self._pending:
            state = self._settle(v, decided)
            if state == "wait":
                keep.append(v)
        self._pending = keep

    def _settle(self, v: _Vote, decided: Sequence[int]) -> str:
        head = list(decided[v.start:v.start + len(v.spec)])
        if head != list(v.spec[:len(head)]):
            return "drop"      # drafted below tokens that were not accepted
        if len(head) < len(v.spec):
            return "wait"
        tail = decided[v.anchor_pos + 1:]
        matched = []
        for s in v.seqs:
            m = 0
            while m < len(s) and m < len(tail) and s[m] == tail[m]:
                m += 1
            if m < len(s) and m >= len(tail):
                return "wait"  # not yet known whether this member's next token is right
            matched.append(m)
        for i, (s, m) in enumerate(zip(v.seqs, matched)):
            self.proposed[i] += len(s)
            self.accepted[i] += m
            self.judged[i] += m + int(m < len(s))
        self._trials(v.seqs, matched, tail)
        return "done"

    def _trials(self, seqs, matched, tail) -> None:
        """Each level where the members still right so far disagree is a
        trial; the losers' weights are multiplied by beta."""
        level = 0
        while True:
            alive = [i for i, s in enumerate(seqs) if len(s) > level and matched[i] >= level]
            if len({seqs[i][level] for i in alive}) < 2:
                if not any(matched[i] > level for i in alive):
                    break
                level += 1
                continue
            for i in alive:
                self.trials[i] += 1
                if seqs[i][level] != tail[level]:
                    self.lost[i] += 1
                    self.weights[i] *= self.beta
            level += 1
        top = max(self.weights)
        self.weights = [max(w / top, 1e-12) for w in self.weights]

    def accuracy(self, i: int) -> float:
        """Member ``i``'s measured probability that its next token is right
        given that its tokens before it were: (right + 1) / (judged + 2)
        over scored votes (Laplace's rule; 0.5 before any)."""
        return (self.accepted[i] + 1) / (self.judged[i] + 2)

    def acceptance(self, i: int) -> float | None:
        """Member ``i``'s acceptance rate had its sequences been verified alone
        (accepted / proposed tokens over scored votes), or None before any."""
        return self.accepted[i] / self.proposed[i] if self.proposed[i] else None

    def stats(self) -> dict:
        """Counters for ``--json``: per member, ``vote_<name>_weight``,
        ``_acceptance``, ``_voted``, ``_trials``, ``_lost``."""
        out = {}
        for i, name in enumerate(self.names):
            acc = self.acceptance(i)
            out.update({f"vote_{name}_weight": round(self.weights[i], 6),
                        f"vote_{name}_acceptance": None if acc is None else round(acc, 4),
                        f"vote_{name}_proposed": self.proposed[i],
                        f"vote_{name}_voted": self.voted[i],
                        f"vote_{name}_trials": self.trials[i],
                        f"vote_{name}_lost": self.lost[i]})
        return out
