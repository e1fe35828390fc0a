"""One rank's resident memory over a long ``ggpipe batch`` job: how much it
grows between the moment the output holds ``--warm`` records and the end
(ggpipe/transport/progress.py: the progress thread per run that leaked MPICH's
per-thread state).

    python scripts/experiments/rank_rss_growth.py --rank 1 -o out.jsonl -- \\
        mpiexec -n 2 ggpipe batch many.jsonl -o out.jsonl -m smollm2-135m -n 8 --ignore-eos --parallel 4

The job's rank is found by its launcher's rank variable (``PMI_RANK``,
``OMPI_COMM_WORLD_RANK``, ``PMIX_RANK``: ggpipe.transport.rank_guard) in
the environment of the launcher's descendants (the largest such process);
RSS is sampled once a second. ``-o`` must be the job's output file (its
line count is the progress); an existing one is refused, never overwritten.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import psutil

from ggpipe.transport.rank_guard import RANK_VARS


def _find_rank(launcher: psutil.Process, rank: int) -> psutil.Process | None:
    """The rank's process: of the launcher's descendants whose environment
    names the rank (``ggpipe`` starts the rank as a child of a small
    supervising process, which has the variable too), the largest."""
    found = []
    for c in launcher.children(recursive=True):
        try:
            env = c.environ()
            if str(rank) in (env.get(k) for k in RANK_VARS):
                found.append((c.memory_info().rss, c))
        except (psutil.Error, OSError):
            continue
    return max(found, key=lambda x: x[0])[1] if found else None


def _lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("-o", "--output", required=True, help="the job's output file")
    ap.add_argument("--warm", type=int, default=300, help="records written before the first sample counted")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the job's command after --")
    if os.path.exists(a.output):
        ap.error(f"{a.output} exists: remove it first (this script does not overwrite it)")
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    launcher, proc, samples, t0 = psutil.Process(job.pid), None, [], time.monotonic()
    try:
        while job.poll() is None:
            if proc is None or _lines(a.output) < a.warm:   # until the job runs, the rank may still be starting
                proc = _find_rank(launcher, a.rank)
            else:
                try:
                    samples.append((time.monotonic() - t0, _lines(a.output), proc.memory_info().rss))
                except psutil.Error:
                    pass
            time.sleep(1.0)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 15)
    warm = [s for s in samples if s[1] >= a.warm]
    if job.returncode != 0 or len(warm) < 2:
        sys.exit(f"the job ended with {job.returncode} after {len(samples)} samples ({len(warm)} past --warm)")
    (_, n0, r0), (t1, n1, r1) = warm[0], samples[-1]
    mb = (r1 - r0) / 2**20
    print(f"rank {a.rank}: {n1} records in {t1:.0f} s; RSS {r0 / 2**20:.2f} MB at record {n0}, "
          f"{r1 / 2**20:.2f} MB at the end: {mb:+.2f} MB ({mb / max(1, n1 - n0) * 1000:+.3f} MB per 1000 records)")


if __name__ == "__main__":
    main()
