"""Prompt processing and generation speed of ggpipe against llama.cpp's own
``llama-bench`` (llama.cpp's default build, repacking on), interleaved rounds,
on the same models, threads and prompt length; and a long prompt through
2 ranks x 1 thread against one rank x 2 threads.

    python scripts/peer_llamacpp.py build          # once: llama-bench of llama.cpp's default build
    python scripts/bench_kernels.py -m smollm2-goliath-40l,/path/q4_0.gguf --rounds 3 -o results/kernels
    python scripts/bench_kernels.py ... --exact-python /path/venv-exact/bin/python   # adds ggpipe --exact rows

Rows, per model and round (the order rotates each round):

* ``ggpipe``: ``ggpipe batch --parallel 1`` (one request at a time) in one process (``-t THREADS``) over
  ``--requests`` prompts of about ``--prompt-tokens`` tokens each (distinct
  beginnings, so no KV cells are reused), ``-n --gen-tokens`` greedy tokens
  each, ``--ignore-eos``. The first request warms the page cache and is left
  out; prompt tok/s is each request's prompt tokens over its ``prompt_s``,
  generation tok/s its ``tokens_per_s``, medians over the requests.
* ``ggpipe --exact``: the same with ``--exact``, run by another venv's python
  whose llama-cpp-python is built without llamafile's sgemm.
* ``llama-bench``: ``llama-bench -m M -t THREADS -p P -n 0 -fa FA -r 2 -o json`` (prompt
  processing) and ``-p 0 -n N -d P`` (generation at the KV depth where ggpipe's
  requests generate); P: the ggpipe prompts' median token count. ggpipe runs
  with the context llama-bench's generation test gives itself (``-c``: P + N,
  rounded up to 256 cells; ``--ctx`` sets another): without flash attention llama.cpp keeps
  V transposed, rows ``-c`` cells apart, and a larger context costs a few
  percent of generation speed in both programs.
* with ``--long``: one ``--long-tokens`` prompt (default 1,700) through
  ``mpiexec -n 2 ggpipe batch -t 1`` and through one rank with ``-t 2``
  (prompt tok/s each, 3 requests, the first left out).

The report: per model, the median over rounds of each row, and the ratios
ggpipe / llama-bench (and 2 ranks / 1 rank). Nothing is tuned on the prompts:
they are built from the held-out sets (scripts/prompts/holdout16.jsonl and
many16.jsonl).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from peer_llamacpp import bin_path  # noqa: E402

from ggpipe.child_process import child_env, ggpipe_command  # noqa: E402


def _texts() -> list[str]:
    out = []
    for name in ("holdout16.jsonl", "many16.jsonl"):
        out += [json.loads(ln)["prompt"] for ln in (ROOT / "scripts" / "prompts" / name).read_text().splitlines() if ln]
    return out


def prompts(model: Path, n: int, tokens: int) -> tuple[list[str], int]:
    """``n`` prompts of about ``tokens`` tokens (the model's tokenizer; cut
    at a word), each starting with a different held-out prompt, the others
    joined after it in rotation; and their median token count."""
    from ggpipe.runtime.llama import lib  # noqa: PLC0415
    from ggpipe.runtime.vocab import Vocab  # noqa: PLC0415

    L = lib()
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    m = L.llama_model_load_from_file(str(model).encode(), mp)
    vocab = Vocab(m, L.llama_model_get_vocab(m))
    texts = _texts()
    out, counts = [], []
    for i in range(n):
        words: list[str] = []
        k = i
        while len(vocab.tokenize(" ".join(words))) < tokens:
            words += texts[k % len(texts)].split()
            k += 1
        while len(vocab.tokenize(" ".join(words))) > tokens:
            words.pop()
        out.append(" ".join(words))
        counts.append(len(vocab.tokenize(out[-1])))
    L.llama_model_free(m)
    return out, int(statistics.median(counts))


def run_batch(python: str, model: Path, texts: list[str], threads: int, gen: int, ranks: int | None,
              extra: list[str], workdir: Path, ctx: int = 4096) -> dict:
    """One ``ggpipe batch`` job with ``-c ctx``; returns medians (first request left out)."""
    req = workdir / "req.jsonl"
    out = workdir / "out.jsonl"
    out.unlink(missing_ok=True)
    req.write_text("".join(json.dumps({"id": i, "prompt": t, "n": gen}) + "\n" for i, t in enumerate(texts)))
    cmd = [*ggpipe_command(python), "batch", str(req), "-o", str(out), "-m", str(model), "-t", str(threads),
           "-c", str(ctx), "--parallel", "1", "--ignore-eos", "--no-progress", *extra]
    if ranks:
        cmd = [str(Path(python).parent / "mpiexec"), "-n", str(ranks), *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=workdir, env=child_env())
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    recs = [json.loads(ln) for ln in out.read_text().splitlines()][1:]
    pp = [(r["n_prompt"] - r.get("n_reused", 0)) / r["metrics"]["prompt_s"] for r in recs]
    tg = [r["metrics"]["tokens_per_s"] for r in recs if r["metrics"]["tokens_per_s"]]
    return {"pp": statistics.median(pp), "tg": statistics.median(tg) if tg else None,
            "n_prompt": statistics.median(r["n_prompt"] for r in recs), "tokens": [r["tokens"] for r in recs]}


def run_llama_bench(model: Path, threads: int, p: int, n: int, fa: str) -> dict:
    """llama-bench's prompt processing of ``p`` tokens (from an empty cache)
    and its generation of ``n`` tokens after ``p`` cells (``-d p``: at the
    KV depth where ggpipe's requests generate)."""
    def one(*args) -> float:
        cmd = [str(bin_path("llama-bench")), "-m", str(model), "-t", str(threads), *args, "-fa", fa, "-r", "2",
               "-o", "json"]
        return json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True).stdout)[0][
            "avg_ts"]

    return {"pp": one("-p", str(p), "-n", "0"), "tg": one("-p", "0", "-n", str(n), "-d", str(p))}


def bench_ctx(p: int, n: int) -> int:
    """The context llama-bench gives its generation test of ``n`` tokens at
    depth ``p`` (``-p 0 -n n -d p``: ``n_prompt + n_gen + n_depth`` = ``p +
    n``, rounded up to llama.cpp's 256-cell padding): ggpipe's ``-c`` in the
    default rows, so both generate over a KV cache of the same size (without
    flash attention llama.cpp keeps V transposed, rows ``-c`` cells apart).
    Its prompt test (``-p p``) gets ``p`` rounded up: the same size unless
    ``p + n`` crosses a 256-cell boundary."""
    return -(-(p + n) // 256) * 256


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--models", required=True, help="comma-separated registry names or GGUF paths")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=298)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="prompts per ggpipe job (the first is a warm-up)")
    ap.add_argument("--exact-python", help="a python whose llama-cpp-python is built without llamafile's sgemm")
    ap.add_argument("--long", action="store_true", help="also a long prompt at 2 ranks x 1 thread vs 1 x 2")
    ap.add_argument("--long-tokens", type=int, default=1700)
    ap.add_argument("--long-only", action="store_true", help="only the long-prompt rows")
    ap.add_argument("--no-llama-bench", action="store_true")
    ap.add_argument("-fa", "--flash-attn", default="off", choices=["off", "on", "auto"],
                    help="flash attention in every row (ggpipe's default off; llama-bench's own default is auto)")
    ap.add_argument("-c", "--ctx", type=int, default=0,
                    help="ggpipe's -c (default: the context llama-bench gives itself, see bench_ctx)")
    ap.add_argument("--also-ctx", type=int, default=0,
                    help="add a row of ggpipe with this -c (e.g. 2048, its default) beside the matched context")
    ap.add_argument("-o", "--out", type=Path, default=Path("results/kernels"))
    a = ap.parse_args()

    from ggpipe.models.registry import resolve  # noqa: PLC0415

    models = [resolve(m.strip()) for m in a.models.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as td:
        wd = Path(td)
        texts = {m: prompts(m, a.requests, a.prompt_tokens) for m in models}
        long = {m: prompts(m, 3, a.long_tokens)[0] for m in models} if a.long or a.long_only else {}
        fa = ["-fa", a.flash_attn]
        kinds = ([] if a.long_only else ["ggpipe"]) + ([] if a.no_llama_bench or a.long_only else ["llama-bench"])
        if a.exact_python and not a.long_only:
            kinds.append("ggpipe --exact")
        if a.also_ctx and not a.long_only:
            kinds.append(f"ggpipe -c {a.also_ctx}")
        if a.long or a.long_only:
            kinds += ["long 1x2", "long 2x1"]
        for r in range(a.rounds):
            for m in models:
                order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
                for kind in order:
                    ctx = a.ctx or bench_ctx(texts[m][1], a.gen_tokens)
                    if kind == "ggpipe":
                        res = run_batch(sys.executable, m, texts[m][0], a.threads, a.gen_tokens, None, fa, wd, ctx)
                    elif kind == "ggpipe --exact":
                        res = run_batch(a.exact_python, m, texts[m][0], a.threads, a.gen_tokens, None,
                                        [*fa, "--exact"], wd, ctx)
                    elif kind.startswith("ggpipe -c "):
                        res = run_batch(sys.executable, m, texts[m][0], a.threads, a.gen_tokens, None, fa, wd,
                                        a.also_ctx)
                    elif kind == "llama-bench":
                        res = run_llama_bench(m, a.threads, texts[m][1], a.gen_tokens, a.flash_attn)
                    elif kind == "long 1x2":
                        res = run_batch(sys.executable, m, long[m], 2, 4, None, fa, wd)
                    else:
                        res = run_batch(sys.executable, m, long[m], 1, 4, 2, fa, wd)
                    row = {"round": r, "model": m.name, "kind": kind, "pp": res["pp"], "tg": res.get("tg")}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    (a.out / "kernels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(report(rows))
    return 0


def report(rows: list[dict]) -> str:
    """Markdown: per model and row, medians over rounds, and the ratios."""
    def med(model, kind, key):
        v = [r[key] for r in rows if r["model"] == model and r["kind"] == kind and r[key] is not None]
        return statistics.median(v) if v else None

    lines = ["| model | row | prompt tok/s | generation tok/s | prompt / llama-bench | generation / llama-bench |",
             "|---|---|---:|---:|---:|---:|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        ref_pp, ref_tg = med(model, "llama-bench", "pp"), med(model, "llama-bench", "tg")
        for kind in dict.fromkeys(r["kind"] for r in rows if r["model"] == model):
            pp, tg = med(model, kind, "pp"), med(model, kind, "tg")
            rp = f"{pp / ref_pp:.2f}x" if ref_pp and pp and not kind.startswith("long") else ""
            rt = f"{tg / ref_tg:.2f}x" if ref_tg and tg and not kind.startswith("long") else ""
            lines.append(f"| {model} | {kind} | {pp:.1f} | {'' if tg is None else f'{tg:.1f}'} | {rp} | {rt} |")
        l1, l2 = med(model, "long 1x2", "pp"), med(model, "long 2x1", "pp")
        if l1 and l2:
            lines.append(f"| {model} | long prompt: 2 ranks x 1 thread / 1 rank x 2 threads | | | {l2 / l1:.2f}x | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
