"""The head's Pipeline with only a local stage (no MPI): cancellation
bookkeeping and runs built on aborted cells (fake stage, no model)."""

from __future__ import annotations

import numpy as np
import pytest

from ggpipe.pipeline.driver import Pipeline
from ggpipe.runs import Run
from ggpipe.runtime.stage import InvalidBatch


class FakeHooks:
    def cancel(self) -> None:
        pass

    def clear_cancel(self) -> None:
        pass


class FakeStage:
    """Returns one-hot logits; raises InvalidBatch for the runs in ``invalid``
    (a run whose parent cells were removed by an aborted run)."""

    def __init__(self, n_vocab: int = 8, invalid=()):
        self.hooks = FakeHooks()
        self.n_vocab = n_vocab
        self.invalid = set(invalid)
        self.calls = 0

    def decode(self, tokens, pos, n_seq_id, seq_ids, outputs):
        self.calls += 1
        if self.calls in self.invalid:
            raise InvalidBatch("positions do not continue the sequence")
        n = int(np.count_nonzero(outputs)) if outputs is not None else 1
        return np.zeros((max(n, 1), self.n_vocab), dtype=np.float32)

    def kv(self, *a) -> None:
        pass


def test_cancel_set_stays_bounded_for_a_local_pipeline():
    """Pipeline._cancelled was never pruned without other ranks: it grew for
    the life of a serve job."""
    p = Pipeline(FakeStage(), None, [], 8, n_seq_max=4, max_outputs=8, async_local=True)
    try:
        for i in range(50):
            run = Run.linear([1, 2], 10 * i, seq=1, speculative=True)
            p.submit(run)
            p.cancel(run.run_id)
            p.wait(10)
        assert p._cancelled == set()
    finally:
        p.close()


def test_a_speculative_run_on_aborted_cells_is_dropped_not_an_error():
    """Cancels are issued one at a time: a run can fail (InvalidBatch) before
    its own cancel is registered. Workers drop it; the head's stage does too
    (it ended the generation with an executor error)."""
    p = Pipeline(FakeStage(invalid={2}), None, [], 8, n_seq_max=4, max_outputs=8, async_local=True)
    try:
        first, second = Run.linear([1], 0, seq=1, speculative=True), Run.linear([2], 1, seq=1, speculative=True)
        p.submit(first)
        p.submit(second)
        res = [p.wait(10), p.wait(10)]
        assert [r.run.run_id for r in res] == [first.run_id, second.run_id]
        assert not res[0].cancelled and res[1].cancelled
        assert p.stats["dropped_after_cancel"] == 1
    finally:
        p.close()


def test_result_due_times_small_runs_and_prompt_chunks_apart():
    """A remote pipeline's due time: the later of the run's start and the
    previous arrival plus an EWMA of small runs' service times, or for a
    prompt chunk its tokens times an EWMA of the chunks' seconds per token
    (neither inflates the other); None for nothing in flight or a local
    pipeline."""
    import time

    from ggpipe.pipeline.driver import SERVICE_MAX_TOKENS, Pipeline
    from ggpipe.runs import Run

    pipe = Pipeline(None, None, ranks=[1], n_vocab=8)
    assert pipe.result_due() is None and pipe.due_in() is None
    prompt = Run.linear(np.arange(SERVICE_MAX_TOKENS + 1), 0)
    prompt.started_at = time.perf_counter() - 0.5
    pipe._arrived(prompt, cancelled=False)
    assert pipe.service_s is None                       # a prompt chunk does not time the small runs
    assert 0.4 / (SERVICE_MAX_TOKENS + 1) < pipe.token_s < 5.0 / (SERVICE_MAX_TOKENS + 1)   # its seconds per token
    chunk = Run.linear(np.arange(4 * (SERVICE_MAX_TOKENS + 1)), 0)
    pipe.inflight.append(chunk)
    chunk.started_at = time.perf_counter()
    t, service = pipe.result_due()
    assert service == pytest.approx(4 * (SERVICE_MAX_TOKENS + 1) * pipe.token_s)   # four times the tokens
    assert t == pytest.approx(max(chunk.started_at, pipe._last_arrival) + service)
    pipe.inflight.clear()
    step = Run.linear([3], 10)
    pipe.inflight.append(step)
    t, service = pipe.result_due()
    assert service == 0.0 and t <= time.perf_counter()  # nothing measured: due now
    step.started_at = time.perf_counter()
    time.sleep(0.02)
    pipe._arrived(step, cancelled=False)
    assert 0.015 < pipe.service_s < 1.0                 # 20 ms, or more where the machine stalled
    measured = pipe.service_s
    cancelled = Run.linear([4], 11)
    cancelled.started_at = time.perf_counter() - 5.0
    pipe._arrived(cancelled, cancelled=True)
    assert pipe.service_s == measured                   # a cancelled run times nothing
    nxt = Run.linear([5], 12)
    nxt.started_at = time.perf_counter()
    pipe.inflight[0] = nxt
    assert 0.0 < pipe.due_in() <= pipe.service_s
    assert Pipeline(object(), None, ranks=[], n_vocab=8).result_due() is None


def test_a_call_runs_on_the_thread_that_computes_the_stage():
    """HeadStage.call: with an executor, fn runs on the executor's thread
    (where the stage warms up, so llama.cpp's threads belong to the thread
    that computes), its result or error comes back; without one, here."""
    import threading
    from types import SimpleNamespace

    from ggpipe.errors import GGPipeError
    from ggpipe.pipeline.head_stage import HeadStage

    stats = {"cancelled_before_start": 0, "cancelled_mid_compute": 0, "dropped_after_cancel": 0, "rows_masked": 0}
    for async_local in (True, False):
        head = HeadStage(SimpleNamespace(), None, [], "target", set(), dict(stats), lambda: None,
                         async_local=async_local)
        try:
            name = head.call(lambda: threading.current_thread().name, 5)
            assert name == ("target-stage0" if async_local else threading.current_thread().name)

            def fail():
                raise GGPipeError("llama.cpp failed")
            with pytest.raises(GGPipeError, match="llama.cpp failed"):
                head.call(fail, 5)
            assert head.call(lambda: 7, 5) == 7 and head.error is None   # the executor goes on
        finally:
            head.close()
