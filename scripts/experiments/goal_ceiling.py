"""The ceiling of many-request throughput on one host: two pipeline stages'
own compute, without ggpipe around them (docs/benchmarks/many-requests.md).

How many generated tokens per second can a pipeline of two stages of one
thread each make with 8 requests, at best, on the cores it shares, set beside
``llama-batched-bench`` on the same cores and beside the best a pipeline makes
one request at a time? Measured from the stages' own compute, with nothing of
ggpipe's scheduler, transport or head around it (so an upper bound of any
scheduler), interleaved round by round:

* ``pair``: the two stages' slices (``--split``, ggpipe's default split of the
  model for 2 ranks) each decode 4 sequences a step, in two processes whose
  timed steps run at the same time (``scripts/experiments/stage_decode_time.py
  --start-at``): the two groups of 4 rows of a pipeline with two micro-batches
  in flight. Ceiling: 8 rows per ``t0 + t1`` (stages of equal cost, no hops,
  no head; the real cycle is ``2 * max(t0, t1)`` or more).
* ``alone``: each slice decodes 1 sequence a step with the other core idle:
  one request through the pipeline at best takes ``t0 + t1`` a token.
* ``llama-batched-bench -npp 64 -ntg 128 -npl 1,8 -t 2``: S_TG at 8 and 1.

    python -P scripts/experiments/goal_ceiling.py -m smollm2-goliath-40l-f32 --rounds 2

Needs ``python scripts/peer_llamacpp.py build --llamafile off`` (llama.cpp's
tools built with the kernels of ggpipe's llama-cpp-python build).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import bench_parallel  # noqa: E402 (scripts/bench_parallel.py)

from ggpipe.models.registry import resolve  # noqa: E402

STEP = re.compile(r"median ([0-9.]+) ms")


def stage(model: str, layers: str, seqs: int, steps: int, start_at: float = 0.0) -> subprocess.Popen:
    cmd = [sys.executable, "-P", str(HERE / "stage_decode_time.py"), "-m", model, "--layers", layers,
           "--seqs", str(seqs), "--steps", str(steps), "-t", "1"]
    if start_at:
        cmd += ["--start-at", f"{start_at:.3f}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def median_ms(p: subprocess.Popen) -> float:
    out, _ = p.communicate(timeout=600)
    m = STEP.search(out)
    if p.returncode or not m:
        raise SystemExit(f"stage_decode_time failed: {out.strip()}")
    return float(m.group(1))


def batched_bench(model: str) -> dict[int, float]:
    """S_TG (generated tokens/s) of llama-batched-bench at 1 and 8 sequences of 64 + 128 tokens, 2 threads,
    llamafile off: bench_parallel.py's run of it (the goals table's)."""
    rows = bench_parallel.batched_bench(str(resolve(model)), [1, 8], 128, 2, 64, llamafile=False)
    return {b: r["gen_tokens_per_s"] for b, r in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32")
    ap.add_argument("--split", default="0:24,24:40", help="the two stages' layer ranges A:B,B:C (the default is the goliath's at 2 ranks; "
                    "`ggpipe plan -n 2 -m MODEL` prints another model's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    a = ap.parse_args()
    s0, s1 = a.split.split(",")
    res: dict[str, list[float]] = {k: [] for k in ("t0_pair", "t1_pair", "t0_alone1", "t1_alone1", "bb8", "bb1")}
    for r in range(1, a.rounds + 1):
        at = time.time() + 25  # both load their slice and decode their prompts before this
        p0, p1 = stage(a.model, s0, 4, a.steps, at), stage(a.model, s1, 4, a.steps, at)
        t0p, t1p = median_ms(p0), median_ms(p1)
        t0a = median_ms(stage(a.model, s0, 1, a.steps))
        t1a = median_ms(stage(a.model, s1, 1, a.steps))
        bb = batched_bench(a.model)
        for k, v in zip(res, (t0p, t1p, t0a, t1a, bb[8], bb[1])):
            res[k].append(v)
        ceiling = 8e3 / (t0p + t1p)
        one = 1e3 / (t0a + t1a)
        print(f"round {r}: 4-row steps side by side {t0p:.1f} + {t1p:.1f} ms -> ceiling {ceiling:.1f} tokens/s; "
              f"1-row steps alone {t0a:.1f} + {t1a:.1f} ms -> one at a time at best {one:.1f} tokens/s; "
              f"llama-batched-bench S_TG 8 seq {bb[8]:.1f}, 1 seq {bb[1]:.1f}; ceiling / S_TG(8) "
              f"{ceiling / bb[8]:.2f}x, ceiling / one at a time {ceiling / one:.2f}x", flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    ceiling = 8e3 / (med["t0_pair"] + med["t1_pair"])
    one = 1e3 / (med["t0_alone1"] + med["t1_alone1"])
    print(f"medians: ceiling {ceiling:.1f} tokens/s = {ceiling / med['bb8']:.2f}x llama-batched-bench's "
          f"{med['bb8']:.1f} at 8 sequences, {ceiling / one:.2f}x one request at a time at best ({one:.1f})")


if __name__ == "__main__":
    main()
