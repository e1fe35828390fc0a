"""One request, one text: requests sent again and again to ``ggpipe serve``
in every mode and drafting strategy, streamed and not, at ``--parallel`` 1
and 4 and on 2 or more ranks, and their texts compared with iterative
mode's.

    python scripts/seeded_repeats.py --repeats 20 -o results/seeded-repeats.md
    python scripts/seeded_repeats.py --temp 0 --prompts scripts/prompts/holdout16.jsonl --limit 12 \
        --repeats 1 --ranks 2,3 -o results/greedy-equal.md

A mode's output with a seed is a function of (seed, position) alone
(docs/user-guide/speculative.md, Sampling): whatever was drafted, and
whenever (PipeInfer's and PipeDec's drafts follow timing), each position is
the target's own keyed draw; greedy (``--temp 0``) it is the target's
argmax. So every mode should give one text per prompt over all its
repeats, and iterative's text wherever the build's batch rows are exact
(`ggpipe models info MODEL` says; in the default build a speculative mode's
verified rows may differ from lone-token rows in their last bits, and a
draw or an argmax that lands on a boundary they move can then differ).

Per mode, rank count and ``--parallel`` setting, one server (``--ranks``
counts the target's ranks with one draft model: the vote of two draft
models gets one rank more); each prompt (the chat message of ``--prompts``'
``prompt`` fields, or one about a lighthouse keeper) is sent ``--repeats``
times streamed and as many not, ``--parallel`` requests at a time. Printed
(and written with ``-o``): per mode, the requests, the most distinct texts
one prompt got, and the prompts whose every text is iterative's (at the
same ranks and ``--parallel``). Exits 1 if any prompt got two texts, or a
mode's text is not iterative's.
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

from ggpipe.bench.prompts import load_prompts  # noqa: E402
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
LIGHTHOUSE = "Write four lines about a lighthouse keeper and the sea."


def ask(port: int, stream: bool, prompt: str, fields: dict) -> str:
    """One chat completion's text."""
    body = {"messages": [{"role": "user", "content": prompt}], "stream": stream, **fields}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        if not stream:
            return json.load(r)["choices"][0]["message"]["content"]
        return "".join((ch.get("delta") or {}).get("content") or "" for ev in sse_events(r)
                       for ch in ev.get("choices") or [])


def repeats(port: int, prompts: list[str], n: int, at_once: int, fields: dict) -> dict[int, set[str]]:
    """Each prompt ``n`` times streamed and ``n`` times not, ``at_once``
    requests at a time; the texts each prompt (by index) got."""
    jobs = [(k, s) for s in (True, False) for _ in range(n) for k in range(len(prompts))]
    texts: dict[int, set[str]] = {k: set() for k in range(len(prompts))}
    for i in range(0, len(jobs), at_once):
        batch = jobs[i:i + at_once]
        out: list[str] = [""] * len(batch)

        def one(j: int, k: int, stream: bool) -> None:
            out[j] = ask(port, stream, prompts[k], fields)

        threads = [threading.Thread(target=one, args=(j, k, s)) for j, (k, s) in enumerate(batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for (k, _), text in zip(batch, out):
            texts[k].add(text)
    return texts


def read_prompts(path: Path | None, limit: int | None) -> list[str]:
    """The ``prompt`` fields of a JSON-lines file (the first ``limit``), or the lighthouse prompt."""
    if path is None:
        return [LIGHTHOUSE]
    prompts = [p["prompt"] for p in load_prompts(str(path))]
    return prompts[:limit] if limit else prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-md", "--draft-model", default="smollm2-135m-skip26")
    ap.add_argument("--repeats", type=int, default=20, help="requests per prompt, mode and setting, streamed; "
                                                            "as many not")
    ap.add_argument("--prompts", type=Path, help="JSON lines with a prompt field (default: one prompt)")
    ap.add_argument("--limit", type=int, help="the first LIMIT prompts of --prompts")
    ap.add_argument("--parallel", default="1,4")
    ap.add_argument("--ranks", default="2", help="comma-separated total ranks of the modes with one draft model")
    ap.add_argument("--temp", type=float, default=0.8, help="0: greedy")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("-n", type=int, default=48, help="max_tokens of each request")
    ap.add_argument("--modes", default=",".join(m for m, _, _ in MODES), help="comma-separated names (as listed)")
    ap.add_argument("-o", "--output", type=Path)
    a = ap.parse_args()
    wanted = [m.strip() for m in a.modes.split(",")] if a.modes else []
    prompts = read_prompts(a.prompts, a.limit)
    fields = {"temperature": a.temp, "seed": a.seed, "max_tokens": a.n}
    rows = []
    for n_ranks in (int(x) for x in a.ranks.split(",")):
        for p in (int(x) for x in a.parallel.split(",")):
            base: dict[int, set[str]] | None = None
            for name, ranks, args in MODES:
                if wanted and not any(name.startswith(w) for w in wanted):
                    continue
                port, n_proc = free_port(), ranks + n_ranks - 2
                cmd = ["mpiexec", "-n", str(n_proc), *ggpipe_command(), "serve", "-m", a.model,
                       "--port", str(port), "--parallel", str(p), "-n", str(a.n),
                       *[x.replace("DRAFT", a.draft_model) for x in args]]
                srv = Server(cmd, port)
                try:
                    got = repeats(port, prompts, a.repeats, p, fields)
                finally:
                    srv.stop()
                if name == "iterative":
                    base = got
                n_req = 2 * a.repeats * len(prompts)
                most = max(len(t) for t in got.values())
                same = sum(got[k] == base[k] for k in got) if base is not None else None
                rows.append((name, n_proc, p, n_req, most, same))
                print(f"{name:26s} {n_proc} ranks --parallel {p}: {n_req} requests, at most {most} text(s) "
                      f"per prompt, iterative's text on {same} of {len(prompts)} prompts", flush=True)
    lines = ["| mode | ranks | --parallel | requests | most texts of one prompt | prompts with iterative's text |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {n} | {r} | {p} | {k} | {m} | {'-' if s is None else f'{s} of {len(prompts)}'} |"
              for n, r, p, k, m, s in rows]
    table = "\n".join(lines) + "\n"
    print(table)
    if a.output:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(table, encoding="utf-8")
    sys.exit(0 if all(m == 1 and s in (None, len(prompts)) for _, _, _, _, m, s in rows) else 1)


if __name__ == "__main__":
    main()
