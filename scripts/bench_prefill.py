"""Prompts under load: ggpipe ``serve`` against llama.cpp's own programs on
the same model, threads and flash-attention setting, side by side in one
interleaved run (each round runs every system once, the order rotated).

    python scripts/peer_llamacpp.py build      # once: llama-server, llama-batched-bench, ggml-rpc-server
    python scripts/bench_prefill.py short -m llama-1b-shape-q4_k_m --rounds 3 -o results/prefill-short
    python scripts/bench_prefill.py long -m smollm2-135m --prompts scripts/prompts/long8-holdout.jsonl --rounds 3
    python scripts/bench_prefill.py long2 -m smollm2-135m --rounds 3 --variant 'split prompts=--split prompts'
    python scripts/bench_prefill.py arrival -m smollm2-135m --rounds 3
    python scripts/bench_prefill.py first -m llama-1b-shape-q4_k_m --rounds 3

Workloads (every request streamed by the same client, greedy, end of
generation ignored; ggpipe on one rank runs without ``mpiexec``):

* ``short``: 16 requests with short prompts at once (``--prompts``,
  default ``scripts/prompts/many16.jsonl``, sent as plain completions), 64
  tokens each, 1 rank x 2 threads: ggpipe ``serve --parallel 16`` against
  ``llama-batched-bench -npp P -ntg 64 -npl 16`` (P: the prompts' mean
  length) and ``llama-server -np 16``.
* ``long``: 8 chat requests with prompts of 400-1,500 tokens at once
  (default ``scripts/prompts/long8.jsonl``), 64 tokens each, 1 rank x 2
  threads: ggpipe ``serve --parallel 8`` against ``llama-batched-bench
  -npl 8`` and ``llama-server -np 8``.
* ``long2``: the same requests through 2 ranks x 1 thread, against
  ``llama-batched-bench --rpc`` over a local ``ggml-rpc-server`` (2
  processes x 1 thread, the last half of the layers on the server).
* ``arrival``: 7 requests generate (``--prompts`` short ones, 320 tokens
  each); once each has streamed 48 chunks, a chat request with a
  2,000-token prompt (``scripts/prompts/long2000.jsonl``) arrives. Printed:
  the 7's time between chunks, median before it arrived and 90th
  percentile while its prompt was processed (until its first token), and
  their ratio; the long request's time to first token. ggpipe ``serve
  --parallel 8`` against ``llama-server -np 8``.
* ``first``: a fresh server; the first request after load (one token)
  and a second one of about the same length (the set's two chat prompts
  closest in length, the longer first, since a longer prompt costs more
  per token): prompt
  tokens per second of each (ggpipe's own ``prompt_s``; llama-server's
  ``timings``) and the first's over the second's.

Figures per system and round: ``tokens_per_s`` (prompt and generated
tokens / seconds from the first request sent to the last finished: what
``llama-batched-bench`` calls S), ``last_first_token_s`` (when the last
request's first token came; llama-batched-bench: its prompt time T_PP),
TTFT p50/p90 and ITL p50/p90. ``--before DIR`` adds ggpipe from a checkout
of an earlier commit (through ``PYTHONPATH``) to every workload;
``--variant 'LABEL=ARGS'`` adds ggpipe with more ``serve`` arguments (e.g.
``--variant 'split prompts=--split prompts'``). Results:
``results.csv`` (one row per system and round) and ``summary.md``
(medians over rounds, ratios to the first llama.cpp system) in ``-o``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_parallel import Server, free_port, pct, sse_events  # noqa: E402
from peer_llamacpp import RpcServer, bin_path  # noqa: E402

from ggpipe.child_process import ggpipe_command  # noqa: E402

WORKLOADS = {   # name: (default prompts, requests, tokens out, ggpipe ranks x threads)
    "short": ("many16.jsonl", 16, 64, (1, 2)),
    "long": ("long8.jsonl", 8, 64, (1, 2)),
    "long2": ("long8.jsonl", 8, 64, (2, 1)),
    "arrival": ("many16.jsonl", 7, 320, (1, 2)),
    "first": ("long8.jsonl", None, 1, (1, 2)),     # the two prompts of the set closest in length
}
ARRIVE_AFTER = 48   # chunks each running request streams before the long prompt arrives


def load_prompts(path: Path) -> list[dict]:
    """A JSONL prompt set: ``{"prompt": text}`` (plain completions) or ``{"messages": [...]}`` (chat)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def one_request(port: int, item: dict, n: int, out: dict, fields: dict, stream: bool = True) -> None:
    """A completion of ``item`` (chat when it has messages), ``max_tokens`` n, greedy; fills ``out`` with the
    send time, each streamed chunk's arrival, the finish time, the prompt and completion tokens and (not
    streamed) the reply."""
    chat = "messages" in item
    body = {"max_tokens": n, "temperature": 0, "stream": stream, **fields,
            **({"messages": item["messages"]} if chat else {"prompt": item["prompt"]})}
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/{'chat/completions' if chat else 'completions'}",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    out.update(sent=time.perf_counter(), chunks=[], tokens=None, prompt_tokens=None)
    with urllib.request.urlopen(req, timeout=3600) as r:
        if not stream:
            out["reply"] = json.loads(r.read())
            out["tokens"] = out["reply"]["usage"]["completion_tokens"]
            out["prompt_tokens"] = out["reply"]["usage"]["prompt_tokens"]
        else:
            for ev in sse_events(r):
                if ev.get("usage"):
                    out["tokens"] = ev["usage"]["completion_tokens"]
                    out["prompt_tokens"] = ev["usage"]["prompt_tokens"]
                for ch in ev.get("choices") or []:
                    delta = ch.get("delta") or {}
                    if delta.get("content") or ch.get("text"):
                        out["chunks"].append(time.perf_counter())
    out["done"] = time.perf_counter()
    if out["tokens"] is None:
        out["tokens"] = len(out["chunks"])


def burst(port: int, items: list[dict], n: int, fields: dict) -> dict:
    """Every request at once; the figures of the module docstring."""
    outs = [{} for _ in items]
    ths = [threading.Thread(target=one_request, args=(port, it, n, o, fields)) for it, o in zip(items, outs)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    t0, t_end = min(o["sent"] for o in outs), max(o["done"] for o in outs)
    firsts = [o["chunks"][0] - o["sent"] for o in outs if o["chunks"]]
    gaps = [b - a for o in outs for a, b in zip(o["chunks"], o["chunks"][1:])]
    prompt = sum(o["prompt_tokens"] or 0 for o in outs)
    gen = sum(o["tokens"] for o in outs)
    return {"prompt_tokens": prompt, "gen_tokens": gen, "wall_s": round(t_end - t0, 3),
            "tokens_per_s": round((prompt + gen) / (t_end - t0), 2),
            "last_first_token_s": round(max(firsts), 3),
            "ttft_p50_ms": round(1e3 * pct(firsts, .5), 1), "ttft_p90_ms": round(1e3 * pct(firsts, .9), 1),
            "itl_p50_ms": round(1e3 * pct(gaps, .5), 2) if gaps else None,
            "itl_p90_ms": round(1e3 * pct(gaps, .9), 2) if gaps else None}


def arrival(port: int, items: list[dict], long_item: dict, n: int, fields: dict) -> dict:
    """Requests ``items`` generate; once each streamed ARRIVE_AFTER chunks, ``long_item`` arrives."""
    outs = [{} for _ in items]
    ths = [threading.Thread(target=one_request, args=(port, it, n, o, fields)) for it, o in zip(items, outs)]
    for t in ths:
        t.start()
    end = time.monotonic() + 1800
    while time.monotonic() < end and not all(len(o.get("chunks", ())) >= ARRIVE_AFTER for o in outs):
        time.sleep(0.01)
    late: dict = {}
    one_request(port, long_item, 16, late, fields)
    for t in ths:
        t.join()
    t_arr, t_first = late["sent"], late["chunks"][0] if late["chunks"] else late["done"]
    before = [b - a for o in outs for a, b in zip(o["chunks"], o["chunks"][1:]) if b <= t_arr]
    # every gap that overlaps the long prompt's processing (one that spans its arrival included)
    during = [b - a for o in outs for a, b in zip(o["chunks"], o["chunks"][1:]) if b > t_arr and a < t_first]
    med = statistics.median(before)
    p90 = pct(during, .9) if during else None
    return {"itl_before_p50_ms": round(1e3 * med, 2), "itl_before_p90_ms": round(1e3 * pct(before, .9), 2),
            "itl_during_p50_ms": round(1e3 * pct(during, .5), 2) if during else None,
            "itl_during_p90_ms": round(1e3 * p90, 2) if p90 else None,
            "itl_ratio": round(p90 / med, 2) if p90 else None, "long_prompt_tokens": late["prompt_tokens"],
            "long_ttft_s": round(t_first - t_arr, 3), "steps_during": len(during)}


def first_requests(port: int, items: list[dict]) -> dict:
    """Two requests one after the other, one token each, not streamed."""
    rates = []
    for it in items[:2]:
        o: dict = {}
        one_request(port, it, 1, o, {}, stream=False)
        r = o["reply"]
        if "ggpipe" in r:
            m = r["ggpipe"]["metrics"]
            rates.append(m["prompt_tokens_per_s"])
        else:
            rates.append(r["timings"]["prompt_per_second"])
    return {"first_prompt_tokens_per_s": round(rates[0], 2), "second_prompt_tokens_per_s": round(rates[1], 2),
            "first_over_second": round(rates[0] / rates[1], 3)}


def ggpipe_server(model: str, ranks: int, threads: int, parallel: int, n: int, port: int, extra: list[str],
                  before: str | None = None) -> Server:
    cmd = [*ggpipe_command(), "serve", "-m", model, "--port", str(port), "--parallel", str(parallel), "-n", str(n),
           "--ignore-eos", "--max-queue", "256", "-t", str(threads), *extra]
    if ranks > 1:
        cmd = ["mpiexec", "-n", str(ranks), *cmd]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if before:
        env["PYTHONPATH"] = before
    return Server(cmd, port, env=env)


def llama_server(model: str, parallel: int, n: int, threads: int, port: int, ctx_per_slot: int, fa: str) -> Server:
    cmd = [str(bin_path("llama-server")), "-m", model, "--port", str(port), "-np", str(parallel),
           "-c", str(ctx_per_slot * parallel), "-t", str(threads), "-tb", str(threads), "-fa", fa, "-n", str(n),
           "--host", "127.0.0.1", "--no-cache-prompt"]
    return Server(cmd, port)


def batched_bench(model: str, npl: int, npp: int, ntg: int, threads: int, fa: str, n_layer: int, n_ctx: int,
                  rpc: RpcServer | None = None) -> dict:
    """llama-batched-bench's row: T_PP (prompt seconds), S (all tokens / all seconds)."""
    cmd = [str(bin_path("llama-batched-bench")), "-m", model, "-c", str(n_ctx), "-b", "2048",
           "-ub", "512", "-npp", str(npp), "-ntg", str(ntg), "-npl", str(npl), "-t", str(threads), "-fa", fa]
    if rpc is not None:
        cmd += ["--rpc", rpc.addr, "-ngl", str(n_layer // 2)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=7200)
    for line in (p.stdout + p.stderr).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] == str(npp) and cells[2] == str(npl):
            t_pp, t, s = float(cells[4]), float(cells[8]), float(cells[9])
            return {"prompt_tokens": npl * npp, "gen_tokens": npl * ntg, "wall_s": t, "tokens_per_s": s,
                    "last_first_token_s": t_pp}
    raise SystemExit(f"llama-batched-bench failed:\n{(p.stdout + p.stderr)[-3000:]}")


def prompt_lengths(model: str, items: list[dict]) -> list[int]:
    """Tokens of each prompt as ggpipe's server makes them (chat template for messages; plain text otherwise)."""
    from ggpipe.runtime.llama import lib  # noqa: PLC0415
    from ggpipe.runtime.vocab import Vocab  # noqa: PLC0415
    from ggpipe.service.chat_prompt import chat_tokens  # noqa: PLC0415

    L = lib()
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    m = L.llama_model_load_from_file(model.encode(), mp)
    vocab = Vocab(m, L.llama_model_get_vocab(m))
    try:
        return [len(chat_tokens(vocab, it["messages"])) if "messages" in it else len(vocab.tokenize(it["prompt"]))
                for it in items]
    finally:
        L.llama_model_free(m)


def main() -> None:
    from ggpipe.models.gguf_info import read_model_info  # noqa: PLC0415
    from ggpipe.models.registry import resolve  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", choices=list(WORKLOADS))
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=Path, help="prompt set (JSONL; default: the workload's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-fa", "--flash-attn", default="off", choices=["on", "off"])
    ap.add_argument("--extra", default="", help="more ggpipe serve arguments (one string)")
    ap.add_argument("--before", metavar="DIR", help="also run ggpipe from this checkout (git worktree add DIR "
                    "COMMIT; copy ggpipe/_native*.so into it)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=ARGS",
                    help="also run ggpipe with these serve arguments added, as system 'ggpipe LABEL' "
                         "(repeatable), e.g. 'split prompts=--split prompts'")
    ap.add_argument("--no-llamacpp", action="store_true", help="ggpipe only")
    ap.add_argument("-o", "--output", type=Path)
    a = ap.parse_args()
    default_prompts, n_req, n_out, (ranks, threads) = WORKLOADS[a.workload]
    model = str(resolve(a.model))
    items = load_prompts(a.prompts or HERE / "prompts" / default_prompts)[:n_req]
    lengths = prompt_lengths(model, items)
    if n_req is None:   # ``first``: the closest pair, the longer first
        i, j = min(((i, j) for i in range(len(items)) for j in range(len(items)) if i != j
                    and lengths[i] >= lengths[j]), key=lambda ij: lengths[ij[0]] - lengths[ij[1]])
        items, lengths = [items[i], items[j]], [lengths[i], lengths[j]]
    npp = round(statistics.mean(lengths))
    cores = ranks * threads
    n_layer = read_model_info(Path(model)).n_layer
    long_item = load_prompts(HERE / "prompts" / "long2000.jsonl")[0]
    print(f"{a.workload}: {len(items)} requests, prompts of {min(lengths)}-{max(lengths)} tokens (mean {npp}), "
          f"{n_out} out; ggpipe {ranks} rank(s) x {threads} thread(s), llama.cpp {cores} thread(s)", flush=True)
    longest = max(lengths + ([2100] if a.workload == "arrival" else []))
    ctx_slot = 256 * (-(-(longest + n_out + 64) // 256))     # every system gets these KV cells per sequence
    n_slots = len(items) + (a.workload == "arrival")     # a slot for the long request too
    extra = a.extra.split() + ["-fa", a.flash_attn, "-c", str(ctx_slot * n_slots)]
    variants = {}
    for v in a.variant:
        label, sep, args = v.partition("=")
        if not sep or not label.strip():
            raise SystemExit(f"--variant {v!r}: give LABEL=ARGS")
        variants[f"ggpipe {label.strip()}"] = args.split()
    systems = ([("ggpipe", None)] + [(name, "variant") for name in variants]
               + ([("ggpipe (before)", a.before)] if a.before else []))
    if not a.no_llamacpp:
        if a.workload in ("short", "long", "long2"):
            systems.append(("llama-batched-bench" + (" --rpc" if a.workload == "long2" else ""), "bb"))
        if a.workload != "long2":
            systems.append(("llama-server", "server"))
    rows = []
    for rnd in range(a.rounds):
        for name, kind in systems[rnd % len(systems):] + systems[:rnd % len(systems)]:
            if kind == "bb":
                rpc = RpcServer(1) if a.workload == "long2" else None
                try:
                    r = batched_bench(model, len(items), npp, n_out, 1 if rpc else cores, a.flash_attn, n_layer,
                                      ctx_slot * len(items), rpc)
                finally:
                    if rpc is not None:
                        rpc.stop()
            else:
                port = free_port()
                srv = (llama_server(model, n_slots, n_out, cores, port, ctx_slot, a.flash_attn)
                       if kind == "server" else
                       ggpipe_server(model, ranks, threads, n_slots, n_out, port, extra + variants.get(name, []),
                                     None if kind == "variant" else kind))
                fields = {"ignore_eos": True} if kind == "server" else {}
                try:
                    if a.workload == "first":
                        r = first_requests(port, items)
                    elif a.workload == "arrival":
                        r = arrival(port, items, long_item, n_out, fields)
                    else:
                        r = burst(port, items, n_out, fields)
                finally:
                    srv.stop()
            rows.append({"system": name, "round": rnd, **r})
            print(f"round {rnd} {name:28s} " + "  ".join(f"{k} {v}" for k, v in r.items()), flush=True)
    summary = summarize(rows)
    print(summary)
    if a.output:
        a.output.mkdir(parents=True, exist_ok=True)
        keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("system", "round"), k))
        with open(a.output / "results.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        (a.output / "summary.md").write_text(summary, encoding="utf-8")


def summarize(rows: list[dict]) -> str:
    """Medians over rounds per system, and ggpipe's over the first llama.cpp system's."""
    systems = list(dict.fromkeys(r["system"] for r in rows))
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in ("system", "round")]
    med = {s: {k: statistics.median([r[k] for r in rows if r["system"] == s and r.get(k) is not None] or [0])
               for k in keys} for s in systems}
    lines = ["| system | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    lines += [f"| {s} | " + " | ".join(f"{med[s][k]:g}" for k in keys) + " |" for s in systems]
    peer = next((s for s in systems if not s.startswith("ggpipe")), None)
    if peer:
        for s in (s for s in systems if s.startswith("ggpipe")):
            for k in ("tokens_per_s", "last_first_token_s", "ttft_p50_ms", "ttft_p90_ms"):
                if k in med[s] and med[peer].get(k):
                    lines.append(f"{s} / {peer} {k}: {med[s][k] / med[peer][k]:.2f}x")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
