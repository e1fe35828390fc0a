"""scripts/fault_injection.py without running it: its --help, the --scenarios
parser and the markdown table. The fault run itself (an emulated cluster, a
few minutes) is not part of the suite: docs/clusters/emulated-cluster.md gives its command
and docs/benchmarks/data/faults.json its last result.

Marked like tests/test_netns_cluster.py: the full tier, skipped without root
or network namespaces (the script's own domain).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "fault_injection.py"

pytestmark = [
    pytest.mark.full,
    pytest.mark.skipif(os.name != "posix" or not Path("/proc/self/ns/net").exists() or os.geteuid() != 0,
                       reason="fault injection needs root and network namespaces"),
]


@pytest.fixture(scope="module")
def fi():
    spec = importlib.util.spec_from_file_location("fault_injection", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def test_help():
    p = subprocess.run([sys.executable, str(SCRIPT), "--help"], check=False, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for word in ("--scenarios", "--model", "--out", "link20", "kill-head"):
        assert word in p.stdout


def test_scenarios_parser(fi):
    assert fi.parse_scenarios("all") == list(fi.SCENARIOS)
    assert fi.parse_scenarios("stop5, link2,stop5,") == ["stop5", "link2"]
    assert set(fi.SCENARIO_ARGS) == set(fi.SCENARIOS)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown scenario 'nope'"):
        fi.parse_scenarios("link2,nope")
    with pytest.raises(argparse.ArgumentTypeError):
        fi.parse_scenarios(",")
    p = subprocess.run([sys.executable, str(SCRIPT), "--scenarios", "bogus"], check=False, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "unknown scenario 'bogus'" in p.stderr


def test_markdown_table(fi):
    recs = [{"scenario": "ref-generate", "exit": 0},
            {"scenario": "stop5", "fault": "SIGSTOP 5 s", "expected": "survives | identical", "exit": 0,
             "error_lines": [], "fault_to_error_s": None, "fault_to_end_s": 4.25, "output_identical": True,
             "output_bytes": 10, "output_prefix_of_reference": True, "stall_s": 5.1, "left_running": [],
             "as_documented": True},
            {"scenario": "stop10", "fault": "SIGSTOP 10 s", "expected": "stopped answering", "exit": 1,
             "error_lines": ["ggpipe: error: rank 1 (h2, pid 7) stopped answering"], "fault_to_error_s": 6.04,
             "fault_to_end_s": 6.5, "output_identical": False, "output_bytes": 10,
             "output_prefix_of_reference": True, "left_running": [], "as_documented": False},
            {"scenario": "link2", "fault": "down", "expected": "x", "exit": None, "error_lines": [],
             "fault_to_end_s": None, "outcome": "not run: no ranks", "as_documented": False}]
    rows = fi.markdown_table(recs).splitlines()
    assert len(rows) == 2 + 3  # header, rule, one row per scenario (not the reference runs)
    assert all(r.count("|") - r.count("\\|") == 10 for r in rows)  # nine cells; a '|' in a cell is escaped
    assert "| 6.0 | 6.5 |" in rows[3] and rows[3].endswith("**no** |")
    assert "rank 1 (h2, pid 7) stopped answering" in rows[3] and "ggpipe: error:" not in rows[3]
    assert "not run: no ranks" in rows[4]
