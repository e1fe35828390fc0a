#!/usr/bin/env python
"""Memory of a long generation on real ranks: one
request of N tokens (default 20,000) per mode, greedy and sampled, with the
head's and every rank's resident set size (RSS) sampled as it runs. After
warm-up the RSS must stay flat: the head's speculation graph is trimmed
behind the committed prefix (ggpipe.speculation.graph.SpecGraph.trim), the
KV cache is allocated up front (``-c``), and nothing else grows per token
but the token lists themselves (a few bytes a token).

    python scripts/soak_memory.py                       # 20,000 tokens, every mode, greedy and --temp 0.8
    python scripts/soak_memory.py -n 3000 --modes pipeinfer,pipedec --temps 0
    python scripts/soak_memory.py --toy                 # 20,000 tokens on the toy pipelines, in this process

Prints one line per run: the RSS of rank 0 (the head) and of the largest
other rank at 10 % of the run (after warm-up) and their peak after it, the
head's growth between them, the tokens generated; exits 1 if a run's head grew more than
``--max-growth-mb`` (default 16 MiB) after warm-up. Attention over a
long context makes each token slower: on 2 ranks sharing 2 cores, 3,000
tokens took about 4 minutes a run (20,000: hours). Needs psutil and the
models of tests/conftest.py (smollm2-135m as target, smollm2-135m-skip26
as the weak draft that makes wide trees).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import psutil

MODES = {
    "iterative": ["--mode", "iterative"],
    "speculative": ["--mode", "speculative", "--branches", "2"],
    "pipeinfer": ["--mode", "pipeinfer", "--branches", "2"],
    "pipeinfer-chain": ["--mode", "pipeinfer"],      # its defaults: a chain (--branches 1)
    "pipedec": ["--mode", "pipedec", "--tree-width", "3"],
}


def rank_rss(root: psutil.Process) -> dict[int, int]:
    """RSS (bytes) of each rank's stage process under the launcher ``root``
    (ggpipe.transport.rank_guard.rank_processes)."""
    from ggpipe.transport.rank_guard import rank_processes

    out = {}
    for r, c in rank_processes(root.pid).items():
        try:
            out[r] = c.memory_info().rss
        except psutil.Error:
            continue
    return out


def soak(target: str, draft: str, mode: str, temp: float, n: int, ranks: int, interval: float) -> dict:
    from ggpipe.child_process import ggpipe_command
    from ggpipe.transport.launcher_path import find_launcher

    cmd = [find_launcher("mpiexec"), "-n", str(ranks), *ggpipe_command(), "generate", "-m", target, "-md", draft,
           "-p", "Once upon a time", "-n", str(n), "-c", str(n + 64), "--ignore-eos", "--json",
           "--temp", str(temp), "--seed", "1", *MODES[mode]]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples: list[tuple[float, dict]] = []
    stop = threading.Event()

    def sample():
        root = psutil.Process(p.pid)
        t0 = time.monotonic()
        while not stop.is_set():
            rss = rank_rss(root)
            if rss:
                samples.append((time.monotonic() - t0, rss))
            stop.wait(interval)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = p.communicate()
    stop.set()
    th.join()
    if p.returncode != 0:
        raise SystemExit(f"{mode} temp={temp}: ggpipe failed ({p.returncode}):\n{err[-2000:]}")
    got = json.loads(out)
    full = [(t, s) for t, s in samples if len(s) == ranks]
    t_end = full[-1][0]
    warm = next(s for t, s in full if t >= 0.1 * t_end)
    after = [s for t, s in full if t >= 0.1 * t_end]
    end = {r: max(s[r] for s in after) for r in warm}     # the peak after warm-up (the ranks free memory at exit)
    others = [r for r in end if r != 0]

    def mb(x):
        return round(x / 2**20, 1)

    return {"mode": mode, "temp": temp, "tokens": len(got["tokens"]), "seconds": round(t_end, 1),
            "head_rss_warm_mb": mb(warm[0]), "head_rss_peak_mb": mb(end[0]),
            "head_growth_mb": mb(end[0] - warm[0]),
            "rank_rss_warm_mb": mb(max(warm[r] for r in others)) if others else None,
            "rank_rss_peak_mb": mb(max(end[r] for r in others)) if others else None,
            "samples": len(full)}


def soak_toy(mode: str, temp: float, n: int) -> dict:
    """One request of ``n`` tokens on the toy pipelines (ggpipe/sim/toy.py,
    as tests/test_long_generation.py) in this process: the head's Python
    heap (tracemalloc) and speculation graph at 10 % of the request and
    their peaks after it. What grows per token on the head is Python state;
    the ranks' KV cache is allocated up front."""
    import tracemalloc

    import numpy as np

    from ggpipe.decoding.factory import build_decoder
    from ggpipe.decoding.plan import DecodingPlan
    from ggpipe.decoding.settings import SpecSettings
    from ggpipe.sampling import Sampler
    from ggpipe.sampling_params import SamplingParams
    from ggpipe.sim.toy import FakePipeline, ToyLM

    extra = {"speculative": {"branches": 2}, "pipeinfer": {"branches": 2}, "pipedec": {"tree_width": 3},
             "iterative": {}}[mode]
    from ggpipe.sim.kv_model import KvCells

    target = FakePipeline(ToyLM(48), latency=4)
    target.n_stages = 3
    draft = FakePipeline(ToyLM(48, flip=0.3), latency=1, name="draft")
    for pipe in (target, draft):  # a context that holds the request (-c n + 64 on real ranks)
        pipe.kv_cells = KvCells(n + 256)
    spec = SpecSettings(spec_type="draft", p_split=0.05, **extra)
    dec = build_decoder(DecodingPlan.resolve(mode, spec), target, draft, n_ubatch=8, n_seq_max=64,
                        is_eog=lambda t: False, timeout_s=5)
    seen = {"steps": 0, "warm": None, "peak_heap": 0, "peak_nodes": 0}
    step = dec.step
    tracemalloc.start()

    def recording():
        step()
        seen["steps"] += 1
        if seen["steps"] % 50:
            return
        r = getattr(dec, "r", None)
        done = len(r.out) if r is not None and hasattr(r, "out") else 0
        nodes = len(r.graph.nodes) if r is not None and hasattr(r, "graph") else 0
        if seen["warm"] is None and done >= n // 10:
            seen["warm"] = (head_heap(), nodes)
        elif seen["warm"] is not None and seen["steps"] % 2000 == 0:
            seen["peak_heap"] = max(seen["peak_heap"], head_heap())
        if seen["warm"] is not None:
            seen["peak_nodes"] = max(seen["peak_nodes"], nodes)

    def head_heap() -> int:
        """Bytes the head's own code holds: the toy pipelines' modelled KV
        cache (ggpipe/sim/) grows with the context as a real one is
        allocated up front, so it is left out."""
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, "*/ggpipe/sim/*")])
        return sum(st.size for st in snap.statistics("filename"))

    dec.step = recording
    t0 = time.monotonic()
    params = SamplingParams(temperature=temp, seed=7 if temp else None)
    out = dec.generate(np.array([3, 9, 4, 3, 9, 4, 3, 9, 11, 5, 3, 9], np.int32), n, Sampler(params))
    seen["peak_heap"] = max(seen["peak_heap"], head_heap())
    tracemalloc.stop()
    warm_heap, warm_nodes = seen["warm"] or (0, 0)
    return {"mode": mode, "temp": temp, "backend": "toy", "tokens": len(out), "seconds": round(time.monotonic() - t0, 1),
            "heap_warm_mb": round(warm_heap / 2**20, 2), "heap_peak_mb": round(seen["peak_heap"] / 2**20, 2),
            "head_growth_mb": round((seen["peak_heap"] - warm_heap) / 2**20, 2),
            "graph_nodes_warm": warm_nodes, "graph_nodes_peak": seen["peak_nodes"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=20000, help="tokens per run")
    ap.add_argument("--modes", default=",".join(m for m in MODES if m != "pipeinfer-chain"))
    ap.add_argument("--temps", default="0,0.8", help="temperatures (0: greedy)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between RSS samples")
    ap.add_argument("--max-growth-mb", type=float, default=16.0)
    ap.add_argument("--target", default=None, help="target GGUF (default: smollm2-135m from the cache)")
    ap.add_argument("--draft", default=None, help="draft GGUF (default: smollm2-135m-skip26)")
    ap.add_argument("--toy", action="store_true",
                    help="the toy pipelines in this process instead of real ranks (minutes, not hours, for 20,000 "
                         "tokens): the head's Python heap and speculation graph")
    a = ap.parse_args()
    if a.toy:
        bad = 0
        for mode in a.modes.split(","):
            for temp in (float(t) for t in a.temps.split(",")):
                res = soak_toy(mode, temp, a.n)
                print(json.dumps(res), flush=True)
                bad += res["head_growth_mb"] > a.max_growth_mb
        return 1 if bad else 0
    from ggpipe.models.registry import fetch

    target = a.target or str(fetch("smollm2-135m", progress=False))
    draft = a.draft or str(fetch("smollm2-135m-skip26", progress=False))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    bad = 0
    for mode in a.modes.split(","):
        for temp in (float(t) for t in a.temps.split(",")):
            res = soak(target, draft, mode, temp, a.n, a.ranks, a.interval)
            print(json.dumps(res), flush=True)
            bad += res["head_growth_mb"] > a.max_growth_mb
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
