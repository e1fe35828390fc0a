"""One token budget per micro-batch (ggpipe/decoding/parallel/budget.py):
generating slots first, then prompt chunks of as many slots as fit, a bound
on the time between tokens for prompts that arrive while others generate,
uniform micro-batches under a pipeline; and the scheduler on the toy
pipeline: a burst of prompts enters together, a prompt whose client leaves
half-way frees its slot and disturbs no other request."""

from __future__ import annotations

import pytest

from ggpipe.decoding.loop import Job
from ggpipe.decoding.parallel.budget import BURST_S, LateShare, late_prompts, plan_late, plan_step
from ggpipe.decoding.parallel.scheduler import Scheduler
from ggpipe.decoding.parallel.slots import Slot
from ggpipe.decoding.request import Request
from ggpipe.pipeline.prefill import prefill_chunks
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.sim.toy import FakePipeline, ToyLM

V = 48


def _slot(seq, todo, generating=False, arrival=0, since=None, waiting=False):
    job = Job([1], 8, Sampler(SamplingParams()))
    job.arrival = arrival
    job.request = Request(n_predict=8, out=[1] if generating else [])
    return Slot(seq, job=job, todo=list(todo), waiting=waiting, generating_since=since if generating else None)


def _plan(slots, budget=512, depth=1, n_stages=1):
    return [(s.seq, n, w) for s, n, w in plan_step(slots, budget, depth, n_stages, late=late_prompts(slots))]


def test_sixteen_short_prompts_enter_in_one_micro_batch():
    slots = [_slot(i, range(13), arrival=i) for i in range(16)]
    assert _plan(slots, budget=512) == [(i, 13, True) for i in range(16)]


def test_a_prompt_longer_than_what_is_left_goes_on_in_the_next_micro_batch():
    slots = [_slot(0, range(300), arrival=0), _slot(1, range(300), arrival=1), _slot(2, range(500), arrival=2)]
    # slot 0 whole, slot 1 cut to what is left (its logits come with its last chunk), slot 2 waits
    assert _plan(slots, budget=512) == [(0, 300, True), (1, 212, False)]
    slots[1].todo = slots[1].todo[212:]
    assert _plan(slots[1:], budget=512) == [(1, 88, True), (2, 424, False)]


def test_a_burst_gives_the_shortest_remaining_prompt_the_budget_first_and_later_arrivals_wait():
    """Inside a burst (arrived within BURST_S of the oldest waiting prompt)
    the shortest remaining prompt goes first, so the median first token
    comes soonest; a prompt that arrived later waits for the whole burst,
    however short it is."""
    slots = [_slot(0, range(900), arrival=0), _slot(1, range(100), arrival=1), _slot(2, range(400), arrival=2)]
    assert _plan(slots, budget=512) == [(0, 12, False), (1, 100, True), (2, 400, True)]
    later = _slot(3, range(5), arrival=3)
    later.job.t_queued = slots[0].job.t_queued + 2 * BURST_S
    slots[0].todo = slots[0].todo[12:]
    assert _plan([slots[0], later], budget=512) == [(0, 512, False)]
    assert _plan([slots[0], later], budget=1024) == [(0, 888, True), (3, 5, True)]


def test_generating_rows_go_first_and_rows_are_in_slot_order():
    slots = [_slot(0, range(40), arrival=0), _slot(1, [7], generating=True, since=2),
             _slot(2, [8], generating=True, since=2), _slot(3, range(10), arrival=1)]
    # the prompts arrived before the requests began generating (a burst): they take what the budget leaves,
    # the shorter one first
    assert _plan(slots, budget=32) == [(0, 20, False), (1, 1, True), (2, 1, True), (3, 10, True)]
    assert _plan(slots, budget=64) == [(0, 40, True), (1, 1, True), (2, 1, True), (3, 10, True)]
    slots[1].waiting = True          # in flight: its group waits for it
    assert _plan(slots, budget=64) == [(0, 40, True), (3, 10, True)]


def test_a_prompt_that_arrives_while_others_generate_goes_apart():
    gen = [_slot(i, [i], generating=True, since=3) for i in range(7)]
    late = _slot(7, range(2000), arrival=3)
    early = _slot(8, range(30), arrival=2)     # waiting before they began generating: it joins them
    slots = gen + [late, early]
    assert late_prompts(slots) == {7}
    assert _plan(slots) == [(i, 1, True) for i in range(7)] + [(8, 30, True)]
    assert [(s.seq, n, w) for s, n, w in plan_late(slots, 5, {7})] == [(7, 5, False)]
    assert late_prompts(gen) == set() and late_prompts([late, early]) == set()   # nothing generates: no late


def test_late_micro_batches_are_sized_by_their_measured_time():
    share = LateShare(bound=1.5)
    assert share.tokens(7, 512) == 3                  # before a measurement: half the generating rows' tokens
    share.decoded(0.100)
    share.late(3, 0.025)                              # half the room used: twice the tokens next
    assert share.tokens(7, 512) == 6
    share.late(6, 0.200)                              # four times over: halved (at most by 2 per step)
    assert share.tokens(7, 512) == 3
    share.late(3, 0.050)                              # on target: kept
    assert share.tokens(7, 512) == 3 and share.tokens(7, 2) == 2
    for _ in range(20):                               # a cost of 0.01 + 0.01 s per token settles at 4 tokens
        n = share.tokens(7, 512)
        share.late(n, 0.01 + 0.01 * n)
    assert share.tokens(7, 512) in (3, 4)
    assert share.service(1.0, 1.5) == 0.5 and share.service(1.2, 1.7) == pytest.approx(0.2)   # queued behind it


def test_under_a_pipeline_each_micro_batch_takes_the_first_pipelined_chunk():
    slots = [_slot(0, range(1700), arrival=0)]
    assert _plan(slots, budget=512, depth=2, n_stages=2) == [(0, prefill_chunks(1700, 512, 2)[0], False)]
    # short prompts of a burst: chunks of at least 64 tokens, so a few micro-batches carry them
    slots = [_slot(i, range(13), arrival=i) for i in range(16)]
    first = _plan(slots, budget=512, depth=2, n_stages=2)
    assert sum(n for _, n, _ in first) == prefill_chunks(208, 512, 2)[0] >= 64


def _job(prompt, n, stop=lambda: False):
    return Job(list(prompt), n, Sampler(SamplingParams()), should_stop=stop)


def _recording_scheduler(n_slots: int):
    """A scheduler of ``n_slots`` slots (64 cells each, a 64-token budget) over the toy pipeline,
    and the list its micro-batches' sequence ids are recorded in, one list per micro-batch."""
    lm = ToyLM(V)
    target = FakePipeline(lm, latency=1, cell_order=True, streams=True)
    sched = Scheduler(target, n_slots, n_ctx_slot=64, n_batch=64, is_eog=lambda t: False, depth=1)
    runs = []
    submit = target.submit
    target.submit = lambda run: (runs.append([int(s) for s in run.seq_ids]), submit(run))
    return lm, sched, runs


def test_a_burst_of_prompts_goes_in_one_micro_batch_and_every_request_stays_exact():
    lm, sched, runs = _recording_scheduler(8)
    jobs = [_job([1 + i, 2 + i, 3, 4 + i, 5][:2 + i % 4], 6) for i in range(8)]
    for j in jobs:
        sched.submit(j)
    sched.run()
    assert sorted(set(runs[0])) == list(range(8))      # every prompt in the first micro-batch
    for j in jobs:
        assert j.request.out == lm.greedy(j.tokens, 6)
        assert j.prompt_steps.steps == 1 and j.prompt_steps.as_dict()["step_tokens"]["prompt"] == 28
    assert sched.stats.prompt_tokens == 28 and sched.stats.decode_tokens == 8 * 5


def test_a_burst_starts_shortest_prompt_first_in_ascending_slots():
    """Requests that get slots at once go shortest prompt first to the lowest
    free slots, so llama.cpp's split of the micro-batch (one ubatch per run
    of consecutive slots with equal tokens each) makes one ubatch per
    distinct length; each request's tokens stay those of it run alone."""
    from ggpipe.runs import ubatches

    lm, sched, runs = _recording_scheduler(6)
    lengths = [5, 2, 9, 2, 7, 5]
    jobs = [_job([1 + (i * 3 + k) % 40 for k in range(n)], 4) for i, n in enumerate(lengths)]
    for j in jobs:
        sched.submit(j)
    sched.run()
    assert [j.slot for j in jobs] == [2, 0, 5, 1, 4, 3]     # 2, 2, 5, 5, 7, 9 in slots 0..5
    assert len(ubatches(runs[0], 64)) == 4                  # one per distinct length
    in_arrival_slots = [s for s, n in enumerate(lengths) for _ in range(n)]
    assert len(ubatches(in_arrival_slots, 64)) == 5         # what slots in arrival order would have made
    for j in jobs:
        assert j.request.out == lm.greedy(j.tokens, 4)


@pytest.mark.parametrize("how", ["cancelled", "should_stop"])
def test_a_request_whose_client_leaves_mid_prompt_frees_its_slot_and_disturbs_no_other(how):
    """A 40-token prompt in chunks of 8 tokens; after its second chunk its client leaves: the request ends
    at the next step (its rows still in flight are dropped), its slot takes the next request, and the other
    requests' tokens are the greedy ones."""
    lm = ToyLM(V)
    target = FakePipeline(lm, latency=2, cell_order=True, streams=True)
    sched = Scheduler(target, 2, n_ctx_slot=128, n_batch=8, is_eog=lambda t: False, depth=1)
    gone = []
    leaving = _job([(7 * i) % V for i in range(40)], 10, stop=lambda: bool(gone))
    others = [_job([3, 4, 5], 12), _job([9, 8, 7, 6], 9)]
    done = []
    for j in [leaving] + others:
        j.on_done = done.append
        sched.submit(j)
    while leaving.prompt_steps.steps < 2:
        sched.step()
    if how == "cancelled":
        leaving.cancelled = True
    else:
        gone.append(True)
    sched.step()
    assert done and done[0] is leaving and leaving.request.out == [] and leaving.request.done
    sched.run()
    assert [j.request.out for j in others] == [lm.greedy(j.tokens, j.n_predict) for j in others]
    assert not target.inflight and all(s.job is None for s in sched.slots)


def test_a_burst_behind_one_shared_prefix_computes_it_once():
    """Four requests behind a 20-token system prompt, all at once, a budget that holds them all: the first
    micro-batch carries the first request's prompt alone, the other three wait for its cells and borrow them
    (vLLM's prefix caching of blocks still being computed), then go together; every request stays exact."""
    lm, sched, runs = _recording_scheduler(4)
    system = [(5 * i + 3) % V for i in range(20)]
    jobs = [_job(system + [i + 1, i + 2], 5) for i in range(4)]
    for j in jobs:
        sched.submit(j)
    sched.run()
    assert runs[0] == [0] * 22
    assert runs[1] == [0, 1, 1, 2, 2, 3, 3]    # its next token, and the three rests
    assert [j.n_reused for j in jobs] == [0, 20, 20, 20] and sched.stats.prompt_tokens == 22 + 3 * 2
    for j in jobs:
        assert j.request.out == lm.greedy(j.tokens, 5)


def test_a_late_prompt_goes_in_micro_batches_of_its_own_between_the_generating_ones():
    """Three requests generate; a 40-token prompt arrives: its chunks go alone, one micro-batch after each
    micro-batch of generating rows (never among them), and every request stays exact."""
    lm = ToyLM(V)
    target = FakePipeline(lm, latency=1, cell_order=True, streams=True)
    sched = Scheduler(target, 4, n_ctx_slot=128, n_batch=64, is_eog=lambda t: False, depth=1)
    runs = []
    submit = target.submit
    target.submit = lambda run: (runs.append([int(s) for s in run.seq_ids]), submit(run))
    jobs = [_job([3 + i, 4, 5 + i], 30) for i in range(3)]
    for j in jobs:
        sched.submit(j)
    while not all(j.request is not None and j.request.out for j in jobs):
        sched.step()
    late = _job([(7 * i) % V for i in range(40)], 5)
    sched.submit(late)
    start = len(runs)
    sched.run()
    mixed = runs[start:]
    late_runs = [r for r in mixed if 3 in r]
    assert late_runs and all(set(r) == {3} for r in late_runs)    # its chunks alone, never among the others
    first = mixed.index(late_runs[0])
    assert all(set(mixed[i]) == {0, 1, 2} for i in range(first - 1, first + 2 * 3, 2))   # alternating
    for j in jobs + [late]:
        assert j.request.out == lm.greedy(j.tokens, j.n_predict)
