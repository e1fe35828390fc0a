"""Per-thread CPU of an MPI job's ranks, second by second: where each rank's
core time goes (the stage's computation, the head's loop, helper threads).

    python scripts/thread_cpu.py -- mpiexec -n 2 ggpipe generate -m smollm2-goliath-40l-f32 \\
        -md smollm2-135m --mode pipeinfer -p "Write a short story." -n 256 --ignore-eos -t 1

The command runs with a unique GGPIPE_THREAD_CPU marker in its environment;
every process that carries it and has PMI_RANK / OMPI_COMM_WORLD_RANK set is
sampled each ``--every`` seconds with psutil (``Process.threads()``: user +
system seconds per thread). Printed per rank and thread: CPU share of a core
in each interval, and the mean over the intervals after the first
``--skip`` (model loading). Only the processes this script started are
looked at.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid

import psutil


def _rank(p: psutil.Process, marker: str) -> str | None:
    try:
        env = p.environ()
    except (psutil.Error, OSError):
        return None
    if env.get("GGPIPE_THREAD_CPU") != marker:
        return None
    return env.get("PMI_RANK") or env.get("OMPI_COMM_WORLD_RANK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=float, default=1.0, help="sampling interval (seconds)")
    ap.add_argument("--skip", type=int, default=3, help="intervals left out of the mean (loading)")
    ap.add_argument("--min-share", type=float, default=0.01, help="threads below this mean share are not listed")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="the job, after --")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give the command after --")
    marker = uuid.uuid4().hex
    job = subprocess.Popen(cmd, env={**os.environ, "GGPIPE_THREAD_CPU": marker}, stdout=subprocess.DEVNULL)
    me = psutil.Process(job.pid)
    series: dict[tuple[str, int], list[float]] = {}
    last: dict[tuple[str, int], float] = {}
    while job.poll() is None:
        time.sleep(a.every)
        try:
            procs = [me, *me.children(recursive=True)]
        except psutil.Error:
            break
        for p in procs:
            rank = _rank(p, marker)
            if rank is None:
                continue
            try:
                threads = p.threads()
            except psutil.Error:
                continue
            for t in threads:
                key = (rank, t.id)
                cpu = t.user_time + t.system_time
                if key in last:
                    series.setdefault(key, []).append((cpu - last[key]) / a.every)
                last[key] = cpu
    job.wait()
    print("rank thread  mean share of a core  (per interval)")
    for (rank, tid), xs in sorted(series.items()):
        body = xs[a.skip:] or xs
        mean = sum(body) / len(body)
        if mean >= a.min_share:
            print(f"{rank:>4} {tid:>7}  {mean:5.2f}  ({' '.join(f'{x:.2f}' for x in xs)})")
    sys.exit(job.returncode)


if __name__ == "__main__":
    main()
