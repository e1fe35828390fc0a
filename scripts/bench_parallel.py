"""Many requests at once: ggpipe's continuous batching (``serve
--parallel C``) at several rank counts, ggpipe one request at a time
(``--parallel 1``), and llama.cpp on the same total cores (``llama-server
-np C`` driven by the same client, and ``llama-batched-bench``), side by
side in one interleaved run.

    python scripts/peer_llamacpp.py build        # once: llama-server, llama-batched-bench
    python scripts/peer_llamacpp.py build --llamafile off   # once: the same, built as ggpipe's llama.cpp
    python scripts/bench_parallel.py -m smollm2-goliath-40l-f32 --ranks 2,3 --concurrency 1,2,4,8,16 \\
        -n 128 --rounds 2 -o results/parallel

Each round runs every system in turn (rotated per round), and for each
system every concurrency C: a fresh server with C slots, then C streaming
clients at once, each with its own prompt (``--prompts``: the chat prompts
below, cycled, rendered with the model's chat template by the server's
``/v1/chat/completions``), ``max_tokens`` N, greedy, end-of-generation
ignored. Per (system, C) and round it records:

* aggregate tokens/s: completion tokens of all C requests / seconds from the
  first request sent to the last one finished (prompt processing included);
* generation tokens/s: completion tokens after each request's first / seconds
  from the median first token to the last one finished (the decode phase,
  what ``llama-batched-bench`` calls S_TG);
* TTFT p50/p90 (client side, from sending) and ITL p50/p90 (gaps between
  streamed chunks, pooled over the requests).

``--alt-python PY`` adds this checkout's ggpipe run by another venv's
python (the same Python version; its packages through PYTHONPATH) at each
rank count (one whose llama-cpp-python is llama.cpp's default build, llamafile's
sgemm on, to set beside llama.cpp's default build); ``--before DIR`` adds
ggpipe from a checkout of an earlier commit (through
``PYTHONPATH``) at each rank count, for a before/after in the same run;
``--draft-model MD`` adds ggpipe ``--mode speculative -md MD`` at each rank
count (the draft model on one of the ranks); ``--micro-batches M,...`` adds
ggpipe with ``--micro-batches M`` (besides ``auto``) at each rank count, to
find the best number of groups in flight on your hosts (at C = 1 there is
one).
``llama-batched-bench -npp P -ntg N -npl C,... -t T`` adds its own S_TG and
S (prompt processing included) per C. llama.cpp runs in two builds
(``--llamafile on,off``): its default one, whose llamafile sgemm multiplies
F32/F16 weights by batches of rows faster, and ggpipe's reference
configuration (``-DGGML_LLAMAFILE=OFF``, the kernels ggpipe's own
llama-cpp-python runs, which keep a batch's rows bit-identical to single
tokens); only the second compares the pipeline with llama.cpp on the same
kernels. ggpipe runs ``R`` ranks x
``--rank-threads`` threads (``mpiexec -n R``, default 1 thread), llama.cpp
``T`` threads for each ``T`` of ``--threads`` (default: the cores ggpipe's 2
ranks use); ``--ranks none`` runs llama.cpp alone. Results: ``results.csv`` (one row per system,
C and round) and ``summary.md`` (medians over rounds) in the output folder.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_llamacpp import bin_path  # noqa: E402

from ggpipe.child_process import ggpipe_command

PROMPTS = [
    "What is MPI?", "Write a haiku about pipelines.", "Explain what a KV cache is.",
    "List three uses of speculative decoding.", "Why do CPUs have caches?", "What is a Beowulf cluster?",
    "Summarise the plot of Hamlet.", "How does a hash table work?", "What is the speed of light?",
    "Describe a sunset over the sea.", "What is gradient descent?", "Name the planets of the solar system.",
    "How do vaccines work?", "What is Ethernet?", "Explain recursion to a child.", "What is a prime number?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free port, ready when /health answers 200."""

    def __init__(self, cmd: list[str], port: int, env: dict | None = None, timeout: float = 300):
        self.port = port
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, env=env)
        self.err: list[str] = []
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise SystemExit(f"server failed: {' '.join(cmd)}\n{''.join(self.err)[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"server did not start: {' '.join(cmd)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def sse_events(response):
    """The JSON events of a server-sent event stream (an OpenAI streaming reply), up to ``data: [DONE]``."""
    for raw in response:
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def one_request(port: int, prompt: str, n: int, out: dict, fields: dict) -> None:
    """A streaming chat completion (``fields`` added to its body); fills
    ``out`` with send / chunk times and the token count."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}, **fields}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    out["sent"], out["chunks"], out["tokens"] = time.perf_counter(), [], None
    with urllib.request.urlopen(req, timeout=1800) as r:
        for ev in sse_events(r):
            if ev.get("usage"):
                out["tokens"] = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    out["chunks"].append(time.perf_counter())
    out["done"] = time.perf_counter()
    if out["tokens"] is None:
        out["tokens"] = len(out["chunks"])


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def drive(port: int, c: int, n: int, fields: dict) -> dict:
    """C concurrent streaming requests (``fields``: added to each body); the
    figures of the module docstring."""
    outs = [{} for _ in range(c)]
    ths = [threading.Thread(target=one_request, args=(port, PROMPTS[i % len(PROMPTS)], n, outs[i], fields))
           for i in range(c)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    t0 = min(o["sent"] for o in outs)
    t_end = max(o["done"] for o in outs)
    tokens = sum(o["tokens"] for o in outs)
    firsts = [o["chunks"][0] for o in outs if o["chunks"]]
    gaps = [b - a for o in outs for a, b in zip(o["chunks"], o["chunks"][1:])]
    t_gen = t_end - statistics.median(firsts)
    return {"requests": c, "tokens": tokens, "wall_s": round(t_end - t0, 3),
            "agg_tokens_per_s": round(tokens / (t_end - t0), 2),
            "gen_tokens_per_s": round((tokens - c) / t_gen, 2) if t_gen > 0 else None,
            "ttft_p50_ms": round(1e3 * pct([f - o["sent"] for f, o in zip(firsts, outs)], .5), 1),
            "ttft_p90_ms": round(1e3 * pct([f - o["sent"] for f, o in zip(firsts, outs)], .9), 1),
            "itl_p50_ms": round(1e3 * pct(gaps, .5), 2) if gaps else None,
            "itl_p90_ms": round(1e3 * pct(gaps, .9), 2) if gaps else None}


def ggpipe_server(model: str, ranks: int, parallel: int, n: int, port: int, before: str | None = None,
                  extra: tuple = (), threads: int = 1, python: str | None = None) -> Server:
    """``before``: a checkout of an earlier commit, run through PYTHONPATH
    instead of this one; ``extra``: more ``serve`` arguments (a draft model);
    ``python``: another venv's interpreter (its packages, another build of
    llama.cpp) running this checkout's ggpipe through PYTHONPATH."""
    cmd = ["mpiexec", "-n", str(ranks), *ggpipe_command(python), "serve", "-m", model, "--port", str(port),
           "--parallel", str(parallel), "-n", str(n), "--ignore-eos", "--max-queue", "256", "-t", str(threads),
           *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if before or python:
        env["PYTHONPATH"] = before or str(Path(__file__).resolve().parent.parent)
    return Server(cmd, port, env=env)


def llama_server(model: str, parallel: int, n: int, threads: int, port: int, llamafile: bool = True) -> Server:
    cmd = [str(bin_path("llama-server", llamafile)), "-m", model, "--port", str(port), "-np", str(parallel),
           "-c", str(2048 * parallel), "-t", str(threads), "-tb", str(threads), "-fa", "off",
           "-n", str(n), "--no-warmup", "--host", "127.0.0.1"]
    return Server(cmd, port)


_BB_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|"
                     r"\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|")


def batched_bench(model: str, cs: list[int], n: int, threads: int, npp: int,
                  llamafile: bool = True) -> dict[int, dict]:
    """llama-batched-bench's S_TG and S per parallel sequence count."""
    cmd = [str(bin_path("llama-batched-bench", llamafile)), "-m", model, "-c", str(max(cs) * (npp + n) + 256), "-b", "2048",
           "-ub", "512", "-npp", str(npp), "-ntg", str(n), "-npl", ",".join(map(str, cs)), "-t", str(threads),
           "-fa", "off"]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"llama-batched-bench failed:\n{p.stderr[-3000:]}")
    out = {}
    for line in (p.stdout + p.stderr).splitlines():
        m = _BB_ROW.match(line.strip())
        if m:
            b = int(m.group(3))
            out[b] = {"gen_tokens_per_s": float(m.group(8)), "agg_tokens_per_s": float(m.group(10)),
                      "tokens": b * n, "wall_s": float(m.group(9))}
    return out


def main() -> None:
    from ggpipe.models.registry import resolve

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32")
    ap.add_argument("--ranks", default="2,3", help="ggpipe rank counts, or none")
    ap.add_argument("--rank-threads", type=int, default=1, help="threads per ggpipe rank")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", default="2", help="llama.cpp thread counts, comma-separated (the cores ggpipe's "
                    "ranks use)")
    ap.add_argument("--npp", type=int, default=32, help="llama-batched-bench prompt tokens per sequence")
    ap.add_argument("--no-llamacpp", action="store_true", help="ggpipe rows only")
    ap.add_argument("--no-llama-server", action="store_true", help="of llama.cpp, llama-batched-bench only")
    ap.add_argument("--llamafile", default="on,off",
                    help="llama.cpp builds to run: on (its default build) and/or off (-DGGML_LLAMAFILE=OFF, "
                    "ggpipe's reference configuration), comma-separated")
    ap.add_argument("--no-one-at-a-time", action="store_true", help="skip ggpipe --parallel 1")
    ap.add_argument("--before", metavar="DIR", help="also run ggpipe from this checkout of an earlier commit "
                    "(git worktree add DIR COMMIT; copy ggpipe/_native*.so into it) at each --ranks")
    ap.add_argument("--alt-python", metavar="PY", help="also run ggpipe with this venv's python at each --ranks "
                    "(e.g. one whose llama-cpp-python has llamafile's sgemm: pip install without "
                    "scripts/install_exact.sh)")
    ap.add_argument("--draft-model", metavar="MD", help="also run ggpipe --mode speculative -md MD at each --ranks "
                    "(the draft model takes one of the ranks; it drafts while a request generates alone)")
    ap.add_argument("--micro-batches", metavar="M,...", default="",
                    help="also run ggpipe --micro-batches M at each --ranks, for each M")
    ap.add_argument("-o", "--output", default="results/parallel")
    a = ap.parse_args()
    model = str(resolve(a.model))
    cs = [int(x) for x in a.concurrency.split(",")]
    ranks = [] if a.ranks == "none" else [int(r) for r in a.ranks.split(",")]
    per = f" x {a.rank_threads} threads" if a.rank_threads > 1 else ""
    systems = [(f"ggpipe {r} ranks{per}", "ggpipe", r) for r in ranks]
    if a.before:
        systems += [(f"ggpipe {r} ranks{per} (before)", "ggpipe-before", r) for r in ranks]
    if a.alt_python:
        systems += [(f"ggpipe {r} ranks{per} (alt python)", "ggpipe-alt", r) for r in ranks]
    if a.draft_model:
        systems += [(f"ggpipe {r} ranks{per} + draft", "ggpipe-draft", r) for r in ranks]
    for m in filter(None, a.micro_batches.split(",")):
        systems += [(f"ggpipe {r} ranks{per} --micro-batches {int(m)}", f"ggpipe-mb{int(m)}", r) for r in ranks]
    if ranks and not a.no_one_at_a_time:
        systems.append((f"ggpipe one at a time, 2 ranks{per}", "ggpipe1", 2))
    if not a.no_llamacpp:
        for build in a.llamafile.split(","):
            if build not in ("on", "off"):
                raise SystemExit(f"--llamafile: 'on' or 'off', got {build!r}")
            tag = "" if build == "on" else ", llamafile off"
            for prog in ("llama-server", "llama-batched-bench"):
                if not bin_path(prog, build == "on").exists():
                    raise SystemExit(f"{bin_path(prog, build == 'on')} missing: run `python scripts/peer_llamacpp.py "
                                     f"build{'' if build == 'on' else ' --llamafile off'}` first")
            for t in map(int, a.threads.split(",")):
                if not a.no_llama_server:
                    systems.append((f"llama-server {t} threads{tag}", f"llama-server-{build}", t))
                systems.append((f"llama-batched-bench {t} threads{tag}", f"batched-bench-{build}", t))
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for rnd in range(a.rounds):
        order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
        for name, kind, size in order:  # size: ggpipe's ranks, llama.cpp's threads
            if kind.startswith("batched-bench"):
                for c, r in batched_bench(model, cs, a.n, size, a.npp, kind.endswith("-on")).items():
                    rows.append({"system": name, "round": rnd, "requests": c, **r})
                    print(f"{name:36s} C={c:3d} agg {r['agg_tokens_per_s']:7.1f}  gen {r['gen_tokens_per_s']:7.1f} tok/s",
                          flush=True)
                continue
            for c in cs:
                port = free_port()
                extra = (("--mode", "speculative", "-md", a.draft_model) if kind == "ggpipe-draft" else
                         ("--micro-batches", kind[len("ggpipe-mb"):]) if kind.startswith("ggpipe-mb") and c > 1 else ())
                srv = (llama_server(model, c, a.n, size, port, kind.endswith("-on")) if kind.startswith("llama-server") else
                       ggpipe_server(model, size, 1 if kind == "ggpipe1" else c, a.n, port,
                                     a.before if kind == "ggpipe-before" else None, extra, a.rank_threads,
                                     a.alt_python if kind == "ggpipe-alt" else None))
                # end of generation ignored: llama-server per request, ggpipe serve for the job (--ignore-eos)
                fields = {"ignore_eos": True} if kind.startswith("llama-server") else {}
                try:
                    drive(port, 1, 4, fields)                      # warm-up
                    r = drive(port, c, a.n, fields)
                finally:
                    srv.stop()
                rows.append({"system": name, "round": rnd, **r})
                print(f"{name:36s} C={c:3d} agg {r['agg_tokens_per_s']:7.1f}  gen {r['gen_tokens_per_s']:7.1f} tok/s  "
                      f"TTFT p50 {r['ttft_p50_ms']:7.0f} ms  ITL p50/p90 {r['itl_p50_ms']}/{r['itl_p90_ms']} ms",
                      flush=True)
            write(out, rows)
    write(out, rows)
    print(f"wrote {out / 'results.csv'} and {out / 'summary.md'}")


def write(out: Path, rows: list[dict]) -> None:
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("system", "round", "requests"), k))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    cols = ["agg_tokens_per_s", "gen_tokens_per_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms"]
    lines = ["| system | C | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for (system, c) in sorted({(r["system"], r["requests"]) for r in rows}, key=lambda x: (x[1], x[0])):
        sel = [r for r in rows if r["system"] == system and r["requests"] == c]
        med = [statistics.median([r[k] for r in sel if r.get(k) is not None] or [float("nan")]) for k in cols]
        lines.append(f"| {system} | {c} | " + " | ".join("" if v != v else f"{v:g}" for v in med) + " |")
    (out / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
