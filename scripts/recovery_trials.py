#!/usr/bin/env python3
"""A lost rank is a pause, not an error: trials of ``batch --ranks`` and
``serve --ranks`` (ggpipe/frontends/supervisor.py, ggpipe/frontends/serve/front.py)
with a rank killed at a random moment, a chaos run, and the front end's cost
without a kill. Prints tables (docs/clusters/failures.md) and writes every
trial to ``--out`` (JSON).

    python scripts/recovery_trials.py trials -n 10         # batch and serve, each non-head rank, SIGKILL
    python scripts/recovery_trials.py trials -n 10 --command serve --mode pipeinfer   # -md smollm2-135m
    python scripts/recovery_trials.py chaos --kills 20 --minutes 10
    python scripts/recovery_trials.py overhead --rounds 3  # serve --ranks against mpiexec ... serve, no kill
    sudo "$(command -v python)" scripts/recovery_trials.py trials -n 10 --netns   # across emulated hosts

Each trial of ``trials``: 3 ranks x 1 thread, smollm2-135m, greedy. batch: 16
requests x 64 tokens, ``--parallel 8``, the rank killed (SIGKILL) once
between 1 and 8 s in; serve: ``--parallel 4``, 8 streaming clients x 80
tokens, the rank killed between 0.5 and 3 s in. Counted: requests failed
(no record, or a non-200 answer or an error event), answers identical to an
uninterrupted run of the same command, the pause (from the loss to the new
job serving, and the new job's start-up and load within it; serve: the
longest gap between two pieces of a stream's text), and processes left
running.

``--netns`` runs every command across the emulated hosts of
scripts/netns_cluster.py (three network namespaces linked by TCP; needs
root): started on host 1 as on a head node (``ssh HOST ...``), one rank per
host (``--hostfile``), the server listening on host 1's address.
``GGPIPE_TRIALS_LOG=FILE`` appends each serve trial's messages (the
supervisor's and the job's) to FILE.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ggpipe.child_process import child_env, ggpipe_command  # noqa: E402
from ggpipe.transport.launcher_path import find_launcher  # noqa: E402
from ggpipe.transport.rank_guard import rank_processes  # noqa: E402

PROMPTS = [json.loads(x)["prompt"] for x in (ROOT / "scripts" / "prompts" / "many16.jsonl").read_text().splitlines()]
#: The mode's options (``--mode``), given to every command run.
MODE_ARGS: list[str] = []
#: The emulated cluster the commands run across (scripts/netns_cluster.py ``up --json``), or None: this host.
CLUSTER: dict | None = None
BACK = re.compile(r"ggpipe: back ([\d.]+) s after the loss \(start-up and load ([\d.]+) s\)")


def _job(args: list[str], ranks: int | None) -> list[str]:
    """``ggpipe ARGS`` with ``--ranks`` (supervised), or under ``mpiexec -n``;
    across the emulated hosts (:data:`CLUSTER`), started on host 1 with a
    rank on each host."""
    base = [*ggpipe_command(), *args]
    if CLUSTER is None:
        return base + ["--ranks", str(ranks)] if ranks else ["mpiexec", "-n", "3", *base]
    launch = CLUSTER["launch"]   # [mpiexec, its hostfile option, the hostfile, ...]
    cmd = base + ["--ranks", str(ranks), "--hostfile", launch[2], "--mpiexec", launch[0]] if ranks else \
        [*launch, "-n", "3", *base]
    return [str(Path(CLUSTER["dir"]) / "ssh"), _address(), "exec " + shlex.join(cmd)]   # its pid: the command's


def _address() -> str:
    """Where the head's host is reached: host 1 of the emulated cluster, or this host's loopback."""
    return CLUSTER["hosts"][0]["ip"] if CLUSTER is not None else "127.0.0.1"


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=child_env(dict(os.environ, PYTHONUNBUFFERED="1")), start_new_session=True)


def _left(procs: list[psutil.Process]) -> int:
    time.sleep(0.5)
    return sum(1 for c in procs if c.is_running() and c.status() != psutil.STATUS_ZOMBIE)


def _end(p: subprocess.Popen, procs: list[psutil.Process]) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
    for c in procs:
        try:
            c.kill()
        except psutil.Error:
            pass


def _signal_rank(p: subprocess.Popen, rank: int, sig: int) -> list[psutil.Process]:
    """Send ``sig`` to ``rank``'s stage process (once all 3 exist); returns the job's processes."""
    end = time.monotonic() + 60
    found = rank_processes(p.pid)
    while len(found) < 3 and time.monotonic() < end:
        time.sleep(0.05)
        found = rank_processes(p.pid)
    procs = psutil.Process(p.pid).children(recursive=True)
    found[rank].send_signal(sig)
    return procs


# -- batch -----------------------------------------------------------------------------------------


def _batch_args(inp: Path, out: Path) -> list[str]:
    return ["batch", str(inp), "-o", str(out), "-m", "smollm2-135m", "-n", "64", "--parallel", "8", "-t", "1",
            "--no-progress", "--liveness-timeout", "2", *MODE_ARGS]


def _tokens(path: Path) -> dict:
    return {json.loads(x)["id"]: json.loads(x)["tokens"] for x in path.read_text().splitlines()}


def batch_trial(tmp: Path, rank: int, reference: dict, rng: random.Random) -> dict:
    out = tmp / f"out-{time.monotonic_ns()}.jsonl"
    p = _start(_job(_batch_args(tmp / "in.jsonl", out), 3))
    procs: list[psutil.Process] = []
    try:
        time.sleep(rng.uniform(1.0, 8.0))
        if p.poll() is None:
            procs = _signal_rank(p, rank, signal.SIGKILL)
        _, err = p.communicate(timeout=600)
    finally:
        _end(p, procs)
    got = _tokens(out) if out.exists() else {}
    lines = out.read_text().splitlines() if out.exists() else []
    back = BACK.search(err)
    return {"command": "batch", "rank": rank, "exit": p.returncode, "records": len(lines), "unique": len(got),
            "failed": len(reference) - len(got), "identical": sum(got.get(k) == v for k, v in reference.items()),
            "back_s": float(back.group(1)) if back else None, "load_s": float(back.group(2)) if back else None,
            "left_running": _left(procs), "killed": procs != []}


# -- serve -----------------------------------------------------------------------------------------


def _stream(url: str, prompt: str, max_tokens: int, out: dict, key) -> None:
    """One streaming chat client: its text, whether it failed (and why),
    the longest gap between two pieces of text (``pause_s``: a pause in the
    middle of the stream) and the wait for the first (``first_s``: a slot,
    the prompt; seconds)."""
    text, gaps, start, failed, why = "", [], time.monotonic(), False, None
    t = first = None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=600,
                          json={"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                                "stream": True}) as r:
            failed = r.status_code != 200
            why = f"HTTP {r.status_code}" if failed else None
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    failed, why = True, obj["error"].get("code") or obj["error"].get("message")
                    continue
                piece = obj["choices"][0]["delta"].get("content") if obj["choices"] else None
                if not piece:
                    continue
                text += piece
                now = time.monotonic()
                if t is None:
                    first = now - start
                else:
                    gaps.append(now - t)
                t = now
    except httpx.HTTPError as e:
        failed, why = True, type(e).__name__
    out[key] = {"text": text, "failed": failed, "why": why, "pause_s": max(gaps, default=0.0), "first_s": first}


def _clients(url: str, n: int, max_tokens: int) -> dict:
    got: dict = {}
    threads = [threading.Thread(target=_stream, args=(url, PROMPTS[i % len(PROMPTS)], max_tokens, got, i))
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def _serve(ranks: int | None, parallel: int = 4) -> tuple[subprocess.Popen, str]:
    for _ in range(3):    # a port free here may be taken on the emulated head host meanwhile: another one
        port = _free_port()
        p = _start(_job(["serve", "-m", "smollm2-135m", "--parallel", str(parallel), "-t", "1", "--host",
                         _address(), "--port", str(port), "--liveness-timeout", "2", *MODE_ARGS], ranks))
        url = f"http://{_address()}:{port}"
        end = time.monotonic() + 180
        while time.monotonic() < end and p.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return p, url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        _end(p, [])
        err = p.stderr.read()
        if "Address already in use" not in err:
            break
    raise SystemExit(f"the server did not start:\n{err[-3000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_trial(rank: int, reference: dict, rng: random.Random) -> dict:
    p, url = _serve(3)
    procs: list[psutil.Process] = []
    err = ""
    try:
        got: dict = {}
        clients = threading.Thread(target=lambda: got.update(_clients(url, 8, 80)))
        clients.start()
        time.sleep(rng.uniform(0.5, 3.0))
        procs = _signal_rank(p, rank, signal.SIGKILL)
        clients.join()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        _end(p, procs)
    back = BACK.search(err)
    if os.environ.get("GGPIPE_TRIALS_LOG"):      # the command's messages, trial by trial
        with open(os.environ["GGPIPE_TRIALS_LOG"], "a") as f:
            f.write(f"--- serve, rank {rank} killed\n{err}\n")
    return {"command": "serve", "rank": rank, "exit": p.returncode, "requests": len(got),
            "failed": sum(g["failed"] for g in got.values()),
            "why_failed": [g["why"] for g in got.values() if g["failed"]],
            "identical": sum(got[k]["text"] == reference[k]["text"] for k in got),
            "max_pause_s": max(g["pause_s"] for g in got.values()),
            "max_first_s": max(g["first_s"] or 0.0 for g in got.values()),
            "back_s": float(back.group(1)) if back else None, "load_s": float(back.group(2)) if back else None,
            "left_running": _left(procs), "killed": True}


def serve_reference() -> tuple[dict, int]:
    """Two uninterrupted runs of the serve trial's clients: the first, and
    how many of the second's answers equal it (the default build's batch
    rows make a request's tokens depend on what shares its batches)."""
    p, url = _serve(3)
    try:
        first = _clients(url, 8, 80)
        second = _clients(url, 8, 80)
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=120)
        _end(p, [])
    return first, sum(first[k]["text"] == second[k]["text"] for k in first)


def cmd_trials(a) -> dict:
    rng = random.Random(a.seed)
    results = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "in.jsonl").write_text("".join(json.dumps({"id": i, "prompt": q}) + "\n" for i, q in enumerate(PROMPTS)))
        batch_ref, batch_control, serve_ref, serve_control = {}, 0, {}, 0
        if "batch" in a.command:
            ref_out = tmp / "ref.jsonl"
            subprocess.run(_job(_batch_args(tmp / "in.jsonl", ref_out), None), check=True, cwd=ROOT,
                           env=child_env(), capture_output=True)
            batch_ref = _tokens(ref_out)
            again = tmp / "again.jsonl"
            subprocess.run(_job(_batch_args(tmp / "in.jsonl", again), None), check=True, cwd=ROOT,
                           env=child_env(), capture_output=True)
            batch_control = sum(_tokens(again)[k] == v for k, v in batch_ref.items())
        if "serve" in a.command:
            serve_ref, serve_control = serve_reference()
        for i in range(a.trials):
            for rank in a.rank:
                for cmd in a.command:
                    r = batch_trial(tmp, rank, batch_ref, rng) if cmd == "batch" else \
                        serve_trial(rank, serve_ref, rng)
                    results.append(r)
                    print(json.dumps(r), flush=True)
    table = {}
    for cmd, n_req, control in (("batch", len(batch_ref), batch_control), ("serve", 8, serve_control)):
        if cmd not in a.command:
            continue
        for rank in a.rank:
            rs = [r for r in results if r["command"] == cmd and r["rank"] == rank]
            ok = [r for r in rs if r["exit"] == 0 and r["failed"] == 0 and r["left_running"] == 0]
            over = [r["back_s"] - r["load_s"] for r in rs if r["back_s"] is not None]
            table[f"{cmd} rank {rank}"] = {
                "trials": len(rs), "no request failed, exit 0, nothing left": len(ok),
                "requests": n_req, "identical (median)": statistics.median(r["identical"] for r in rs),
                "identical, two uninterrupted runs": control,
                "back_s (median, max)": (statistics.median(r["back_s"] for r in rs if r["back_s"] is not None),
                                         max(r["back_s"] for r in rs if r["back_s"] is not None)),
                "back minus start-up and load, s (max)": max(over) if over else None}
            if cmd == "serve":
                table[f"{cmd} rank {rank}"]["longest pause inside a stream, s (median, max)"] = (
                    statistics.median(r["max_pause_s"] for r in rs), max(r["max_pause_s"] for r in rs))
                table[f"{cmd} rank {rank}"]["longest pause inside a stream, uninterrupted, s"] = max(
                    g["pause_s"] for g in serve_ref.values())
    return {"trials": results, "table": table}


def cmd_chaos(a) -> dict:
    """serve --ranks 3 under 4 clients that keep sending requests; ``--kills``
    random kills (SIGKILL or SIGSTOP of rank 1 or 2) over ``--minutes``."""
    rng = random.Random(a.seed)
    p, url = _serve(3)
    front = psutil.Process(p.pid)
    stop = threading.Event()
    done: dict = {"ok": 0, "failed": 0, "why_failed": []}

    def client(i: int) -> None:
        while not stop.is_set():
            got: dict = {}
            _stream(url, PROMPTS[rng.randrange(len(PROMPTS))], 48, got, 0)
            done["failed" if got[0]["failed"] else "ok"] += 1
            if got[0]["failed"]:
                done["why_failed"].append(got[0]["why"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    rss = [front.memory_info().rss]
    kills = []
    t_end = time.monotonic() + 60 * a.minutes
    gap = 60 * a.minutes / (a.kills + 1)
    try:
        for _ in range(a.kills):
            time.sleep(rng.uniform(0.5 * gap, 1.5 * gap) if time.monotonic() < t_end else 0)
            sig, rank = rng.choice([signal.SIGKILL, signal.SIGSTOP]), rng.choice([1, 2])
            try:
                _signal_rank(p, rank, sig)
                kills.append((rank, signal.Signals(sig).name))
            except (KeyError, psutil.Error):
                kills.append((rank, "not running (recovering)"))
            rss.append(front.memory_info().rss)
        time.sleep(max(0.0, t_end - time.monotonic()))
    finally:
        stop.set()
        for t in threads:
            t.join(300)
        metrics = httpx.get(url + "/metrics", timeout=30).text
        rss.append(front.memory_info().rss)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
        _end(p, [])
    counters = dict(re.findall(r"^(ggpipe_(?:recoveries|requests_resumed|seconds_without_service)_total) (\S+)$",
                               metrics, re.M))
    return {"kills": kills, "requests": done, "exit": p.returncode, "front_rss_mib": [round(x / 2**20, 1) for x in rss],
            "metrics": counters, "lost_lines": err.count("was lost; starting the job again")}


def cmd_overhead(a) -> dict:
    """8 streaming clients x 128 tokens through ``serve --ranks 3`` and
    ``mpiexec -n 3 ggpipe serve``, ``--rounds`` interleaved rounds: tokens/s."""
    rates = {"front end (--ranks 3)": [], "mpiexec -n 3 (no front end)": []}
    for _ in range(a.rounds):
        for name, ranks in (("front end (--ranks 3)", 3), ("mpiexec -n 3 (no front end)", None)):
            p, url = _serve(ranks, parallel=8)
            try:
                _clients(url, 8, 16)   # warm
                t = time.monotonic()
                got = _clients(url, 8, 128)
                text = httpx.get(url + "/metrics", timeout=30).text
                n = int(float(re.search(r"^ggpipe_generated_tokens_total (\S+)$", text, re.M).group(1)))
                rates[name].append((n - 8 * 16, time.monotonic() - t, sum(g["failed"] for g in got.values())))
            finally:
                p.send_signal(signal.SIGTERM)
                p.communicate(timeout=120)
                _end(p, [])
    out = {k: {"tokens/s": [round(n / s, 1) for n, s, _ in v], "median": round(statistics.median(n / s for n, s, _ in v), 1)}
           for k, v in rates.items()}
    names = list(out)
    out["ratio"] = round(out[names[0]]["median"] / out[names[1]]["median"], 3)
    return out


@contextlib.contextmanager
def _cluster():
    """Three emulated hosts (:data:`CLUSTER`) for the commands; removed after."""
    global CLUSTER
    net = ROOT / "scripts" / "netns_cluster.py"
    name, d = f"gr{os.getpid() % 100000}", tempfile.mkdtemp(prefix="ggrt-")
    p = subprocess.run([sys.executable, str(net), "up", "--name", name, "-n", "3", "--subnet",
                        f"10.233.{os.getpid() % 250}.0/24", "--dir", d, "--json", "--mpiexec", find_launcher()],
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise SystemExit(p.stderr.strip())
    CLUSTER = json.loads(p.stdout)
    try:
        yield
    finally:
        CLUSTER = None
        subprocess.run([sys.executable, str(net), "down", "--name", name, "--dir", d], capture_output=True, timeout=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("trials")
    t.add_argument("-n", "--trials", type=int, default=10)
    t.add_argument("--rank", type=int, action="append", help="rank to kill (default 1 and 2)")
    t.add_argument("--command", action="append", choices=["batch", "serve"], help="default both")
    c = sub.add_parser("chaos")
    c.add_argument("--kills", type=int, default=20)
    c.add_argument("--minutes", type=float, default=10)
    o = sub.add_parser("overhead")
    o.add_argument("--rounds", type=int, default=3)
    for s in (t, c, o):
        s.add_argument("--mode", choices=["iterative", "pipeinfer"], default="iterative",
                       help="pipeinfer: --mode pipeinfer -md smollm2-135m")
        s.add_argument("--seed", type=int, default=1)
        s.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
        s.add_argument("--netns", action="store_true",
                       help="across the emulated hosts of scripts/netns_cluster.py (needs root)")
    a = ap.parse_args()
    if a.what == "trials":
        a.rank = a.rank or [1, 2]
        a.command = a.command or ["batch", "serve"]
    if a.mode == "pipeinfer":
        MODE_ARGS.extend(["--mode", "pipeinfer", "-md", "smollm2-135m"])
    run = {"trials": cmd_trials, "chaos": cmd_chaos, "overhead": cmd_overhead}[a.what]
    with _cluster() if a.netns else contextlib.nullcontext():
        result = run(a)
    shown = result.get("table", result)
    print(json.dumps(shown, indent=1))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
