"""Staged speculative decoding's draft-of-draft (Spector & Re 2023, section
3.2; ``--spec-type staged``): the draft model drafts as ``draft`` does, but
each draft run decodes the chain's new tip together with n-gram guesses of
the tokens below it (prompt lookup in the request's own tokens,
ggpipe.speculation.proposers.ngram). The draft then verifies the guesses
as a target would: while the token it drafts from a row is the next guess,
the row after it already holds the logits below that token, so one draft
round trip yields several tree levels where the text repeats itself.

Trees are those the draft alone would build (the same tokens in greedy
mode; the same law in stochastic mode, where a guess g is taken with
probability q(g) and otherwise a draw from q without g: an exact draw from
q, so multi-step speculative sampling at the target stays exact). What
changes is how many draft round trips a tree costs.

How many guesses a run carries is decided per run (:func:`guess_budget`):
a guess costs the draft the batch time one more token adds, and saves one
draft round trip only when it and every guess before it are taken. The
proposer measures both sides: the draft's run time against tokens per run
(:class:`~ggpipe.speculation.adaptive.PassCost`, the model the loop keeps of
the target), and the rate at which the draft takes a guess whose
predecessors it took. That rate is learned even from runs that carry no
guess: the token the draft drafts next is compared with the guess that was
held back (the same event: greedy, the draft's argmax equals the guess; under
sampling, a draw from q equals it with probability q(g), the chance that the
guess would have been taken). Until two run sizes have been timed every
guess is sent, and every ``EXPLORE_EVERY``-th run with a guess carries at
least one, so the cost of a longer run keeps being measured.
``--spec-guesses N`` replaces the budget: up to N guesses in every run,
whatever they cost (for hardware where draft batches are cheap, and for
tests that must see guesses checked in every run).

``--json`` adds ``guesses_made`` (guesses decoded), ``guesses_accepted``
(levels that came from a guess), ``guesses_held`` (guesses found but not
worth decoding), ``guess_accept`` (the learned rate) and ``guess_cost_ms``
(what one more token adds to a draft run, as last estimated).
"""

from __future__ import annotations

from dataclasses import dataclass

from ggpipe.speculation.adaptive import PassCost
from ggpipe.speculation.proposers.base import ProposerConfig
from ggpipe.speculation.proposers.draft_model import DraftModelProposer
from ggpipe.speculation.proposers.ngram import NgramProposer, check_sizes, ngram_lookup
from ggpipe.speculation.proposers.options import option

EXPLORE_EVERY = 32   # runs with a guess found; one in this many carries at least one guess
ACCEPT_PRIOR = 0.5   # the learned guess acceptance rate before any trial
ACCEPT_ALPHA = 0.05  # weight of one trial in that rate (about the last 20-40 trials count)


def guess_budget(n_found: int, accept: float, step_s: float | None, marginal_s: float | None) -> int:
    """How many of ``n_found`` n-gram guesses a draft run decodes after its tip.

    Guess i (0-based) is taken, and saves one draft round trip of ``step_s``
    seconds, with probability ``accept ** (i + 1)`` (it and every guess before
    it taken); decoding it costs ``marginal_s`` seconds of draft batch time.
    Guesses are kept while the expected saving covers the cost. Unknown costs
    (None) or a batch that seems free (``marginal_s <= 0``, noise) keep all.

    Args:
        n_found: guesses the lookup found (tokens).
        accept: the rate at which the draft takes a guess whose predecessors
            it took, in [0, 1].
        step_s: a one-token draft run's round trip (seconds).
        marginal_s: what one more token adds to a draft run (seconds).

    Returns:
        the number of guesses to decode, 0..n_found.

    Example::

        >>> guess_budget(4, 0.9, 0.010, 0.007)   # 0.9, 0.81 and 0.73 of 10 ms cover 7 ms; 0.66 does not
        3
        >>> guess_budget(4, 0.6, 0.010, 0.007)
        0
    """
    if step_s is None or marginal_s is None or marginal_s <= 0:
        return n_found
    k = 0
    while k < n_found and accept ** (k + 1) * step_s >= marginal_s:
        k += 1
    return k


class StagedProposer(DraftModelProposer):
    """Args:
        cfg: as :class:`DraftModelProposer`, plus this strategy's
            :class:`Options` and ``NgramProposer.Options`` (the suffix
            lengths the guesses are looked up with).

    Raises:
        ValueError: no draft model, invalid n-gram sizes, or a negative
            guess count."""

    name = "staged"
    summary = "the draft model, each draft run also checking n-gram guesses: Staged SD's draft-of-draft"
    aliases = ()

    @dataclass(frozen=True)
    class Options:
        """How many n-gram guesses a draft run decodes after its tip."""

        guesses: int | None = option(
            None, flag="--spec-guesses", type=int, range=(0, 64), auto=True,
            help="--spec-type staged: most n-gram guesses a draft run checks after its tip; auto: those worth "
                 "their measured cost (docs/benchmarks/one-stream.md, Drafting strategies), N: up to N whatever they cost, 0: none.")

    def __init__(self, cfg: ProposerConfig):
        super().__init__(cfg)
        ngram, own = cfg.options.of(NgramProposer), cfg.options.of(StagedProposer)
        check_sizes(ngram.ngram_min, ngram.ngram_max)
        if own.guesses is not None and own.guesses < 0:
            raise ValueError(f"--spec-guesses must be auto or >= 0, got {own.guesses}")
        self.n_min, self.n_max = ngram.ngram_min, ngram.ngram_max
        self.most_guesses = own.guesses   # None: guess_budget decides
        self.stats.update(guesses_made=0, guesses_accepted=0, guesses_held=0, guess_accept=ACCEPT_PRIOR)
        self.run_cost = PassCost()     # the draft's run round trip (seconds) against tokens per run
        self.accept = ACCEPT_PRIOR
        self._held: int | None = None  # the first guess held back from the run in flight
        self._found_runs = 0           # runs for which the lookup found a guess

    def guesses(self, context: list[int], room: int) -> list[int]:
        """Those of the up to ``room`` tokens that followed the latest earlier
        occurrence of the context's longest matching suffix that are worth
        decoding (:func:`guess_budget`)."""
        found = ngram_lookup(context, self.n_min, self.n_max, room) if room > 0 else []
        k = len(found)
        if found:
            self._found_runs += 1
            c1, c2 = self.run_cost.cost(1), self.run_cost.cost(2)
            marginal = None if c1 is None or c2 is None else c2 - c1
            if marginal is not None:
                self.stats["guess_cost_ms"] = round(1e3 * marginal, 3)
            if self.most_guesses is not None:
                k = min(k, self.most_guesses)
            else:
                k = guess_budget(k, self.accept, self.step_s if self.step_s is not None else c1, marginal)
                if k == 0 and self._found_runs % EXPLORE_EVERY == 0:
                    k = 1
        self._held = found[k] if k < len(found) else None
        self.stats["guesses_made"] += k
        self.stats["guesses_held"] += len(found) - k
        return found[:k]

    def guessed(self, sent: int, taken: int, drafted: int | None) -> None:
        """Learn the guess acceptance rate from one draft result: each guess
        sent whose predecessors were taken is a trial, and so is the held-back
        guess when every guess sent was taken (compared with the token the
        draft drafted in its place). A tree that ended at a row is no trial."""
        held, self._held = self._held, None
        trials = [True] * taken
        if drafted is not None:
            if taken < sent:
                trials.append(False)
            elif held is not None:
                trials.append(drafted == held)
        for hit in trials:
            self.accept += ACCEPT_ALPHA * (float(hit) - self.accept)
        self.stats["guess_accept"] = round(self.accept, 4)

    def timed(self, n_tokens: int, seconds: float) -> None:
        """A draft run's round trip: feeds ``step_s`` and the run cost model
        (runs longer than ``PassCost.max_tokens``, catch-ups of the KV, are
        left out)."""
        super().timed(n_tokens, seconds)
        if n_tokens <= self.run_cost.max_tokens:
            self.run_cost.observe(n_tokens, seconds)
