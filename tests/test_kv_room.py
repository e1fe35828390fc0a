"""Trees near the end of the context: with prompt + n =
the KV cache's cells, no mode may place more cells than the cache holds,
however wide its trees (pipeinfer --branches, pipedec --tree-width) and
however many runs are in flight; the output stays exact. The toy pipelines
model llama.cpp's unified KV cache cell by cell (ggpipe/sim/kv_model.py)
and fail with "KV cache full" as llama_decode would; the real-rank test at
the end runs every mode at prompt + n = -c."""

from __future__ import annotations

import numpy as np
import pytest

from ggpipe.decoding.factory import build_decoder
from ggpipe.decoding.plan import DecodingPlan
from ggpipe.decoding.settings import SpecSettings
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.sim.kv_model import KvCells
from ggpipe.sim.toy import FakePipeline, ToyLM

V = 48
PROMPTS = [[3, 9, 4, 3, 9, 4, 3, 9, 11, 5, 3, 9], [7, 1, 7, 2, 7, 1, 7, 2, 5]]
N = 60

CASES = [
    ("speculative", {"branches": 3}, 3, 1),
    ("pipeinfer", {"branches": 2}, 4, 1),
    ("pipeinfer", {"branches": 3, "max_inflight": 6}, 8, 1),
    ("pipeinfer", {"branches": 2, "max_inflight": 4, "continuous": True}, 6, 1),
    ("pipedec", {"tree_width": 3}, 4, 4),
    ("pipedec", {"tree_width": 4, "max_children": 2}, 6, 6),
]


@pytest.mark.parametrize("mode,extra,latency,stages", CASES)
@pytest.mark.parametrize("flip", [0.3, 0.6])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_trees_fit_a_full_context(mode, extra, latency, stages, flip, prompt):
    n_cells = len(prompt) + N          # prompt + n = the context, as serve's default max_tokens makes it
    target = FakePipeline(ToyLM(V), latency=latency)
    target.n_stages = stages
    draft = FakePipeline(ToyLM(V, flip=flip), latency=1, name="draft")
    target.kv_cells, draft.kv_cells = KvCells(n_cells), KvCells(n_cells)
    spec = SpecSettings(spec_type="draft", p_split=0.05, **extra)
    dec = build_decoder(DecodingPlan.resolve(mode, spec), target, draft, n_ubatch=8, n_seq_max=64,
                        is_eog=lambda t: False, timeout_s=5)
    out = dec.generate(np.array(prompt, np.int32), N, Sampler(SamplingParams()))
    assert out == ToyLM(V).greedy(prompt, N)
    assert dec.stats["drafted"] > 0


@pytest.mark.parametrize("mode,extra,latency,stages", CASES[1:3] + CASES[4:5])
def test_room_for_a_second_request_after_the_first(mode, extra, latency, stages):
    """A request that reuses the first one's cells (history) fills the rest
    of the context: the cells the first left are counted."""
    prompt = PROMPTS[0]
    target = FakePipeline(ToyLM(V), latency=latency)
    target.n_stages = stages
    draft = FakePipeline(ToyLM(V, flip=0.5), latency=1, name="draft")
    n_cells = len(prompt) + 2 * N
    target.kv_cells, draft.kv_cells = KvCells(n_cells), KvCells(n_cells)
    spec = SpecSettings(spec_type="draft", p_split=0.05, **extra)
    dec = build_decoder(DecodingPlan.resolve(mode, spec), target, draft, n_ubatch=8, n_seq_max=64,
                        is_eog=lambda t: False, timeout_s=5)
    first = dec.generate(np.array(prompt, np.int32), N, Sampler(SamplingParams()))
    hist = prompt + first[:-1]
    target.seq_rm(-1, len(hist), -1)
    second = dec.generate(np.array(first[-1:], np.int32), N - 1, Sampler(SamplingParams()), start_pos=len(hist),
                          history=hist)
    assert first + second == ToyLM(V).greedy(prompt, 2 * N - 1)


REAL_MODES = [["--mode", "iterative"], ["--mode", "speculative", "--branches", "2"],
              ["--mode", "pipeinfer", "--branches", "2"], ["--mode", "pipedec", "--tree-width", "3"]]


@pytest.mark.mpi
@pytest.mark.full
@pytest.mark.parametrize("ranks,split", [(2, None), (3, "0.5,0.5/1.0")])
@pytest.mark.parametrize("args", REAL_MODES, ids=lambda a: "-".join(a[1::2]))
def test_every_mode_fills_the_context_exactly_on_real_ranks(goliath, smollm2_skip26, reference, args, ranks, split):
    """prompt + n = -c (256: llama.cpp rounds a context up to 256 cells, so
    this one has no cell to spare) with a weak draft (smollm2-skip26: wide
    trees) on real ranks: every mode finishes with the single-node tokens
    of the target (the F16 goliath: exact; docs/user-guide/exactness.md)."""
    from conftest import assert_greedy, PROMPTS, generate_json

    ctx = 256
    prompt = PROMPTS[1]
    n_prompt = generate_json(goliath, prompt, 1, None)["n_prompt"]
    n = ctx - n_prompt
    extra = ["-c", str(ctx), "-md", str(smollm2_skip26), *args] + (["--split", split] if split else [])
    got = generate_json(goliath, prompt, n, ranks, extra)
    assert_greedy(got["tokens"], goliath, prompt, n)
    if args[1] != "iterative":
        assert got["decoder"]["drafted"] > 0
