"""Which worker ranks probe for cancellations while a run computes
(ggpipe.pipeline.worker.Worker.mid_run_cancels, ggpipe.decoding.plan.DecodingPlan.cancels_runs):
only jobs whose head may cancel a run; the others' helper thread stays asleep
(the mode's declaration, ``Mode.may_cancel``). MPI-free."""

from types import SimpleNamespace

import pytest

from ggpipe.decoding.settings import SpecSettings
from ggpipe.pipeline.worker import Worker
from ggpipe.decoding.plan import DecodingPlan


def _worker(**kw) -> Worker:
    stage = SimpleNamespace(hooks=SimpleNamespace(), spec=SimpleNamespace(n_seq_max=4), n_vocab=10)
    return Worker(stage, transport=None, prev=0, next=None, head=0, max_tokens=8, **kw)


def test_the_probe_runs_mid_run_only_where_cancels_can_come():
    w = _worker(cancel_src=0)
    assert w._mid_run_poll() == w._take_cancels          # the default: PipeInfer's early cancellation
    assert _worker(cancel_src=0, mid_run_cancels=False)._mid_run_poll() is None
    assert _worker(cancel_src=None)._mid_run_poll() is None


@pytest.mark.parametrize("mode, parallel, cancel, expected", [
    ("iterative", 1, True, False),      # iterative decoding never cancels
    ("iterative", 8, True, False),
    ("pipeinfer", 1, True, True),       # one request, asynchronous speculation: early cancellation
    ("pipeinfer", 1, False, False),     # --no-cancel
    ("pipeinfer", 8, True, False),      # the --parallel scheduler removes dropped rows' cells instead
    ("speculative", 1, True, False),    # synchronous speculation: one run at a time, none to cancel
    ("speculative", 4, True, False),
    ("pipedec", 1, True, True),         # runs overlap: early cancellation
    ("pipedec", 1, False, False),
])
def test_cancels_runs(mode, parallel, cancel, expected):
    plan = DecodingPlan.resolve(mode, SpecSettings(cancel=cancel), slots=parallel)
    assert plan.cancels_runs is expected
