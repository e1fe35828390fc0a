"""Side-by-side speculation benchmark: llama.cpp's own programs and ggpipe's
modes and proposers, all rows interleaved in one run, on the same GGUFs,
rendered prompts, token counts and cores.

    python scripts/peer_llamacpp.py build                      # once: llama.cpp tools incl. ggml-rpc-server
    git worktree add /tmp/ggpipe-before b3b22e0 && \\
        (cd /tmp/ggpipe-before && python setup.py -q build_ext --inplace)   # optional "before" row
    python scripts/bench_side_by_side.py -o results/side --repeat 3 -n 256 --before /tmp/ggpipe-before
    python scripts/bench_side_by_side.py -o results/side --report      # the tables again, from side.csv

Rows (``--rows`` picks a subset, by name):

* ``llama.cpp t1 fa-off``, ``t1 fa-auto``, ``t2 fa-off``, ``t2 fa-auto``:
  ``llama-completion`` with 1 or 2 threads, flash attention off or llama.cpp's
  default (auto);
* ``llama.cpp rpc 2x1``: ``llama-completion -t 1`` with the last half of the
  layers on a local ``ggml-rpc-server -t 1`` (2 processes x 1 thread, TCP on
  127.0.0.1);
* ``llama-speculative-simple t2``: llama.cpp's synchronous speculative decoding
  (draft-simple, 6 tokens), 2 threads;
* ``ggpipe iterative``, ``ggpipe speculative``, ``ggpipe pipeinfer``: 2 ranks x
  1 thread (speculative modes: target on rank 0, draft on rank 1);
* ``ggpipe iterative (before)``, ``ggpipe speculative (before)``, ``ggpipe
  pipeinfer (before)``: the same from another checkout (``--before``, run
  with ``PYTHONPATH`` pointing at it), each right after its own row;
* ``ggpipe ngram (pipeinfer)``, ``ggpipe ngram (speculative)``: ``--spec-type
  ngram`` in either mode, 2 ranks x 1 thread, both ranks target stages, no
  draft model;
* ``ggpipe staged (pipeinfer)``, ``ggpipe staged (speculative)``: ``--spec-type
  staged`` (the draft model checking n-gram guesses, Staged SD's
  draft-of-draft), target on rank 0, draft on rank 1;
* ``ggpipe vote (speculative)``: ``--spec-type vote`` (Minions' vote of the
  draft model and the n-gram lookup);
* ``ggpipe pipedec``: ``--mode pipedec`` (PipeDec's prediction tree, its
  default chain), target on rank 0, draft on rank 1 (at 2 ranks it has one
  target stage to fill: scripts/experiments/bench_pipedec.py compares 2-4 ranks);
* ``ggpipe iterative fa-on``, ``ggpipe pipeinfer fa-on``: the same with
  ``-fa on`` (compared for exactness with ``ggpipe iterative fa-on``).

Every round runs each prompt through every row (rows rotated each round, so
no row always follows another); ``--repeat`` rounds. Each ggpipe run's tokens
are compared with ``ggpipe iterative``'s for the same prompt (exactness). The
report gives, per row, the mean over prompts of each prompt's median over
rounds: tokens/s (generated tokens after the first, per second of decoding,
the definition llama.cpp's "eval time" uses), tokens per target pass,
acceptance, draft-rank busy share and TTFT, then one table per prompt.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_llamacpp as peer  # noqa: E402

from ggpipe.child_process import ggpipe_command
from ggpipe.transport.launcher_path import find_launcher  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS_EXTRA = ROOT / "scripts" / "prompts" / "speculation.jsonl"
FIELDS = ["round", "prompt", "row", "tokens_per_s", "ttft_s", "accepted_per_pass", "acceptance_rate",
          "draft_busy_share", "target_passes", "exact", "wall_s", "error"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rows:
    """Builds and parses each row's command."""

    def __init__(self, a, target: str, draft: str, n_layers: int):
        self.a = a
        self.target = target
        self.draft = draft
        self.n_layers = n_layers
        self.rpc = None

    def names(self) -> list[str]:
        names = ["llama.cpp t1 fa-off", "llama.cpp t1 fa-auto", "llama.cpp t2 fa-off", "llama.cpp t2 fa-auto",
                 "llama.cpp rpc 2x1", "llama-speculative-simple t2", "ggpipe iterative", "ggpipe speculative",
                 "ggpipe pipeinfer", "ggpipe ngram (pipeinfer)", "ggpipe ngram (speculative)",
                 "ggpipe staged (pipeinfer)", "ggpipe staged (speculative)", "ggpipe vote (speculative)",
                 "ggpipe pipedec",
                 "ggpipe iterative fa-on", "ggpipe pipeinfer fa-on"]
        if self.a.before:    # the three modes again from the other checkout, each right after its own row
            for row in ("ggpipe iterative", "ggpipe speculative", "ggpipe pipeinfer"):
                names.insert(names.index(row) + 1, f"{row} (before)")
        if self.a.alt_python:
            names += ["ggpipe iterative (alt python)", "ggpipe speculative (alt python)",
                      "ggpipe pipeinfer (alt python)"]
        return names

    # -- llama.cpp ------------------------------------------------------------------

    def _common(self, pf: Path, threads: int) -> list[str]:
        return ["-f", str(pf), "-n", str(self.a.n), "--ignore-eos", "--temp", "0", "-t", str(threads), "-c", "4096",
                "-s", "1"]

    def _completion(self, pf: Path, threads: int, extra: list[str]) -> list[str]:
        return [str(peer.bin_path("llama-completion")), "-m", self.target, *self._common(pf, threads), "-no-cnv",
                "--no-display-prompt", "--no-warmup", *extra]

    def start_rpc(self) -> None:
        port = _free_port()
        self.rpc_addr = f"127.0.0.1:{port}"
        self.rpc = subprocess.Popen([str(peer.bin_path("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port),
                                     "-t", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)

    def stop_rpc(self) -> None:
        if self.rpc is not None:
            self.rpc.terminate()
            try:
                self.rpc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.rpc.kill()

    def run(self, name: str, pf: Path) -> dict:
        t0 = time.perf_counter()
        if name.startswith("llama.cpp rpc"):
            if self.rpc is None:
                self.start_rpc()
            cmd = self._completion(pf, 1, ["--rpc", self.rpc_addr, "-ngl", str(self.n_layers // 2)])
            res = self._llama(cmd, peer.parse_completion)
        elif name.startswith("llama.cpp"):
            threads = 2 if " t2 " in name + " " else 1
            fa = ["-fa", "off"] if "fa-off" in name else []
            res = self._llama(self._completion(pf, threads, fa), peer.parse_completion)
        elif name.startswith("llama-speculative-simple"):
            cmd = [str(peer.bin_path("llama-speculative-simple")), "-m", self.target, "-md", self.draft,
                   *self._common(pf, 2), "--spec-type", "draft-simple", "--spec-draft-n-max", "6"]
            res = self._llama(cmd, peer.parse_speculative)
        else:
            res = self._ggpipe(name, pf)
        res["wall_s"] = time.perf_counter() - t0
        return res

    def _llama(self, cmd: list[str], parse) -> dict:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if p.returncode != 0:
            return {"error": f"exit {p.returncode}: {p.stderr[-300:]}"}
        r = parse(p.stderr + p.stdout)
        return {"tokens_per_s": r["tokens_per_s"], "acceptance_rate": r.get("acceptance_rate")}

    def _ggpipe(self, name: str, pf: Path) -> dict:
        args = ["generate", "-m", self.target, "-f", str(pf), "-n", str(self.a.n), "--ignore-eos", "--json",
                "-t", "1", "-c", "4096"]
        env = dict(os.environ)
        python = sys.executable
        if name.endswith(" (alt python)"):
            # the same ggpipe under another interpreter (e.g. a venv whose llama-cpp-python was built otherwise)
            python = self.a.alt_python
            name = name[: -len(" (alt python)")]
        if name.endswith(" (before)"):      # the same row from the --before checkout
            env["PYTHONPATH"] = str(Path(self.a.before).resolve())
            name = name[: -len(" (before)")]
        if name.startswith("ggpipe iterative"):
            args += ["--mode", "iterative"]
        elif name == "ggpipe speculative":
            args += ["--mode", "speculative", "-md", self.draft]
        elif name == "ggpipe pipedec":
            args += ["--mode", "pipedec", "-md", self.draft]
        elif name.startswith("ggpipe pipeinfer"):
            args += ["--mode", "pipeinfer", "-md", self.draft]
        elif name.startswith(("ggpipe ngram", "ggpipe staged", "ggpipe vote")):
            spec_type = name.split()[1]
            args += ["--mode", "speculative" if "speculative" in name else "pipeinfer", "--spec-type", spec_type]
            if spec_type != "ngram":
                args += ["-md", self.draft]
        if name.endswith(" fa-on"):
            args += ["-fa", "on"]
        launcher = find_launcher("mpiexec") if python == sys.executable else str(Path(python).parent / "mpiexec")
        cmd = [launcher, "-n", "2", *ggpipe_command(python), *args, *self.a.ggpipe_args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False, env=env, cwd="/")
        if p.returncode != 0:
            return {"error": f"exit {p.returncode}: {p.stderr[-300:]}"}
        d = json.loads(p.stdout)
        m, dec = d["metrics"], d.get("decoder") or {}
        busy = [r.get("busy_s", 0.0) / m["total_s"] for r in d["ranks"] if r.get("model") == "draft"]
        return {"tokens_per_s": m["tokens_per_s"], "ttft_s": m["ttft_s"],
                "accepted_per_pass": dec.get("accepted_per_pass", 1.0),
                "acceptance_rate": dec.get("acceptance_rate"),
                "draft_busy_share": busy[0] if busy else None,
                "target_passes": dec.get("verified_runs", dec.get("target_passes")),
                "tokens": d["tokens"]}


def measure(a) -> None:
    from ggpipe.bench.prompts import load_prompts, render_prompts
    from ggpipe.models.gguf_info import read_model_info
    from ggpipe.models.registry import resolve

    for t in peer.TARGETS:
        if not peer.bin_path(t).exists():
            raise SystemExit(f"{peer.bin_path(t)} missing: run `python scripts/peer_llamacpp.py build` first")
    target, draft = str(resolve(a.model)), str(resolve(a.draft_model))
    prompts = (load_prompts(a.prompt_set) if a.prompt_set else
               load_prompts("default") + load_prompts(str(PROMPTS_EXTRA)))
    if a.prompts:
        prompts = [p for p in prompts if p["id"] in a.prompts.split(",")]
    texts = render_prompts(target, prompts)
    out = Path(a.output).resolve()  # the ggpipe rows run with cwd / (no module shadowing)
    (out / "prompts").mkdir(parents=True, exist_ok=True)
    files = {}
    for p, text in zip(prompts, texts):
        files[p["id"]] = out / "prompts" / f"{p['id']}.txt"
        files[p["id"]].write_text(text, encoding="utf-8")
    rows = Rows(a, target, draft, read_model_info(target).n_layer)
    names = rows.names()
    if a.rows:
        names = [n for n in names if n in a.rows.split(",")]
    csv_path = out / "side.csv"
    done = set()
    if csv_path.exists():
        with csv_path.open() as f:
            done = {(int(r["round"]), r["prompt"], r["row"]) for r in csv.DictReader(f) if not r["error"]}
    ref_tokens: dict[str, list[int]] = {}
    tok_path = out / "tokens.json"
    if tok_path.exists():
        ref_tokens = json.loads(tok_path.read_text())
    new = not csv_path.exists()
    try:
        with csv_path.open("a", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            if new:
                w.writeheader()
            total = a.repeat * len(prompts) * len(names)
            k = 0
            for rnd in range(1, a.repeat + 1):
                for p in prompts:
                    order = names[(rnd - 1) % len(names):] + names[:(rnd - 1) % len(names)]
                    for name in order:
                        k += 1
                        if (rnd, p["id"], name) in done:
                            continue
                        res = rows.run(name, files[p["id"]])
                        toks = res.pop("tokens", None)
                        exact = ""
                        if toks is not None:
                            # compared within one setting (flash attention, build)
                            fa = next((x for x in (" fa-on", " (alt python)") if name.endswith(x)), "")
                            key = p["id"] + fa
                            if name == "ggpipe iterative" + fa and key not in ref_tokens:
                                ref_tokens[key] = toks
                                tok_path.write_text(json.dumps(ref_tokens))
                            if key in ref_tokens:
                                exact = int(toks == ref_tokens[key])
                        row = {"round": rnd, "prompt": p["id"], "row": name, "exact": exact, "error": "", **res}
                        w.writerow({k2: row.get(k2, "") for k2 in FIELDS})
                        f.flush()
                        tps = res.get("tokens_per_s")
                        print(f"[{k}/{total}] round {rnd} {p['id']:<13} {name:<28} "
                              f"{tps if tps is None else round(tps, 1)} tok/s {res.get('error', '')}", flush=True)
    finally:
        rows.stop_rpc()


def _med(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def report(out: Path) -> str:
    with (out / "side.csv").open() as f:
        data = [r for r in csv.DictReader(f) if not r["error"]]
    cols = ["tokens_per_s", "accepted_per_pass", "acceptance_rate", "draft_busy_share", "ttft_s"]
    rows = list(dict.fromkeys(r["row"] for r in data))
    prompts = list(dict.fromkeys(r["prompt"] for r in data))

    def val(r, c):
        return float(r[c]) if r.get(c) not in (None, "") else None

    per = {}   # (row, prompt) -> {col: median over rounds}
    for name in rows:
        for p in prompts:
            sel = [r for r in data if r["row"] == name and r["prompt"] == p]
            if sel:
                per[name, p] = {c: _med([val(r, c) for r in sel]) for c in cols}
                per[name, p]["n"] = len(sel)
                per[name, p]["exact"] = sum(r["exact"] == "1" for r in sel), sum(r["exact"] != "" for r in sel)

    def fmt(v, d=1):
        return "" if v is None else f"{v:.{d}f}"

    lines = ["| row | tok/s (mean of prompt medians) | x ggpipe iterative | tokens/pass | acceptance | "
             "draft busy | TTFT ms | exact |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {p: per.get(("ggpipe iterative", p), {}).get("tokens_per_s") for p in prompts}
    for name in rows:
        ps = [p for p in prompts if (name, p) in per]
        m = {c: _med([per[name, p][c] for p in ps]) if c != "tokens_per_s" else
             statistics.mean([per[name, p][c] for p in ps]) for c in cols}
        ratios = [per[name, p]["tokens_per_s"] / base[p] for p in ps if base.get(p)]
        ex = [per[name, p]["exact"] for p in ps]
        exs = f"{sum(e[0] for e in ex)}/{sum(e[1] for e in ex)}" if sum(e[1] for e in ex) else ""
        lines.append(f"| {name} | {fmt(m['tokens_per_s'])} | {fmt(statistics.mean(ratios), 2) if ratios else ''} | "
                     f"{fmt(m['accepted_per_pass'], 2)} | {fmt(m['acceptance_rate'], 2)} | "
                     f"{fmt(m['draft_busy_share'], 2)} | "
                     f"{fmt(m['ttft_s'] * 1e3 if m['ttft_s'] is not None else None, 0)} | {exs} |")
    lines += ["", "Per prompt (median over rounds): tok/s / tokens per pass / acceptance", "",
              "| row | " + " | ".join(prompts) + " |", "|---|" + "---:|" * len(prompts)]
    for name in rows:
        cells = []
        for p in prompts:
            c = per.get((name, p))
            cells.append("" if c is None else " / ".join(
                x for x in (fmt(c["tokens_per_s"]), fmt(c["accepted_per_pass"], 2), fmt(c["acceptance_rate"], 2))
                if x))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", default="results/side")
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32")
    ap.add_argument("-md", "--draft-model", default="smollm2-135m")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    ap.add_argument("--prompts", default=None, help="comma-separated prompt ids (default: all five)")
    ap.add_argument("--prompt-set", default=None,
                    help="a JSONL prompt set instead of the five bench prompts (e.g. scripts/prompts/holdout.jsonl: "
                         "three prompts never used to tune a default)")
    ap.add_argument("--before", default=None,
                    help="another ggpipe checkout for the '(before)' twins of the iterative, speculative and pipeinfer rows")
    ap.add_argument("--alt-python", default=None,
                    help="another venv's python (with ggpipe installed) for the '(alt python)' rows, e.g. one whose "
                         "llama-cpp-python was built with llamafile's sgemm (the default build)")
    ap.add_argument("--ggpipe-args", default="", help="extra arguments for every ggpipe row")
    ap.add_argument("--report", action="store_true", help="only print the tables from side.csv")
    a = ap.parse_args()
    a.ggpipe_args = a.ggpipe_args.split()
    out = Path(a.output)
    if not a.report:
        measure(a)
    text = report(out)
    (out / "report.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
