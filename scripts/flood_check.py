"""A connection flood against a real ``ggpipe serve``: clients open thousands
of connections that send unfinished headers (``GET /health HTTP/1.1``,
``Host``, never the blank line) and hold them (``--reopen``: a new one for
each the server closes, a SYN flood on top), while
a normal client asks ``/health`` and a short completion in turn. Reported:
the slowest and the median answer of each, how long the server kept an
unfinished connection open (its ``--read-timeout`` bounds it), connections
opened in all, and the lines the server wrote to stderr.

    python scripts/flood_check.py --connections 20000 --seconds 40
    python scripts/flood_check.py --connections 20000 --seconds 60 --reopen
    python scripts/flood_check.py -m smollm2-135m --ranks 2 --clients 2 --read-timeout 10

Loopback only. Each flooding client is a process of its own holding
``connections / clients`` sockets (its open-file limit must allow them; the
server's default ``--max-connections`` is its own limit less an eighth). Everything
this script starts ends with it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import re
import resource
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ggpipe.child_process import child_env, ggpipe_command  # noqa: E402

UNFINISHED = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def flood(port: int, n: int, seconds: float, reopen: bool, out: mp.Queue) -> None:
    """Open ``n`` unfinished connections and hold them for ``seconds``; with
    ``reopen``, open a new one for each the server closes. Puts (opened,
    closed by the server, open-seconds of each closed one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 64)), hard))
    sel = selectors.DefaultSelector()
    opened = closed = 0
    lifetimes: list[float] = []
    end = time.monotonic() + seconds

    def open_one() -> None:
        nonlocal opened
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        sel.register(s, selectors.EVENT_WRITE, [time.monotonic(), False])
        opened += 1

    live = 0
    while time.monotonic() < end:
        while live < n and time.monotonic() < end and (reopen or opened < n):
            try:
                open_one()
                live += 1
            except OSError:
                break
        for key, ev in sel.select(timeout=0.2):
            s, data = key.fileobj, key.data
            if not data[1]:            # connected: send the headers, never the blank line
                try:
                    s.send(UNFINISHED)
                    data[1] = True
                    sel.modify(s, selectors.EVENT_READ, data)
                    continue
                except OSError:
                    pass
            else:
                try:
                    if s.recv(4096):
                        continue           # an answer (a 503): the server closes next
                except OSError:
                    pass
            lifetimes.append(time.monotonic() - data[0])
            closed += 1
            sel.unregister(s)
            s.close()
            live -= 1
    out.put((opened, closed, lifetimes))


def probe(port: int, seconds: float, stop: threading.Event) -> dict:
    """/health and a 4-token completion in turn, each timed (seconds); a
    request that gets no answer within 30 s counts 30."""
    health, completion, failures = [], [], 0
    end = time.monotonic() + seconds
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    while time.monotonic() < end and not stop.is_set():
        for path, sink in (("/health", health), ("/v1/completions", completion)):
            t0 = time.monotonic()
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                if path == "/health":
                    c.request("GET", path)
                else:
                    c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
                r = c.getresponse()
                r.read()
                ok = r.status == 200
                c.close()
            except OSError:
                ok = False
            sink.append(time.monotonic() - t0 if ok else 30.0)
            failures += not ok
        time.sleep(0.25)
    return {"health": health, "completion": completion, "failures": failures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--connections", type=int, default=20000)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--read-timeout", type=float, default=10)
    ap.add_argument("--reopen", action="store_true", help="a new connection for each one the server closes")
    args = ap.parse_args()
    cmd = ggpipe_command() + ["serve", "-m", args.model, "--port", "0", "--read-timeout", str(args.read_timeout)]
    if args.ranks > 1:
        cmd = ["mpiexec", "-n", str(args.ranks), *cmd]
    env = dict(child_env(), PYTHONUNBUFFERED="1")
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(server.stderr), daemon=True).start()
    try:
        line = ""
        while "listening on" not in line:
            line = server.stdout.readline()
            if not line and server.poll() is not None:
                raise SystemExit("the server did not start:\n" + "".join(err)[-2000:])
        port = int(re.search(r":(\d+)/v1", line).group(1))
        before = probe(port, 3, threading.Event())
        n_err0 = len(err)
        q: mp.Queue = mp.Queue()
        floods = [mp.Process(target=flood, args=(port, args.connections // args.clients, args.seconds, args.reopen, q))
                  for _ in range(args.clients)]
        for f in floods:
            f.start()
        time.sleep(2)      # the flood is up before the probe starts
        during = probe(port, args.seconds - 4, threading.Event())
        got = [q.get(timeout=args.seconds + 120) for _ in floods]
        for f in floods:
            f.join(30)
        time.sleep(1.5)
        lines = err[n_err0:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
    lifetimes = [x for _, _, lt in got for x in lt]
    report = {
        "connections_held": args.connections, "reopen": args.reopen, "flood_seconds": args.seconds,
        "opened": sum(o for o, _, _ in got), "closed_by_server": sum(c for _, c, _ in got),
        "unfinished_open_s_max": round(max(lifetimes), 2) if lifetimes else None,
        "unfinished_open_s_median": round(statistics.median(lifetimes), 2) if lifetimes else None,
        "health_s_before_median": round(statistics.median(before["health"]), 4),
        "health_s_max": round(max(during["health"]), 3), "health_s_median": round(statistics.median(during["health"]), 4),
        "completion_s_max": round(max(during["completion"]), 3),
        "completion_s_median": round(statistics.median(during["completion"]), 3),
        "probes": len(during["health"]), "probe_failures": during["failures"],
        "server_stderr_lines": len(lines), "server_stderr_sample": [ln.rstrip() for ln in lines[:3]],
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
