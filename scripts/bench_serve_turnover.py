"""``serve`` with its slots reused: C clients, each sending K chat requests one after another (natural
lengths: greedy, at most -n tokens, stopping at the end of generation), so requests end and start while
the others generate. Alternates this checkout with an earlier one (``--before``), round by round, and
prints each run's generated tokens per second and a hash of every text (the same in every run).

    git worktree add /tmp/before 5b34b85 && cp ggpipe/_native*.so /tmp/before/ggpipe/
    python scripts/bench_serve_turnover.py -m smollm2-goliath-40l-f32 --ranks 2 --clients 8 --requests 4 \\
        --rounds 2 --before /tmp/before

Prompts: scripts/prompts/holdout16.jsonl (cycled; from the 17th request on with " Answer briefly."
appended, so that no two requests are the same).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
import urllib.request
from pathlib import Path

from bench_parallel import Server, free_port

HERE = Path(__file__).resolve().parent
PROMPTS = [json.loads(line)["prompt"] for line in open(HERE / "prompts" / "holdout16.jsonl")]


def client(port: int, first: int, k: int, n: int, out: list) -> None:
    """``k`` requests one after another: (request number, text, completion tokens) each."""
    for j in range(first, first + k):
        prompt = PROMPTS[j % len(PROMPTS)] + ("" if j < len(PROMPTS) else " Answer briefly.")
        body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1800) as r:
            d = json.load(r)
        out.append((j, d["choices"][0]["message"]["content"], d["usage"]["completion_tokens"]))


def one_run(a, pythonpath: str | None) -> dict:
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=pythonpath or str(HERE.parent))
    srv = Server(["mpiexec", "-n", str(a.ranks), "ggpipe", "serve", "-m", a.model, "--port", str(port),
                  "--parallel", str(a.clients), "-t", str(a.threads)], port, env=env)
    try:
        outs: list[list] = [[] for _ in range(a.clients)]
        ths = [threading.Thread(target=client, args=(port, i * a.requests, a.requests, a.n, outs[i]))
               for i in range(a.clients)]
        t0 = time.perf_counter()
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        srv.stop()
    res = sorted(x for o in outs for x in o)
    tokens = sum(x[2] for x in res)
    return {"requests": len(res), "tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 2),
            "texts": hashlib.md5(json.dumps([x[1] for x in res]).encode()).hexdigest()[:8]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--clients", type=int, default=8, help="clients at once (and --parallel)")
    ap.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--before", help="an earlier checkout (git worktree add DIR COMMIT; copy ggpipe/_native*.so)")
    a = ap.parse_args()
    for rnd in range(a.rounds):
        for name, pp in ([("before", a.before)] if a.before else []) + [("this", None)]:
            r = one_run(a, pp)
            print(f"round {rnd} {name}: {r['requests']} requests, {r['tokens']} tokens in {r['wall_s']} s: "
                  f"{r['tokens_per_s']} tokens/s, texts {r['texts']}", flush=True)


if __name__ == "__main__":
    main()
