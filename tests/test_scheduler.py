"""The continuous-batching scheduler (ggpipe/decoding/parallel/scheduler.py) against
the in-memory toy pipeline with one KV stream per sequence (llama.cpp's
``kv_unified = false``): every request's tokens equal the same request run
alone, while requests of different lengths join and leave; every token's
cells sit at index = position in its slot's own stream."""

from __future__ import annotations

import random

import pytest

import ggpipe.decoding.parallel.scheduler as scheduler_module
from ggpipe.decoding.parallel.scheduler import Scheduler
from ggpipe.decoding.loop import Job
from ggpipe.decoding.parallel.budget import plan_step
from ggpipe.decoding.parallel.slots import Slot, decode_groups
from ggpipe.runs import ubatch_order, ubatches
from ggpipe.decoding.request import Request
from ggpipe.errors import ConfigError
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.sim.toy import FakePipeline, ToyLM

V = 48
PROMPTS = [[3, 9, 4, 3, 9], [7, 1], [5, 5, 5, 2, 8, 1, 4], [11], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20], [9, 9, 1]]
LENGTHS = [12, 3, 20, 7, 1, 15]


def _run(jobs: list[Job], n_slots: int, depth: int = 2, n_batch: int = 8, latency: int = 3, eog=None,
         partial_reuse: bool = True):
    target = FakePipeline(ToyLM(V), latency=latency, cell_order=True, streams=True)
    target.n_stages = depth
    sched = Scheduler(target, n_slots, n_ctx_slot=64, n_batch=n_batch, is_eog=eog or (lambda t: False),
                      partial_reuse=partial_reuse)
    done = []
    for j in jobs:
        j.on_done = done.append
        sched.submit(j)
    sched.run()
    assert not target.inflight and not sched.busy
    return sched, done, target


def _jobs(params=SamplingParams(), prompts=PROMPTS, lengths=LENGTHS):
    return [Job(list(p), n, Sampler(params)) for p, n in zip(prompts, lengths)]


@pytest.mark.parametrize("n_slots,depth,n_batch,latency", [(1, 1, 8, 1), (2, 2, 8, 3), (3, 2, 4, 3), (4, 3, 16, 5),
                                                             (8, 2, 3, 2)])
def test_greedy_requests_equal_each_alone(n_slots, depth, n_batch, latency):
    jobs = _jobs()
    sched, done, _ = _run(jobs, n_slots, depth, n_batch, latency)
    assert len(done) == len(jobs)
    for j, p, n in zip(jobs, PROMPTS, LENGTHS):
        assert j.request.out == ToyLM(V).greedy(p, n), (p, n)
    assert sched.stats.generated == sum(LENGTHS)
    if n_slots >= 3:
        assert sched.stats.rows > sched.stats.micro_batches   # several requests per micro-batch


def test_seeded_sampling_does_not_depend_on_what_runs_beside():
    params = [SamplingParams(temperature=0.9, top_k=0, top_p=1.0, seed=s) for s in range(len(PROMPTS))]

    def outputs(n_slots):
        jobs = [Job(list(p), n, Sampler(pr)) for p, n, pr in zip(PROMPTS, LENGTHS, params)]
        _run(jobs, n_slots)
        return [j.request.out for j in jobs]

    alone = outputs(1)
    assert outputs(2) == alone and outputs(4) == alone
    assert any(a != ToyLM(V).greedy(p, len(a)) for a, p in zip(alone, PROMPTS))   # really sampled


def test_a_slot_reuses_the_cached_prefix_of_an_earlier_request():
    first = Job([1, 2, 3, 4, 5, 6], 4, Sampler(SamplingParams()))
    ctx = first.tokens + ToyLM(V).greedy(first.tokens, 4)
    follow = Job(ctx[:-1] + [7, 8], 5, Sampler(SamplingParams()))   # the next turn of a conversation
    target = FakePipeline(ToyLM(V), cell_order=True, streams=True)
    sched = Scheduler(target, 2, n_ctx_slot=64, n_batch=8, is_eog=lambda t: False)
    for j in (first, follow):
        sched.submit(j)
        sched.run()
    assert follow.slot == first.slot and follow.n_reused == len(ctx) - 1
    assert follow.request.out == ToyLM(V).greedy(follow.tokens, 5)


SYSTEM = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]     # a chat template's system prompt, shared by a burst


@pytest.mark.parametrize("n_slots,depth,n_batch", [(4, 2, 8), (4, 2, 32), (3, 3, 4), (2, 1, 16)])
def test_a_burst_sharing_a_system_prompt_borrows_the_first_request_s_cells(n_slots, depth, n_batch):
    """Requests that arrive together and share a prefix: each later one copies
    the stream of a slot that already sent it and decodes only its own rest;
    every request's tokens equal it run alone, every cell at index = position."""
    prompts = [SYSTEM + tail for tail in ([10, 11], [12], [13, 14, 15], [16, 17], [18])]
    jobs = _jobs(prompts=prompts, lengths=[6, 4, 9, 3, 5])
    sched, done, target = _run(jobs, n_slots, depth, n_batch)
    assert len(done) == len(jobs)
    for j, pr in zip(jobs, prompts):
        assert j.request.out == ToyLM(V).greedy(pr, j.n_predict), pr
    borrowed = sum(j.n_reused for j in jobs)
    assert borrowed >= (len(jobs) - n_slots) * len(SYSTEM)     # at least the requests that waited for a slot
    assert any(j.n_reused >= len(SYSTEM) for j in jobs[1:n_slots])   # and some that came in the first burst
    assert sched.stats.borrowed_tokens > 0
    # the tokens the pipeline computed: fewer by exactly what was borrowed
    plain_jobs = _jobs(prompts=prompts, lengths=[6, 4, 9, 3, 5])
    plain, _, plain_target = _run(plain_jobs, n_slots, depth, n_batch, partial_reuse=False)
    assert [j.request.out for j in plain_jobs] == [j.request.out for j in jobs]
    assert plain.stats.borrowed_tokens == 0
    assert sum(plain_target.run_sizes) - sum(target.run_sizes) == \
        sched.stats.reused_tokens - plain.stats.reused_tokens


def test_nothing_is_borrowed_from_a_recurrent_state_or_for_a_short_prefix():
    jobs = _jobs(prompts=[SYSTEM + [10], SYSTEM + [11]], lengths=[3, 3])
    sched, _, _ = _run(jobs, 2, n_batch=32, partial_reuse=False)
    assert [j.n_reused for j in jobs] == [0, 0] and sched.stats.borrowed_tokens == 0
    short = _jobs(prompts=[[1, 2, 3, 4, 5, 6, 7, 20], [1, 2, 3, 4, 5, 6, 7, 21]], lengths=[3, 3])
    sched, _, _ = _run(short, 2)
    assert sched.stats.borrowed_tokens == 0      # 7 shared tokens: computing them costs less than a copy
    for j in short:
        assert j.request.out == ToyLM(V).greedy(j.tokens, 3)


def test_a_state_that_cannot_be_cut_is_kept_whole_or_dropped():
    """partial_reuse False (a recurrent or hybrid model): a request keeps its
    slot's cells only where its prompt goes on after all of them (the next
    turn of a conversation); otherwise the slot starts empty."""
    first = Job([1, 2, 3, 4, 5, 6], 4, Sampler(SamplingParams()))
    ctx = first.tokens + ToyLM(V).greedy(first.tokens, 4)
    follow = Job(ctx[:-1] + [7, 8], 5, Sampler(SamplingParams()))   # goes on after every cell the slot holds
    other = Job([1, 2, 3, 9], 3, Sampler(SamplingParams()))         # shares a prefix that would need a cut
    target = FakePipeline(ToyLM(V), cell_order=True, streams=True)
    sched = Scheduler(target, 1, n_ctx_slot=64, n_batch=8, is_eog=lambda t: False, partial_reuse=False)
    for j in (first, follow, other):
        sched.submit(j)
        sched.run()
        assert j.request.out == ToyLM(V).greedy(j.tokens, j.n_predict)
    assert (first.n_reused, follow.n_reused, other.n_reused) == (0, len(ctx) - 1, 0)


def test_a_request_that_stops_frees_its_slot_and_disturbs_no_other():
    stopped = Job(list(PROMPTS[0]), 30, Sampler(SamplingParams()))
    stopped.emit = lambda toks: len(stopped.request.out) >= 3          # a stop string, a client gone
    others = _jobs()[1:]
    _, done, _ = _run([stopped, *others], n_slots=2)
    assert stopped.request.out == ToyLM(V).greedy(PROMPTS[0], 3)
    for j, p, n in zip(others, PROMPTS[1:], LENGTHS[1:]):
        assert j.request.out == ToyLM(V).greedy(p, n)
    assert len(done) == len(PROMPTS)


def test_end_of_generation_ends_a_request():
    ref = ToyLM(V).greedy(PROMPTS[2], 20)
    eog = ref[5]
    jobs = _jobs()
    _run(jobs, 3, eog=lambda t: t == eog)
    assert jobs[2].request.out == ref[:ref.index(eog) + 1]


def test_the_rate_window_stays_bounded_when_nobody_reads_it(monkeypatch):
    # a server nobody scrapes for /metrics must not keep a record of every token it generated
    clock = iter(range(0, 10**6, 2))     # seconds: each reading 2 s later
    monkeypatch.setattr(scheduler_module.time, "monotonic", lambda: float(next(clock)))
    sched, _, _ = _run(_jobs() + _jobs() + _jobs(), n_slots=2)
    assert sched.stats.generated == 3 * sum(LENGTHS)
    assert len(sched.rate) <= sched.rate.window_s / 2 + 1
    assert 0 < sched.tokens_per_s() <= 3 * sum(LENGTHS) / sched.rate.window_s


def test_a_cancelled_queued_job_is_dropped_and_reported():
    jobs = _jobs()
    jobs[-1].cancelled = True
    _, done, _ = _run(jobs, 1)
    assert jobs[-1] in done and jobs[-1].request is None


def test_a_request_must_fit_one_slot():
    sched = Scheduler(FakePipeline(ToyLM(V), streams=True), 4, n_ctx_slot=16, n_batch=8, is_eog=lambda t: False)
    with pytest.raises(ConfigError, match="do not fit one slot's context of 16 KV cells"):
        sched.submit(Job([1] * 10, 7, Sampler(SamplingParams())))
    with pytest.raises(ConfigError, match="empty"):
        sched.submit(Job([], 1, Sampler(SamplingParams())))
    with pytest.raises(ConfigError, match="--parallel"):
        Scheduler(FakePipeline(ToyLM(V)), 0, 16, 8, lambda t: False)


def test_partial_copies_are_refused_by_a_cache_of_streams():
    """What the toy models of llama.cpp: the speculative modes' partial seq_cp needs a unified cache."""
    t = FakePipeline(ToyLM(V), streams=True)
    with pytest.raises(AssertionError, match="full KV buffers"):
        t.seq_cp(0, 1, 0, 4)


def _slot(seq, todo, generating, t_queued=0.0, waiting=False):
    job = Job([1], 8, Sampler(SamplingParams()))
    job.t_queued = t_queued
    job.request = Request(n_predict=8, out=[1] if generating else [])
    return Slot(seq, job=job, todo=list(todo), waiting=waiting)


def test_ubatches_model_llama_cpps_split_of_a_batch_into_streams():
    """ggpipe.runs.ubatches follows llama_batch_allocr::split_equal(n_ubatch, sequential=true)."""
    assert ubatches([4, 5, 6, 7] + [8] * 3, 512) == [[0, 1, 2, 3, 4], [5, 6]]
    assert ubatches([4, 5, 7] + [9] * 3, 512) == [[0, 1], [2], [3, 4, 5]]
    assert ubatches([4, 5, 7] + [6] * 3, 512) == [[0, 1, 3], [2], [4, 5]]
    assert list(ubatch_order([4, 5, 7] + [6] * 3, 512)) == [0, 1, 3, 2, 4, 5]
    assert ubatches([0, 0, 0, 1, 1, 1], 4) == [[0, 1, 3, 4], [2, 5]]     # two chunks share ubatches: out of order
    assert ubatches([3] * 5, 2) == [[0, 1], [2, 3], [4]]
    assert ubatch_order([0, 1, 2, 3], 2) is None and ubatch_order([2, 0, 1], 512) is None
    assert ubatch_order([3] * 5, 2) is None


def _split_equal(seq_ids, n_ubatch):
    """llama_batch_allocr::split_equal(n_ubatch, sequential=true), transcribed loop for loop (the oracle of
    ggpipe.runs.ubatches)."""
    used, out = [False] * len(seq_ids), []
    while not all(used):
        cur = []
        for i, s in enumerate(seq_ids):
            if used[i]:
                continue
            add = s not in cur and (not cur or s == cur[-1] + 1)
            if add:
                cur.append(s)
                if len(cur) > n_ubatch:
                    break
        idx = [[i for i, t in enumerate(seq_ids) if t == s and not used[i]] for s in cur]
        per = [[] for _ in cur]
        while all(len(p) < len(x) for p, x in zip(per, idx)):
            for p, x in zip(per, idx):
                p.append(x[len(p)])
                used[p[-1]] = True
            if (len(per[0]) + 1) * len(cur) > n_ubatch:
                break
        out.append([i for p in per for i in p])
    return out


def test_ubatches_agree_with_split_equal_on_random_batches():
    rng = random.Random(7)
    for _ in range(3000):
        if rng.random() < 0.5:     # each sequence's tokens together (what the scheduler sends)
            ids = [s for s in rng.sample(range(10), rng.randint(1, 6)) for _ in range(rng.randint(1, 7))]
        else:                      # interleaved
            ids = [rng.randrange(5) for _ in range(rng.randint(1, 30))]
        n_ubatch = rng.randint(1, 24)
        assert ubatches(ids, n_ubatch) == _split_equal(ids, n_ubatch), (ids, n_ubatch)


def _groups(generating, n, depth):
    slots = [_slot(i, [1], i in generating) if i in generating else Slot(i) for i in range(n)]
    return [[s.seq for s in g] for g in decode_groups(slots, depth)]


def test_decode_groups_are_fixed_ranges_of_slot_ids():
    """llama.cpp evaluates consecutive sequence ids of a non-unified cache in one ubatch: the groups are
    ranges of ids a slot keeps, cut in two only while fewer ranges than micro-batches hold requests."""
    assert _groups(set(range(16)), 16, 3) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    assert _groups(set(range(16)) - {2, 7}, 16, 2) == [[0, 1, 3, 4, 5, 6], [8, 9, 10, 11, 12, 13, 14, 15]]
    # 8 requests in 16 slots (the lowest ids): range 0 holds them all, cut in two
    assert _groups(set(range(8)), 16, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _groups({0, 1, 2, 9}, 16, 2) == [[0, 1, 2], [9]]
    assert _groups({5}, 8, 2) == [[5]]
    assert _groups({0, 1, 2}, 4, 4) == [[0], [1], [2]]
    assert _groups(set(), 4, 2) == []


def test_depth_keeps_several_micro_batches_in_flight():
    """With 4 generating requests and 2 stages, two groups of two take turns."""
    jobs = [Job([i + 1, i + 2], 10, Sampler(SamplingParams())) for i in range(4)]
    target = FakePipeline(ToyLM(V), latency=4, streams=True)
    target.n_stages = 2
    sched = Scheduler(target, 4, n_ctx_slot=64, n_batch=8, is_eog=lambda t: False)
    peak, batches = 0, []
    submit = target.submit

    def counting(run):
        batches.append([int(x) for x in run.seq_ids])
        submit(run)

    target.submit = counting
    for j in jobs:
        sched.submit(j)
    while sched.busy:
        sched.step()
        peak = max(peak, len(target.inflight))
    assert peak == 2
    decode = [b for b in batches if len(set(b)) == len(b)]   # one token per slot (prompts are one slot's chunk)
    assert decode.count([0, 1]) >= 5 and decode.count([2, 3]) >= 5 and max(map(len, decode)) == 2
    for j in jobs:
        assert j.request.out == ToyLM(V).greedy(j.tokens, 10)


def _ngram(context, k):
    from ggpipe.speculation.proposers.ngram import ngram_lookup

    return ngram_lookup(context, 1, 4, k)


def test_a_request_alone_drafts_chains_and_stays_exact():
    """Speculation in the scheduler: while one greedy request generates, its
    token goes with an n-gram chain below it (a micro-batch of its own) and
    the target keeps the tokens it agrees with; on text that repeats itself
    most drafts are taken. A seeded sampled request is drafted for too and
    decides the tokens it decides without a draft: one draw per position
    from the target's distribution, the draft's chain accepted as far as
    the draws agree with it."""
    period = 7
    lm = ToyLM(V, period=period)
    target = FakePipeline(lm, latency=2, cell_order=True, streams=True)
    sched = Scheduler(target, 2, n_ctx_slot=256, n_batch=16, is_eog=lambda t: False, draft=_ngram, draft_max=5)
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    job = Job(list(prompt), 40, Sampler(SamplingParams()))
    sched.submit(job)
    sched.run()
    assert job.request.out == lm.greedy(prompt, 40)
    st = sched.stats
    assert st.drafted > 20 and st.draft_accepted > 0.8 * st.drafted
    assert st.micro_batches < 20                      # far fewer passes than 40 tokens
    params = SamplingParams(temperature=0.7, top_k=0, top_p=1.0, seed=1)
    sampled = Job(list(prompt), 30, Sampler(params))
    sched.submit(sampled)
    drafted, accepted = st.drafted, st.draft_accepted
    sched.run()
    d = sampled.draft_stats
    assert d.drafted > 0 and d.n_accepted > 0, (d.drafted, d.n_accepted)
    assert st.drafted > drafted and st.draft_accepted > accepted
    plain = Job(list(prompt), 30, Sampler(params))
    alone = FakePipeline(lm, latency=2, cell_order=True, streams=True)
    no_draft = Scheduler(alone, 1, n_ctx_slot=256, n_batch=16, is_eog=lambda t: False)
    no_draft.submit(plain)
    no_draft.run()
    assert sampled.request.out == plain.request.out
    assert sampled.request.out != lm.greedy(prompt, 30)       # really sampled


def test_chains_fade_when_several_requests_generate():
    lm = ToyLM(V, period=5)
    target = FakePipeline(lm, latency=2, cell_order=True, streams=True)
    sched = Scheduler(target, 4, n_ctx_slot=256, n_batch=16, is_eog=lambda t: False, draft=_ngram, draft_max=4)
    jobs = [Job([i + 1, i + 2, i + 3, i + 4, i + 5, i + 1], 30, Sampler(SamplingParams())) for i in range(4)]
    for j in jobs:
        sched.submit(j)
    sched.run()
    for j in jobs:
        assert j.request.out == lm.greedy(j.tokens, 30)
    # drafting only once the others have ended: the tails of the last requests
    assert 0 < sched.stats.drafted < 60


def test_chains_that_miss_are_given_up_and_the_refused_cells_removed():
    """A draft that is never right: its refused tokens' cells are removed
    (the toy's streams check every token's cells), and once the gate has
    measured that chains cost more than they save, tokens go alone."""
    lm = ToyLM(V)
    target = FakePipeline(lm, latency=2, cell_order=True, streams=True, pass_cost=(0.010, 0.005))
    sched = Scheduler(target, 1, n_ctx_slot=256, n_batch=16, is_eog=lambda t: False,
                      draft=lambda ctx, k: [(ctx[-1] + 1) % V] * k, draft_max=3)
    job = Job([3, 9, 4], 60, Sampler(SamplingParams()))
    sched.submit(job)
    sched.run()
    assert job.request.out == lm.greedy([3, 9, 4], 60)
    assert sched.stats.draft_skipped > 30


def test_a_chain_drafter_gives_the_first_child_chain():
    from ggpipe.decoding.parallel.chain_draft import ChainDrafter, first_child_nodes
    from ggpipe.speculation.proposers.base import ProposerConfig
    from ggpipe.speculation.proposers.draft_model import DraftModelProposer
    from ggpipe.speculation.tree import SpecTree

    t = SpecTree(anchor_pos=4)
    a = t.add(7, -1)
    t.add(8, -1)          # a sibling: a runner-up, not on the chain
    b = t.add(9, a)
    t.add(10, b)
    assert [t.tokens[j] for j in first_child_nodes(t)] == [7, 9, 10]
    assert first_child_nodes(SpecTree(anchor_pos=0)) == []

    model = ToyLM(V)
    pipe = FakePipeline(model, latency=2, name="draft")
    d = ChainDrafter(DraftModelProposer(ProposerConfig(backend=pipe, n_vocab=V, n_ubatch=4)), cutoff=0.0,
                     timeout_s=5)
    ctx = list(PROMPTS[2])
    assert d(ctx, 5) == model.greedy(ctx, 5)
    assert not pipe.inflight
    other = list(PROMPTS[4])          # another request: the draft's KV follows it
    assert d(other, 3) == model.greedy(other, 3)
    assert d(ctx, 0) == []


def _plan(slots, budget, depth):
    return plan_step(slots, budget, depth, 1)


def test_a_group_split_across_micro_batches_goes_back_together():
    """Slots of one range that went in different micro-batches wait for each other, then go as one run of
    consecutive ids (the old rule sent {1, 3, 5, 7}: four ubatches, four passes over each stage's weights)."""
    slots = [_slot(i, [] if i % 2 == 0 else [9], True, waiting=i % 2 == 0) for i in range(8)]
    assert _plan(slots, 8, 2) == []
    for s in slots[0:8:2]:
        s.waiting, s.todo = False, [9]
    assert [s.seq for s, _, _ in _plan(slots, 8, 2)] == [0, 1, 2, 3]
    for s in slots[:4]:
        s.waiting, s.todo, s.last_sent = True, [], 5
    assert [s.seq for s, _, _ in _plan(slots, 8, 2)] == [4, 5, 6, 7]


def test_groups_larger_than_a_micro_batch_take_turns():
    """A range of more generating slots than --ubatch goes in parts; the part that went least recently goes
    first, so none waits for ever."""
    slots = [_slot(i, [9], True) for i in range(6)]
    sent = []
    for turn in range(6):
        plan = _plan(slots, 2, 1)
        sent.append([s.seq for s, _, _ in plan])
        for s, _, _ in plan:
            s.last_sent = turn
    assert sent == [[0, 1], [2, 3], [4, 5]] * 2


class _Timed(FakePipeline):
    """The toy pipeline with service times: a run's result comes after the runs before it, one step more
    per 4 tokens (prompt chunks take longer than one token per slot), results in order."""

    def _scheduled(self, run):
        last = max([self._due[r.run_id] for r in self.inflight if r.run_id in self._due] + [self.clock])
        self._due[run.run_id] = max(self.clock + self.latency, last + 1 + run.n_tokens // 4)


def _runs(seqs: list[int]) -> int:
    """Ubatches llama.cpp makes of one token per sequence (a non-unified cache): runs of consecutive ids."""
    return 1 + sum(b != a + 1 for a, b in zip(seqs, seqs[1:]))


@pytest.mark.parametrize("n_slots,depth", [(16, 3), (16, 2), (8, 2), (12, 4)])
def test_once_every_slot_generates_each_micro_batch_is_one_run_of_ids(n_slots, depth):
    """Prompts of different lengths finish at different times; once all generate, every micro-batch of
    their tokens holds consecutive slot ids (one ubatch per stage); every request stays exact."""
    prompts = [[(7 * i + k) % (V - 1) + 1 for k in range(4 + (5 * i) % 23)] for i in range(n_slots)]
    # long enough that every slot generates for a while: prompt chunks share micro-batches with the tokens
    jobs = [Job(list(p), 80, Sampler(SamplingParams())) for p in prompts]
    target = _Timed(ToyLM(V), latency=depth, streams=True)
    target.n_stages = depth
    sched = Scheduler(target, n_slots, n_ctx_slot=128, n_batch=8, is_eog=lambda t: False)
    decode, submit = [], target.submit

    def counting(run):
        seqs = [int(x) for x in run.seq_ids]
        if all(s.job and s.job.request.out for s in sched.slots) and len(set(seqs)) == len(seqs):
            decode.append(seqs)
        submit(run)

    target.submit = counting
    for j in jobs:
        sched.submit(j)
    sched.run()
    for j, p in zip(jobs, prompts):
        assert j.request.out == ToyLM(V).greedy(p, 80)
    assert len(decode) > 20 and all(_runs(b) == 1 for b in decode), [b for b in decode if _runs(b) > 1]


def test_requests_that_come_and_go_stay_exact_in_groups():
    """More requests than slots, of different lengths: slots are reused while the others generate."""
    prompts = [[(7 * i + k) % (V - 1) + 1 for k in range(1 + i % 5)] for i in range(30)]
    lengths = [8 + (11 * i) % 17 for i in range(30)]
    jobs = [Job(list(p), n, Sampler(SamplingParams())) for p, n in zip(prompts, lengths)]
    _run(jobs, 10, depth=3, n_batch=4, latency=3)
    for j, p, n in zip(jobs, prompts, lengths):
        assert j.request.out == ToyLM(V).greedy(p, n)


def _lone(lm, draft, lookahead, n=40, depth=2, prompt=(1, 2, 3, 4, 5, 6, 7, 1, 2, 3), draft_max=4, more=()):
    target = FakePipeline(lm, latency=3, cell_order=True, streams=True)   # checks every token's cells
    target.n_stages = depth
    result = target._result

    def on_the_toys_clock(run, logits, cancelled, rows=None):   # results timed in the toy's ticks
        res = result(run, logits, cancelled, rows)
        res.finished_at = 1.0 + target.clock
        return res

    target._result = on_the_toys_clock
    sched = Scheduler(target, 3, n_ctx_slot=256, n_batch=16, is_eog=lambda t: False, draft=draft,
                      draft_max=draft_max, lookahead=lookahead)
    jobs = [Job(list(prompt), n, Sampler(SamplingParams()))] + list(more)
    for j in jobs:
        sched.submit(j)
    sched.run()
    assert not target.inflight and not sched.busy
    for j in jobs:
        assert j.request.out == lm.greedy(j.tokens, j.n_predict)
    return sched, target


def test_lookahead_rows_follow_a_request_alone_and_stay_exact():
    """PipeInfer's continuation under the scheduler (--mode pipeinfer): while
    a lone greedy request's row waits for logits, look-ahead rows built on it
    fill the other stages; on text that repeats itself most are kept, and
    the request finishes in fewer ticks of the pipeline's clock than with
    synchronous chains. Tokens: the target's greedy ones."""
    lm = ToyLM(V, period=7)
    for depth in (2, 3):
        plain, t_plain = _lone(lm, _ngram, False, n=80, depth=depth)
        ahead, t_ahead = _lone(lm, _ngram, True, n=80, depth=depth)
        st = ahead.stats
        assert plain.stats.lookahead == 0
        # kept: the row before accepted whole (4-5 tokens at ~85% each) and the guess right
        assert st.lookahead > 5 and st.lookahead_kept > 0.4 * st.lookahead
        assert t_ahead.clock < t_plain.clock


def test_refused_lookahead_rows_are_dropped_and_their_cells_removed():
    """A guess that is always wrong: every look-ahead row is dropped, its
    cells removed from the slot's stream (the toy checks every token's cells
    at each run) and its logits never used; the tokens stay the target's."""
    lm = ToyLM(V)
    wrong = lambda ctx, k: [(ctx[-1] + 1) % V] * k   # noqa: E731 (never the toy's next token)
    sched, _ = _lone(lm, wrong, True, n=30)
    assert sched.stats.lookahead > 5 and sched.stats.lookahead_kept == 0


def test_lookahead_stops_when_another_request_arrives_and_both_stay_exact():
    """Look-ahead only while one greedy request holds the slots and none
    waits: a second request (and a sampled one) start beside it and every
    request's tokens are its own."""
    lm = ToyLM(V, period=5)
    more = [Job([4, 8, 15, 16], 12, Sampler(SamplingParams())),
            Job([2, 3], 10, Sampler(SamplingParams(temperature=0.8, seed=3)))]
    target = FakePipeline(lm, latency=3, cell_order=True, streams=True)
    target.n_stages = 2
    sched = Scheduler(target, 3, n_ctx_slot=256, n_batch=16, is_eog=lambda t: False, draft=_ngram,
                      draft_max=4, lookahead=True)
    first = Job([1, 2, 3, 4, 5, 1, 2], 40, Sampler(SamplingParams()))
    sched.submit(first)
    for _ in range(12):                       # the first request alone for a while: look-ahead rows go
        sched.step()
    sent = sched.stats.lookahead
    assert sent > 0
    for j in more:
        sched.submit(j)
    sched.run()
    assert first.request.out == lm.greedy(first.tokens, 40)
    assert more[0].request.out == lm.greedy(more[0].tokens, 12)
    alone = Sampler(SamplingParams(temperature=0.8, seed=3))
    ref = FakePipeline(lm, latency=3, cell_order=True, streams=True)
    solo = Scheduler(ref, 1, n_ctx_slot=256, n_batch=16, is_eog=lambda t: False)
    again = Job([2, 3], 10, alone)
    solo.submit(again)
    solo.run()
    assert more[1].request.out == again.request.out


def test_lookahead_with_a_draft_that_has_ranks_drafts_without_waiting():
    """Look-ahead with an instant draft (the n-gram lookup) drafts on the
    spot, gated as chains; with a draft of ranks of its own (a ChainDrafter)
    it drafts without waiting and carries the draft's chains alone
    (``continuous``: no chain below a root)."""
    from ggpipe.decoding.parallel.chain_draft import LookupDrafter

    class Follows(LookupDrafter):
        has_ranks = True

    target = FakePipeline(ToyLM(V), latency=3)
    spec = Scheduler(target, 2, 64, 8, lambda t: False, draft=Follows(lambda c, k: []), lookahead=True, depth=2).spec
    assert spec.lookahead and spec.continuous
    spec = Scheduler(target, 2, 64, 8, lambda t: False, draft=_ngram, lookahead=True, depth=2).spec
    assert spec.lookahead and not spec.continuous
    assert not Scheduler(target, 2, 64, 8, lambda t: False, draft=None, lookahead=True, depth=2).spec.lookahead
    # one micro-batch in flight leaves no room for look-ahead rows: a draft model's chains are waited for
    spec = Scheduler(target, 2, 64, 8, lambda t: False, draft=Follows(lambda c, k: []), lookahead=True, depth=1).spec
    assert not spec.lookahead and not spec.continuous


def _draft_model_drafter(flip: float = 0.2, latency: int = 1):
    from ggpipe.decoding.parallel.chain_draft import ChainDrafter
    from ggpipe.speculation.proposers.base import ProposerConfig
    from ggpipe.speculation.proposers.draft_model import DraftModelProposer

    draft_pipe = FakePipeline(ToyLM(V, flip=flip), latency=latency, name="draft")
    return ChainDrafter(DraftModelProposer(ProposerConfig(backend=draft_pipe, n_vocab=V, n_ubatch=8)),
                        cutoff=0.0, timeout_s=5), draft_pipe


def test_a_chain_drafted_without_waiting_is_taken_below_its_context_or_what_follows_along_it():
    drafter, draft_pipe = _draft_model_drafter(flip=0.0)
    ctx = list(PROMPTS[0])
    assert drafter.take(ctx, 3) == []           # drafting starts below ctx; nothing is waited for
    assert drafter.take(ctx + [5], 3) == []     # ctx goes on: the drafting below ctx is kept
    while not drafter.arrived() and draft_pipe.inflight:
        pass                                     # (the toy's clock advances as it is asked)
    chain = []
    for _ in range(50):
        chain = drafter.take(ctx, 3)
        if chain:
            break
    assert chain == ToyLM(V).greedy(ctx, 3)     # a draft that never flips drafts the target's tokens
    assert drafter.take(ctx, 3) == []           # taken once; drafting below ctx starts again
    drafter.drop()
    assert not drafter.arrived()
    drafter.settle()
    assert not draft_pipe.inflight


def test_a_chain_still_drafted_goes_once_it_holds_the_least_tokens_asked():
    """While the pipeline holds runs a look-ahead row waits for a fuller
    chain (``take(..., least)``): a chain the draft is still drafting is
    returned only once it has ``least`` tokens, and it is the draft's."""
    drafter, draft_pipe = _draft_model_drafter(flip=0.0)
    ctx = list(PROMPTS[0])
    got = []
    for _ in range(200):
        got = drafter.take(ctx, 5, least=3)
        if got:
            break
        drafter.arrived()
    assert len(got) >= 3 and got == ToyLM(V).greedy(ctx, len(got))
    drafter.settle()
    assert not draft_pipe.inflight


def test_a_request_that_starts_alone_has_the_draft_decode_its_prompt_at_once():
    """A request that starts with no other in the slots: a draft with ranks
    of its own follows its prompt at once (the draft's prefill beside the
    target's, not after the first token); one that starts beside another
    does not move the draft."""
    from ggpipe.decoding.parallel.chain_draft import LookupDrafter

    class Follows(LookupDrafter):
        has_ranks = True

        def __init__(self):
            super().__init__(lambda c, k: [])
            self.followed = []

        def follow(self, context):
            self.followed.append(list(context))

    target = FakePipeline(ToyLM(V), latency=2, cell_order=True, streams=True)
    target.n_stages = 2
    draft = Follows()
    sched = Scheduler(target, 2, n_ctx_slot=64, n_batch=8, is_eog=lambda t: False, draft=draft, lookahead=True,
                      depth=2)
    first, second = (Job(list(p), 6, Sampler(SamplingParams())) for p in PROMPTS[:2])
    sched.submit(first)
    sched.step()
    assert draft.followed == [list(PROMPTS[0])]
    sched.submit(second)
    sched.run()
    assert draft.followed == [list(PROMPTS[0])]


def test_below_reads_a_chain_from_a_context_that_went_on_along_it():
    from ggpipe.decoding.parallel.chain_draft import _below
    assert _below([1, 2], [3, 4, 5], [1, 2]) == [3, 4, 5]
    assert _below([1, 2], [3, 4, 5], [1, 2, 3]) == [4, 5]
    assert _below([1, 2], [3, 4, 5], [1, 2, 3, 4, 5]) == []
    assert _below([1, 2], [3, 4, 5], [1, 2, 4]) is None
    assert _below([1, 2], [3, 4, 5], [1, 9, 3]) is None
    assert _below([1, 2], [3], [1]) is None and _below([1, 2], [3], [1, 2, 3, 7]) == []   # went on beyond it


@pytest.mark.parametrize("lookahead,lengths,depth", [(False, [40, 4, 12], 1), (True, [40], 2), (True, [40, 4, 12], 2)])
def test_a_draft_model_drafts_for_a_request_alone_and_stays_exact(lookahead, lengths, depth):
    """``--parallel`` with a draft model (ggpipe.decoding.parallel.chain_draft): while
    one greedy request generates, the draft model's chain goes below its
    token (the draft's pipeline decodes only what its KV lacks, across
    requests; the toy's clock-less pipelines leave the draft's step
    unmeasured: the gate drafts), or with look-ahead (PipeInfer's
    continuation), the draft drafts below every token sent without the head
    waiting and its chain goes as a look-ahead row; beside another
    generating request, nothing is drafted. Every request's tokens are the
    target's greedy ones, and the draft's pipeline is idle at the end."""
    lm = ToyLM(V)
    target = FakePipeline(lm, latency=2 * depth, cell_order=True, streams=True)
    target.n_stages = depth
    drafter, draft_pipe = _draft_model_drafter()
    sched = Scheduler(target, 3, n_ctx_slot=256, n_batch=16, is_eog=lambda t: False, draft=drafter, draft_max=4,
                      depth=depth, lookahead=lookahead)
    jobs = [Job(list(p), n, Sampler(SamplingParams())) for p, n in zip(PROMPTS, lengths)]
    for j in jobs:
        sched.submit(j)
    sched.run()
    for j in jobs:
        assert j.request.out == lm.greedy(j.tokens, j.n_predict)
    st = sched.stats
    assert 0 < st.draft_accepted <= st.drafted and (st.drafted > 10 or lookahead)
    assert (0 < st.lookahead_kept <= st.lookahead) == lookahead
    assert not draft_pipe.inflight


def test_lookahead_is_on_where_the_target_stages_have_hosts_of_their_own(monkeypatch):
    """GGPIPE_LOOKAHEAD: auto (on only where no two target stages share a
    host: there, stages that compute at once slow each other), on, off; any
    other value is a clear error."""
    from ggpipe.decoding.parallel.lone_drafts import lookahead_wanted

    def target_hosts(hosts, n_target):      # Session.target_hosts: the first n_target ranks' hosts
        return hosts[:n_target]

    monkeypatch.delenv("GGPIPE_LOOKAHEAD", raising=False)
    assert lookahead_wanted(target_hosts(["a", "b", "c"], 3))
    assert not lookahead_wanted(target_hosts(["a", "a"], 2))
    assert lookahead_wanted(target_hosts(["a", "a"], 2), draft_has_ranks=True)    # a draft model drafts without waiting
    assert lookahead_wanted(target_hosts(["a", "b", "b"], 2))          # rank 2 (a draft) shares rank 1's host
    monkeypatch.setenv("GGPIPE_LOOKAHEAD", "on")
    assert lookahead_wanted(target_hosts(["a", "a"], 2))
    monkeypatch.setenv("GGPIPE_LOOKAHEAD", "off")
    assert not lookahead_wanted(target_hosts(["a", "b"], 2))
    monkeypatch.setenv("GGPIPE_LOOKAHEAD", "sometimes")
    with pytest.raises(ConfigError, match="GGPIPE_LOOKAHEAD"):
        lookahead_wanted(target_hosts(["a", "b"], 2))


def test_a_slot_goes_through_its_states_in_order():
    """idle -> prompt -> generating -> done -> idle (ggpipe.decoding.loop.
    SlotState), as /slots shows them, for a request alone in its slot."""
    from ggpipe.decoding.loop import SlotState

    target = FakePipeline(ToyLM(V), latency=2, cell_order=True, streams=True)
    sched = Scheduler(target, 2, n_ctx_slot=256, n_batch=4, is_eog=lambda t: False)
    seen = []

    def note():
        st = sched.slots[0].state
        if not seen or seen[-1] != st:
            seen.append(st)

    note()
    job = Job(list(PROMPTS[0]) * 3, 6, Sampler(SamplingParams()))
    sched.submit(job)
    while sched.busy:
        sched.step()
        note()
    for _ in range(5):
        sched.step()
        note()
    assert [s.value for s in seen if s is not SlotState.DONE] == ["idle", "prompt", "generating", "idle"]
    assert sched.view()[0]["state"] == "idle" and sched.slots[1].state is SlotState.IDLE
