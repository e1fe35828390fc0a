"""One seed, one text: the same sampled request sent many times to ``ggpipe
serve`` in every mode and drafting strategy, streamed and not, at
``--parallel 1`` and 4, and the texts it got counted.

    python scripts/seeded_repeats.py --repeats 20 -o results/seeded-repeats.md

A mode's output with a seed is a function of (seed, position) alone
(docs/user-guide/speculative.md, Sampling): whatever was drafted, and
whenever (PipeInfer's and PipeDec's drafts follow timing), each position is
the target's own keyed draw. So every mode should give one text over all
its repeats, and iterative's text wherever the build's batch rows are
exact (`ggpipe models info MODEL` says; in the default build a speculative
mode's verified rows may differ from lone-token rows in their last bits,
and a draw that lands on a boundary they move can then differ).

Per mode and ``--parallel`` setting, one server on 2 ranks (3 for the vote
of two draft models); ``--repeats`` requests streamed and as many not,
sent ``--parallel`` at a time. Printed (and written with ``-o``): the
number of distinct texts per mode, and whether the mode's text equals
iterative's.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_parallel import Server, free_port, sse_events  # noqa: E402

from ggpipe.child_process import ggpipe_command  # noqa: E402

MODES = [   # name, ranks, serve arguments (DRAFT: the draft model)
    ("iterative", 2, ["--mode", "iterative"]),
    ("speculative, draft model", 2, ["--mode", "speculative", "-md", "DRAFT"]),
    ("speculative, n-gram", 2, ["--mode", "speculative", "--spec-type", "ngram"]),
    ("speculative, staged", 2, ["--mode", "speculative", "--spec-type", "staged", "-md", "DRAFT"]),
    ("speculative, vote", 3, ["--mode", "speculative", "--spec-type", "vote", "-md", "DRAFT,DRAFT"]),
    ("pipeinfer", 2, ["--mode", "pipeinfer", "-md", "DRAFT"]),
    ("pipedec", 2, ["--mode", "pipedec", "-md", "DRAFT"]),
]
MESSAGES = [{"role": "user", "content": "Write four lines about a lighthouse keeper and the sea."}]


def ask(port: int, stream: bool, fields: dict) -> str:
    """One chat completion's text."""
    body = {"messages": MESSAGES, "stream": stream, **fields}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        if not stream:
            return json.load(r)["choices"][0]["message"]["content"]
        return "".join((ch.get("delta") or {}).get("content") or "" for ev in sse_events(r)
                       for ch in ev.get("choices") or [])


def repeats(port: int, n: int, at_once: int, fields: dict) -> list[str]:
    """``n`` streamed and ``n`` plain requests, ``at_once`` at a time."""
    texts: list[str] = []
    jobs = [s for s in (True, False) for _ in range(n)]
    for i in range(0, len(jobs), at_once):
        out: list[str] = [""] * len(jobs[i:i + at_once])

        def one(k: int, stream: bool) -> None:
            out[k] = ask(port, stream, fields)

        threads = [threading.Thread(target=one, args=(k, s)) for k, s in enumerate(jobs[i:i + at_once])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        texts += out
    return texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-md", "--draft-model", default="smollm2-135m-skip26")
    ap.add_argument("--repeats", type=int, default=20, help="requests per mode and setting, streamed; as many not")
    ap.add_argument("--parallel", default="1,4")
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("-n", type=int, default=48, help="max_tokens of each request")
    ap.add_argument("--modes", default=",".join(m for m, _, _ in MODES), help="comma-separated names (as listed)")
    ap.add_argument("-o", "--output", type=Path)
    a = ap.parse_args()
    wanted = [m.strip() for m in a.modes.split(",")] if a.modes else []
    fields = {"temperature": a.temp, "seed": a.seed, "max_tokens": a.n}
    rows = []
    texts_of: dict[tuple[str, int], set[str]] = {}
    for p in (int(x) for x in a.parallel.split(",")):
        for name, ranks, args in MODES:
            if wanted and not any(name.startswith(w) for w in wanted):
                continue
            port = free_port()
            cmd = ["mpiexec", "-n", str(ranks), *ggpipe_command(), "serve", "-m", a.model, "--port", str(port),
                   "--parallel", str(p), "-n", str(a.n), *[x.replace("DRAFT", a.draft_model) for x in args]]
            srv = Server(cmd, port)
            try:
                got = repeats(port, a.repeats, p, fields)
            finally:
                srv.stop()
            texts_of[(name, p)] = set(got)
            base = texts_of.get(("iterative", p))
            rows.append((name, p, len(got), len(set(got)), base is not None and set(got) == base))
            print(f"{name:26s} --parallel {p}: {len(got)} requests, {len(set(got))} distinct text(s), "
                  f"iterative's: {rows[-1][4]}", flush=True)
    lines = ["| mode | --parallel | requests | distinct texts | iterative's text |", "|---|---:|---:|---:|---|"]
    lines += [f"| {n} | {p} | {k} | {d} | {'yes' if same else 'no'} |" for n, p, k, d, same in rows]
    table = "\n".join(lines) + "\n"
    print(table)
    if a.output:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(table, encoding="utf-8")
    sys.exit(0 if all(d == 1 for _, _, _, d, _ in rows) else 1)


if __name__ == "__main__":
    main()
