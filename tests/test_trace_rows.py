"""scripts/trace_rows.py on a made-up two-rank trace (ggpipe/trace.py's
format): rows per second of the decode span and each stage's busy share,
the figures docs/BENCHMARKS.md §20 quotes."""

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
