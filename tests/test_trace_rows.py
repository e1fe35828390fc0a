"""scripts/trace_rows.py on a made-up two-rank trace (ggpipe/trace.py's
format): rows per second of the decode span and each stage's busy share,
the figures docs/benchmarks/batching.md quotes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trace_rows.py"


def _load():
    spec = importlib.util.spec_from_file_location("trace_rows", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(path: Path, rank: int, offset: float, events: list[dict]) -> None:
    lines = [{"rank": rank, "pid": 1, "host": "h", "wall_offset_s": offset}, *events]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))


def test_rows_per_second_and_busy_shares(tmp_path):
    # rank 0: ten runs of 4 rows, 8 ms each, every 10 ms; rank 1 the same 2 ms later, 5 ms each.
    # Rank 1's clock reads 100 s ahead: the header's offsets put both on one axis.
    r0 = [{"ph": "X", "name": "run", "ts": 0.010 * i, "dur": 0.008, "lane": "target stage", "run": i + 1, "n": 4}
          for i in range(10)]
    r1 = [{"ph": "X", "name": "run", "ts": 100.002 + 0.010 * i, "dur": 0.005, "lane": "stage", "run": i + 1, "n": 4}
          for i in range(10)] + [{"ph": "X", "name": "idle", "ts": 100.0, "dur": 0.002, "lane": "stage"}]
    _write(tmp_path / "rank0.jsonl", 0, 1000.0, r0)
    _write(tmp_path / "rank1.jsonl", 1, 900.0, r1)
    s = _load().summary(str(tmp_path))
    assert s["rows"] == 40
    assert s["seconds"] == pytest.approx(0.097)          # first run's start to the last stage's last end
    assert s["rows_per_s"] == pytest.approx(40 / 0.097)
    assert s["busy"][0] == pytest.approx(0.8, abs=0.15) and s["busy"][1] == pytest.approx(0.5, abs=0.15)
    assert s["work_s"] == pytest.approx([0.080, 0.050])     # the idle span is no run
    assert s["bound_rows_per_s"] == pytest.approx(40 / 0.080)   # the busiest stage, never waiting


def test_detail_names_the_prefill_phase_the_hops_and_the_heads_turn(tmp_path):
    # rank 0: a 20-row prompt run, then four 4-row runs; rank 1 starts each 1 ms after rank 0 ends it,
    # the head receives its logits 2 ms after rank 1 ends it and submits the next run 0.5 ms later.
    r0_runs = [(1, 0.0, 0.1, 20)] + [(k, 0.2 + 0.05 * (k - 2), 0.04, 4) for k in range(2, 6)]
    r0, r1 = [], []
    for run, t, d, n in r0_runs:
        r0.append({"ph": "X", "name": "run", "ts": t, "dur": d, "lane": "target stage", "run": run, "n": n})
        t1, d1 = t + d + 0.001, 0.03
        r1.append({"ph": "X", "name": "run", "ts": t1, "dur": d1, "lane": "stage", "run": run, "n": n})
        r0.append({"ph": "i", "name": "recv", "ts": t1 + d1 + 0.002, "dur": 0.0, "lane": "head", "run": run})
        r0.append({"ph": "i", "name": "submit", "ts": t1 + d1 + 0.0025, "dur": 0.0, "lane": "head", "run": run + 1})
    _write(tmp_path / "rank0.jsonl", 0, 0.0, sorted(r0, key=lambda e: e["ts"]))
    _write(tmp_path / "rank1.jsonl", 1, 0.0, r1)
    lines = _load().detail(str(tmp_path), group=8)
    assert lines[0].startswith("prefill phase: 0.10 s")
    assert "20 rows x1" in lines[1] and "4 rows x4" in lines[1] and "p50 40.0 ms" in lines[1]
    assert "first stage's end -> rank 1's start 1.00/1.00 ms" in lines[-2]
    assert "head's receipt 2.00/2.00 ms" in lines[-2]
    assert lines[-1] == "head: receipt -> its next submission p50 0.50 ms"
