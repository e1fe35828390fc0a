#!/usr/bin/env python3
"""Fault injection on the emulated multi-host cluster (scripts/netns_cluster.py):
a link taken down, a rank stopped, a rank killed, and whether each ends the way
docs/ERRORS.md ("Ranks that fail") says.

    sudo "$(command -v python)" scripts/fault_injection.py                  # every scenario, ~3-5 min
    sudo "$(command -v python)" scripts/fault_injection.py --scenarios link2,stop5
    sudo "$(command -v python)" scripts/fault_injection.py --out docs/results/faults-20261126.json

It brings up a cluster of three hosts of its own (``--name``, default
``ggfault``, on ``--subnet``), runs one rank per host, and always takes the
cluster down again at the end (also on an error or Ctrl-C); it touches only
the namespaces, veths and bridge it made, and signals only the processes of
the jobs it started (found by pid under its own launcher: the children of
``ggpipe-guard`` processes carrying ``PMI_RANK``; never by name).

Scenarios (``--scenarios``, comma-separated; default all):

  link2       host 2's link (the root end of its veth: the middle rank's host)
              down for 2 s during ``ggpipe generate -n 200 --ignore-eos``, then up
  link4       the same for 4 s (below --liveness-timeout, above TCP's back-off step: see its record)
  link20      the same for 20 s
  stop5       rank 1 (host 2) SIGSTOPped for 5 s during generate, then SIGCONT
  stop10      the same for 10 s
  kill-head   SIGKILL of rank 0 (the head) during ``ggpipe batch`` of 12 prompts
              (-n 32 each, greedy, --parallel 4) once some records are written;
              then the same batch command again: it must resume
  kill-middle the same with rank 1 killed

Reference runs without faults (one generate, one batch on the cluster) are made
first, as the scenarios need them. Each scenario is bounded (``--job-timeout``).
For each it records what was done, the exit code, the ``ggpipe: error`` lines
on stderr, seconds from the fault to the first error line and to the job's end,
the longest stall of the output stream, whether the output equals the reference
and whether the outcome is what docs/ERRORS.md says. Writes a JSON file
(``--out``, default results/faults-YYYYMMDD.json) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ggpipe.child_process import ggpipe_command

ROOT = Path(__file__).resolve().parents[1]
NETNS = ROOT / "scripts" / "netns_cluster.py"
HOSTS = 3
LIVENESS_S = 6.0             # ggpipe's --liveness-timeout default (ggpipe/cli/options.py)
TIMEOUT_S = 60.0             # ggpipe's --timeout default

# name -> (kind, what is done, what docs/ERRORS.md says should happen)
SCENARIOS: dict[str, tuple[str, str, str]] = {
    "link2": ("link", "host 2's veth down 2 s during generate, then up",
              ("no row for a link outage; by --liveness-timeout (6 s of heartbeat silence) and --timeout (60 s): "
               "survives, output identical (TCP retransmits); else a named error")),
    "link4": ("link", "host 2's veth down 4 s during generate, then up",
              ("as link2 (4 s < 6 s), but TCP's retransmission back-off (0.2, 0.4, 0.8, 1.6, 3.2 s) may stretch "
               "the heartbeat silence past 6 s: survives, or a named `stopped answering`")),
    "link20": ("link", "host 2's veth down 20 s during generate, then up",
               "`... stopped answering ...` naming rank 1 (or the head, from rank 1) after --liveness-timeout (6 s)"),
    "stop5": ("stop", "rank 1 (host 2) SIGSTOP 5 s during generate, then SIGCONT",
              "survives (5 s < --liveness-timeout 6 s): output identical"),
    "stop10": ("stop", "rank 1 (host 2) SIGSTOP 10 s during generate, then SIGCONT",
               "`... stopped answering ...` (another host) naming rank 1 after --liveness-timeout (6 s)"),
    "kill-head": ("kill", "SIGKILL of rank 0 (head, host 1) during batch; the batch command rerun",
                  ("guard: `the head, rank 0 (h1, pid N, ...) died (killed by SIGKILL) while ...` within 10 s, "
                   "nothing left running; the rerun resumes: every id once, identical")),
    "kill-middle": ("kill", "SIGKILL of rank 1 (host 2) during batch; the batch command rerun",
                    ("guard: `rank 1 (h2, pid N, ...) died (killed by SIGKILL) while ...` within 10 s, "
                     "nothing left running; the rerun resumes: every id once, identical")),
}
SCENARIO_ARGS = {"link2": 2.0, "link4": 4.0, "link20": 20.0, "stop5": 5.0, "stop10": 10.0,
                 "kill-head": 0, "kill-middle": 1}

BATCH_PROMPTS = [
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Once upon a time, a warrior named Goliath",
    "Explain how a household refrigerator keeps food cold.",
    "List three uses of a paperclip.",
    "What is MPI, in one sentence?",
    "Translate 'good morning' into French and Spanish.",
    "The three primary colours are",
    "Give a short tip for learning to play the guitar.",
    "Why is the sky blue?",
    "Describe a rainy afternoon in a small town.",
    "Name the planets of the solar system in order.",
]


class FaultError(Exception):
    pass


def parse_scenarios(text: str) -> list[str]:
    """``--scenarios``: "all" or names from :data:`SCENARIOS`, comma-separated,
    in the order given (duplicates dropped)."""
    if text.strip() in ("", "all"):
        return list(SCENARIOS)
    out: list[str] = []
    for name in (s.strip() for s in text.split(",")):
        if not name:
            continue
        if name not in SCENARIOS:
            raise argparse.ArgumentTypeError(f"unknown scenario {name!r} (known: {', '.join(SCENARIOS)})")
        if name not in out:
            out.append(name)
    if not out:
        raise argparse.ArgumentTypeError("no scenario named")
    return out


# -- the cluster ---------------------------------------------------------------------------------------------

def netns(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(NETNS), *args], check=False, capture_output=True, text=True, timeout=120)


def sh(*cmd: str) -> None:
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise FaultError(f"{' '.join(cmd)}: {(p.stderr or p.stdout).strip()}")


def namespace_pids(cluster: dict) -> list[tuple[str, int]]:
    out = []
    for h in cluster["hosts"]:
        p = subprocess.run(["ip", "netns", "pids", h["namespace"]], check=False, capture_output=True, text=True, timeout=30)
        out += [(h["namespace"], int(x)) for x in p.stdout.split() if not _is_report_claim(int(x))]
    return out


def _is_report_claim(pid: int) -> bool:
    """The short sleep (1.5 s) that holds a job's host-wide report claim by
    design (ggpipe/transport/rank_guard.py, CLAIM_NAME): not a process left behind."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0] == b"ggpipe-report-claim"
    except OSError:
        return False


def wait_namespaces_empty(cluster: dict, timeout: float = 5.0) -> list[tuple[str, int]]:
    deadline = time.monotonic() + timeout
    left = namespace_pids(cluster)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = namespace_pids(cluster)
    return left


def kill_left(left: list[tuple[str, int]]) -> None:
    """SIGKILL processes still in this script's own namespaces (what its own launcher started there)."""
    for _, pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# -- a job ---------------------------------------------------------------------------------------------------

@dataclass
class Job:
    """A job under the cluster's launcher; its stdout (timestamped chunks) and
    stderr (timestamped lines) are read on threads."""

    cmd: list[str]
    proc: subprocess.Popen = None
    t_start: float = 0.0
    out_chunks: list[tuple[float, bytes]] = field(default_factory=list)
    err_lines: list[tuple[float, str]] = field(default_factory=list)
    t_end: float | None = None

    def start(self) -> Job:
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        self._threads = [threading.Thread(target=self._read_out, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for t in self._threads:
            t.start()
        threading.Thread(target=self._reap, daemon=True).start()
        return self

    def _reap(self) -> None:
        """The launcher's end time, taken when it ends (not when someone waits for it)."""
        self.proc.wait()
        self.t_end = time.monotonic()

    def _read_out(self) -> None:
        fd = self.proc.stdout.fileno()
        while True:
            b = os.read(fd, 65536)
            if not b:
                return
            self.out_chunks.append((time.monotonic(), b))

    def _read_err(self) -> None:
        for raw in self.proc.stderr:
            self.err_lines.append((time.monotonic(), raw.decode("utf-8", "replace").rstrip("\n")))

    @property
    def stdout(self) -> str:
        return b"".join(c for _, c in self.out_chunks).decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return "\n".join(ln for _, ln in self.err_lines)

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int | None:
        """Exit code, or None when it ran past ``timeout`` (then it is killed)."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = None
        deadline = time.monotonic() + 5
        while self.t_end is None and time.monotonic() < deadline:  # the reaper's time
            time.sleep(0.01)
        if self.t_end is None:
            self.t_end = time.monotonic()
        for t in self._threads:
            t.join(10)
        return rc

    def kill(self) -> None:
        """The launcher's process group (this job's own: start_new_session), then the ranks under it."""
        ranks = rank_processes(self.proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for p in ranks.values():
            with contextlib.suppress(Exception):
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def error_lines(self) -> list[tuple[float, str]]:
        return [(t, ln) for t, ln in self.err_lines if "ggpipe: error" in ln]

    def other_stderr(self, limit: int = 6) -> list[str]:
        """Non-ggpipe stderr lines (the launcher's banner), the first few."""
        return [ln for _, ln in self.err_lines if ln.strip() and "ggpipe: error" not in ln][:limit]

    def wait_output(self, nbytes: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.running():
            if sum(len(c) for _, c in self.out_chunks) >= nbytes:
                return True
            time.sleep(0.01)
        return sum(len(c) for _, c in self.out_chunks) >= nbytes


def rank_processes(root_pid: int) -> dict:
    """Rank -> its stage process under the launcher ``root_pid``
    (ggpipe.transport.rank_guard.rank_processes)."""
    from ggpipe.transport.rank_guard import rank_processes as find

    return find(root_pid)


def wait_for_ranks(job: Job, n: int, timeout: float = 90) -> dict:
    end = time.monotonic() + timeout
    found = rank_processes(job.proc.pid)
    while len(found) < n and time.monotonic() < end and job.running():
        time.sleep(0.05)
        found = rank_processes(job.proc.pid)
    return found


def stalls(chunks: list[tuple[float, bytes]], since: float) -> float:
    """Longest gap between stdout chunks from ``since`` on (seconds)."""
    ts = [since] + [t for t, _ in chunks if t >= since]
    return max((b - a for a, b in itertools.pairwise(ts)), default=0.0)


# -- the runner ----------------------------------------------------------------------------------------------

class Runner:
    def __init__(self, cluster: dict, args, work: Path):
        self.cluster = cluster
        self.a = args
        self.work = work
        self.ref_text: str | None = None
        self.ref_batch: dict | None = None
        self.prompts = work / "prompts.jsonl"
        self.prompts.write_text("".join(json.dumps({"id": f"p{k:02d}", "prompt": p}) + "\n"
                                        for k, p in enumerate(BATCH_PROMPTS)))

    def launch(self, args: list[str]) -> list[str]:
        return [*self.cluster["launch"], "-n", str(HOSTS), *ggpipe_command(), *args]

    def gen_args(self) -> list[str]:
        return ["generate", "-m", self.a.model, "-p", self.a.prompt, "-n", str(self.a.n_gen), "--ignore-eos"]

    def batch_args(self, out: Path) -> list[str]:
        return ["batch", str(self.prompts), "-o", str(out), "-m", self.a.model, "-n", "32", "--ignore-eos",
                "--temp", "0", "--parallel", str(self.a.batch_parallel), "--no-progress"]

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    # references ---------------------------------------------------------------------------------------------

    def reference_generate(self) -> dict:
        job = Job(self.launch(self.gen_args())).start()
        rc = job.wait(self.a.job_timeout)
        if rc != 0:
            raise FaultError(f"the reference generate failed ({rc}): {job.stderr[-2000:]}")
        self.ref_text = job.stdout
        first = job.out_chunks[0][0] if job.out_chunks else job.t_start
        return {"scenario": "ref-generate", "command": self.launch(self.gen_args()), "exit": rc,
                "seconds": round(job.t_end - job.t_start, 2), "generate_s": round(job.t_end - first, 2),
                "stdout_bytes": len(self.ref_text)}

    def reference_batch(self) -> dict:
        out = self.work / "ref.jsonl"
        job = Job(self.launch(self.batch_args(out))).start()
        rc = job.wait(self.a.job_timeout)
        if rc != 0:
            raise FaultError(f"the reference batch failed ({rc}): {job.stderr[-2000:]}")
        self.ref_batch = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
        return {"scenario": "ref-batch", "command": self.launch(self.batch_args(out)), "exit": rc,
                "seconds": round(job.t_end - job.t_start, 2), "records": len(self.ref_batch)}

    # generate under a fault -----------------------------------------------------------------------------------

    def generate_fault(self, name: str) -> dict:
        kind, what, expected = SCENARIOS[name]
        hold = SCENARIO_ARGS[name]
        rec: dict = {"scenario": name, "fault": what, "expected": expected, "hold_s": hold}
        cmd = self.launch(self.gen_args())
        rec["command"] = cmd
        job = Job(cmd).start()
        veth = self.cluster["hosts"][1]["veth"]
        victim = None
        try:
            ranks = wait_for_ranks(job, HOSTS)
            if sorted(ranks) != list(range(HOSTS)):
                raise FaultError(f"ranks not found under the launcher: {sorted(ranks)}; {job.stderr[-1500:]}")
            victim = ranks[1]
            rec["victim"] = {"rank": 1, "pid": victim.pid, "host": self.cluster["hosts"][1]["namespace"]}
            if not job.wait_output(1, self.a.job_timeout):
                raise FaultError(f"no output before the fault: {job.stderr[-1500:]}")
            time.sleep(self.a.fault_after)
            rec["output_bytes_before_fault"] = len(job.stdout)
            if not job.running():
                raise FaultError("the job ended before the fault (raise --n-gen or lower --fault-after)")
            t_fault = time.monotonic()
            if kind == "link":
                sh("ip", "link", "set", veth, "down")
            else:
                victim.send_signal(signal.SIGSTOP)
            self.log(f"{name}: fault at {t_fault - job.t_start:.1f} s into the job")
            # hold the fault its whole time, also when the job ends meanwhile (then: what is left on the hosts
            # while the fault still holds, e.g. a stopped rank or one cut off from its launcher)
            end_hold = t_fault + hold
            while time.monotonic() < end_hold:
                if not job.running() and "ended_during_fault_at_s" not in rec:
                    rec["ended_during_fault_at_s"] = round(time.monotonic() - t_fault, 2)
                time.sleep(0.05)
            if "ended_during_fault_at_s" in rec:
                rec["left_running_while_fault_held"] = [f"{ns}:{pid}" for ns, pid in namespace_pids(self.cluster)]
            t_clear = time.monotonic()
        except BaseException:
            job.kill()
            raise
        finally:
            if kind == "link":
                with contextlib.suppress(Exception):
                    sh("ip", "link", "set", veth, "up")
                    # neighbour entries that failed during the outage would answer the next job's
                    # connections with "No route to host" for a while: forget them on both ends
                    sh("ip", "-n", self.cluster["hosts"][1]["namespace"], "neigh", "flush", "all")
                    sh("ip", "neigh", "flush", "dev", self.cluster["bridge"])
            elif victim is not None:
                with contextlib.suppress(Exception):
                    victim.send_signal(signal.SIGCONT)
        rec["ended_during_fault"] = not job.running()
        rc = job.wait(self.a.job_timeout)
        self.finish_record(rec, job, rc, t_fault)
        rec["fault_cleared_after_s"] = round(t_clear - t_fault, 2)
        rec["stall_s"] = round(stalls(job.out_chunks, t_fault), 2)
        after = [t for t, _ in job.out_chunks if t > t_clear]
        rec["clear_to_next_output_s"] = round(after[0] - t_clear, 2) if after else None
        rec["output_identical"] = job.stdout == self.ref_text
        rec["output_prefix_of_reference"] = self.ref_text.startswith(job.stdout)
        rec["output_bytes"] = len(job.stdout)
        rec["outcome"] = "completed" if rc == 0 else ("timed out" if rc is None else "named error" if
                                                       rec["error_lines"] else "ended without a ggpipe line")
        rec["as_documented"] = self.judge(name, rec)
        return rec

    # batch with a rank killed --------------------------------------------------------------------------------

    def batch_kill(self, name: str) -> dict:
        _, what, expected = SCENARIOS[name]
        rank = SCENARIO_ARGS[name]
        rec: dict = {"scenario": name, "fault": what, "expected": expected}
        out = self.work / f"{name}.jsonl"
        out.unlink(missing_ok=True)
        cmd = self.launch(self.batch_args(out))
        rec["command"] = cmd
        job = Job(cmd).start()
        try:
            return self._batch_kill(rec, job, out, rank)
        except BaseException:
            job.kill()
            raise

    def _batch_kill(self, rec: dict, job: Job, out: Path, rank: int) -> dict:
        name, cmd = rec["scenario"], job.cmd
        ranks = wait_for_ranks(job, HOSTS)
        if sorted(ranks) != list(range(HOSTS)):
            raise FaultError(f"ranks not found under the launcher: {sorted(ranks)}; {job.stderr[-1500:]}")
        victim = ranks[rank]
        rec["victim"] = {"rank": rank, "pid": victim.pid, "host": self.cluster["hosts"][rank]["namespace"]}

        def written() -> int:
            try:
                return sum(1 for ln in out.read_text().splitlines() if ln.strip())
            except FileNotFoundError:
                return 0

        deadline = time.monotonic() + self.a.job_timeout
        while written() < self.a.kill_after_records and job.running() and time.monotonic() < deadline:
            time.sleep(0.02)
        rec["records_before_kill"] = written()
        rec["killed_while_running"] = job.running()
        t_fault = time.monotonic()
        with contextlib.suppress(Exception):
            victim.send_signal(signal.SIGKILL)
        self.log(f"{name}: SIGKILL of rank {rank} (pid {victim.pid}) after {rec['records_before_kill']} records")
        rc = job.wait(self.a.job_timeout)
        self.finish_record(rec, job, rc, t_fault)
        rec["records_after_kill"] = written()
        # the same command again: it must resume
        rerun = Job(cmd).start()
        rrc = rerun.wait(self.a.job_timeout)
        rec["rerun_exit"] = rrc
        rec["rerun_s"] = round(rerun.t_end - rerun.t_start, 2)
        rec["rerun_error_lines"] = [ln for _, ln in rerun.error_lines()]
        rec["rerun_left_running"] = wait_namespaces_empty(self.cluster)
        kill_left(rec["rerun_left_running"])
        recs = [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()]
        ids = [r["id"] for r in recs]
        rec["final_records"] = len(recs)
        rec["ids_exactly_once"] = sorted(ids) == sorted(self.ref_batch) and len(set(ids)) == len(ids)
        by_id = {r["id"]: r for r in recs}
        diff = [i for i in self.ref_batch if i in by_id and
                (by_id[i]["tokens"] != self.ref_batch[i]["tokens"] or by_id[i]["text"] != self.ref_batch[i]["text"])]
        rec["differing_ids"] = diff
        rec["output_identical"] = rec["ids_exactly_once"] and not diff
        rec["outcome"] = ("named error" if rc not in (0, None) and rec["error_lines"] else
                          "completed before the kill" if rc == 0 else "timed out" if rc is None else
                          "ended without a ggpipe line")
        rec["outcome"] += "; rerun " + ("resumed" if rrc == 0 else f"exit {rrc}")
        rec["as_documented"] = self.judge(name, rec)
        return rec

    # common ----------------------------------------------------------------------------------------------------

    def finish_record(self, rec: dict, job: Job, rc: int | None, t_fault: float) -> None:
        rec["exit"] = rc
        errs = job.error_lines()
        rec["error_lines"] = [ln for _, ln in errs]
        rec["fault_to_error_s"] = round(errs[0][0] - t_fault, 2) if errs else None
        rec["fault_to_end_s"] = round(job.t_end - t_fault, 2)
        rec["job_s"] = round(job.t_end - job.t_start, 2)
        rec["launcher_lines"] = job.other_stderr()
        left = wait_namespaces_empty(self.cluster)
        rec["left_running"] = [f"{ns}:{pid}" for ns, pid in left]
        kill_left(left)

    def judge(self, name: str, rec: dict) -> bool:
        """Whether the outcome is what docs/ERRORS.md (and the --liveness-timeout / --timeout docs) say."""
        errs = rec["error_lines"]
        host2 = self.cluster["hosts"][1]["namespace"]
        # nothing left on any host, neither once the job ended nor while the fault still held (a rank cut off
        # from its launcher that outlives the job until the link returns counts as left running)
        nothing_left = not rec["left_running"] and not rec.get("left_running_while_fault_held")
        if name in ("link2", "link4", "stop5"):
            # survives with identical output; for link2 a named error is also acceptable (either outcome passes)
            ok = rec["exit"] == 0 and rec["output_identical"] and not errs
            if name in ("link2", "link4") and not ok:
                ok = rec["exit"] not in (0, None) and bool(errs) and nothing_left
            return ok
        if name in ("link20", "stop10"):
            host1 = self.cluster["hosts"][0]["namespace"]
            # the head names rank 1; or rank 1, cut off too, names the head first (a race: both go silent)
            named = any(re.search(rf"rank 1 \({re.escape(host2)}[^)]*\) (stopped answering|is stopped)", e) or
                        (name == "link20" and
                         re.search(rf"rank 1: the head, rank 0 \({re.escape(host1)}[^)]*\) stopped answering", e))
                        for e in errs)
            t = rec["fault_to_error_s"]
            return (rec["exit"] not in (0, None) and named and t is not None
                    and LIVENESS_S - 1 <= t <= LIVENESS_S + 4 and nothing_left)
        if name in ("kill-head", "kill-middle"):
            r = rec["victim"]["rank"]
            who = "the head, rank 0" if r == 0 else f"rank {r}"
            pat = rf"ggpipe: error: {who} \({re.escape(rec['victim']['host'])}, pid {rec['victim']['pid']}" \
                  rf"(, [^)]*)?\) died \(killed by SIGKILL\) while "
            named = any(re.search(pat, e) for e in errs)
            t = rec["fault_to_error_s"]
            return (rec["killed_while_running"] and rec["exit"] not in (0, None) and named and t is not None
                    and t < 10 and nothing_left and rec["rerun_exit"] == 0 and rec["output_identical"]
                    and not rec["rerun_left_running"])
        raise KeyError(name)


# -- the table -------------------------------------------------------------------------------------------------

def _cell(s: str, width: int = 200) -> str:
    s = s.replace("|", "\\|").replace("\n", " ")
    return s if len(s) <= width else s[: width - 1] + "…"


def markdown_table(records: list[dict]) -> str:
    rows = [("| scenario | fault | expected (docs/ERRORS.md) | exit | ggpipe error line | fault → error line (s) "
             "| fault → job end (s) | output | as documented |"),
            "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["scenario"].startswith("ref-"):
            continue
        err = r["error_lines"][0] if r.get("error_lines") else "—"
        fend = "—" if r.get("fault_to_end_s") is None else f"{r['fault_to_end_s']:.1f}"
        err = re.sub(r"^ggpipe: error: ", "", err)
        fe = "—" if r.get("fault_to_error_s") is None else f"{r['fault_to_error_s']:.1f}"
        if "rerun_exit" in r:
            out = (f"{r['records_before_kill']}/{len(BATCH_PROMPTS)} records before the kill; rerun exit "
                   f"{r['rerun_exit']}, {r['final_records']} records, ids once: {yes(r['ids_exactly_once'])}, "
                   f"identical: {yes(r['output_identical'])}")
        elif "output_identical" in r:
            out = ("identical to the fault-free run" if r["output_identical"] else
                   f"{r['output_bytes']} B, a prefix of the reference: {yes(r['output_prefix_of_reference'])}")
            if r.get("stall_s") is not None and r["exit"] == 0:
                out += f"; longest stall {r['stall_s']:.1f} s"
        else:
            out = r.get("outcome", "")
        if r.get("left_running"):
            out += f"; LEFT RUNNING: {', '.join(r['left_running'])}"
        if r.get("left_running_while_fault_held"):
            out += f"; left on the hosts while the fault held: {', '.join(r['left_running_while_fault_held'])}"
        rows.append(f"| {r['scenario']} | {_cell(r['fault'])} | {_cell(r['expected'])} | {r['exit']} | "
                    f"{_cell(err, 260)} | {fe} | {fend} | {_cell(out, 260)} | "
                    f"{'yes' if r['as_documented'] else '**no**'} |")
    return "\n".join(rows)


def yes(b: bool) -> str:
    return "yes" if b else "no"


# -- main ------------------------------------------------------------------------------------------------------

def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", type=parse_scenarios, default=list(SCENARIOS),
                    help=f"comma-separated subset of: {', '.join(SCENARIOS)} (default: all)")
    ap.add_argument("--model", default="smollm2-135m", help="model name or GGUF path (default smollm2-135m)")
    ap.add_argument("--out", default=None, help="JSON results (default results/faults-YYYYMMDD.json)")
    ap.add_argument("--name", default="ggfault", help="the cluster's name (namespaces NAME-h1..3)")
    ap.add_argument("--subnet", default="10.233.7.0/24", help="the cluster's subnet")
    ap.add_argument("--n-gen", type=int, default=200, help="tokens of the generate scenarios (default 200)")
    ap.add_argument("--prompt", default="Tell me a long story about a lighthouse keeper.")
    ap.add_argument("--fault-after", type=float, default=0.5,
                    help="seconds after the first generated output before the fault (default 0.5)")
    ap.add_argument("--kill-after-records", type=int, default=4,
                    help="batch records written before the kill (default 4)")
    ap.add_argument("--batch-parallel", type=int, default=4, help="batch --parallel (default 4)")
    ap.add_argument("--job-timeout", type=float, default=120.0, help="bound of each job (s, default 120)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (prompts, batch outputs)")
    a = ap.parse_args(argv)

    if os.geteuid() != 0:
        print("fault_injection: error: needs root (network namespaces, veth, signals to the ranks)", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else ROOT / "results" / f"faults-{_dt.date.today():%Y%m%d}.json"
    signal.signal(signal.SIGTERM, _raise_interrupt)
    from ggpipe.transport.launcher_path import find_launcher

    mpiexec = find_launcher("mpiexec")
    work = Path(tempfile.mkdtemp(prefix="ggfault-"))
    cluster = None
    records: list[dict] = []
    t0 = time.monotonic()
    try:
        p = netns("up", "--name", a.name, "-n", str(HOSTS), "--subnet", a.subnet, "--json", "--mpiexec", mpiexec)
        if p.returncode != 0:
            print(f"fault_injection: error: the emulated cluster could not be built: {p.stderr.strip()}",
                  file=sys.stderr)
            return 2
        cluster = json.loads(p.stdout)
        r = Runner(cluster, a, work)
        if any(SCENARIOS[s][0] in ("link", "stop") for s in a.scenarios):
            r.log("reference generate (no fault)")
            records.append(r.reference_generate())
        if any(SCENARIOS[s][0] == "kill" for s in a.scenarios):
            r.log("reference batch (no fault)")
            records.append(r.reference_batch())
        for s in a.scenarios:
            r.log(f"scenario {s}: {SCENARIOS[s][1]}")
            try:
                rec = r.batch_kill(s) if SCENARIOS[s][0] == "kill" else r.generate_fault(s)
            except FaultError as e:  # this scenario could not be run as meant: say so, go on with the next
                rec = {"scenario": s, "fault": SCENARIOS[s][1], "expected": SCENARIOS[s][2], "exit": None,
                       "error_lines": [], "fault_to_end_s": None, "outcome": f"not run: {e}",
                       "as_documented": False}
                kill_left(wait_namespaces_empty(cluster))
            records.append(rec)
            r.log(f"  -> exit {rec['exit']}, {rec['outcome']}, as documented: {rec['as_documented']}")
            for ln in rec["error_lines"][:2]:
                r.log(f"     {ln}")
    except KeyboardInterrupt:
        print("fault_injection: interrupted; taking the cluster down", file=sys.stderr)
        return 130
    finally:
        if cluster is not None:
            with contextlib.suppress(Exception):
                left = namespace_pids(cluster)
                kill_left(left)
            d = netns("down", "--name", a.name)
            if d.returncode != 0:
                print(f"fault_injection: warning: down: {d.stderr.strip()}", file=sys.stderr)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        if records:
            import platform

            from ggpipe.cluster.plan import detect_flavor

            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({
                "date": _dt.datetime.now().isoformat(timespec="seconds"),
                "command": [os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "scripts/fault_injection.py",
                            *(argv if argv is not None else sys.argv[1:])],
                "host": platform.node(), "cpus": os.cpu_count(), "mpi": detect_flavor(mpiexec),
                "model": a.model, "hosts": HOSTS, "liveness_timeout_s": LIVENESS_S, "timeout_s": TIMEOUT_S,
                "wall_s": round(time.monotonic() - t0, 1), "records": records}, indent=1) + "\n")
            print(f"results: {out}", file=sys.stderr)
    print(markdown_table(records))
    return 0 if all(r.get("as_documented", True) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
