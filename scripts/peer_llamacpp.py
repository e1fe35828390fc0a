"""Peer comparison: llama.cpp's own single-node programs on the same GGUFs,
prompts, token counts and cores as ``ggpipe bench``.

    python scripts/peer_llamacpp.py build                    # once: several minutes on 2 cores
    python scripts/peer_llamacpp.py build --llamafile off    # the same without llamafile's sgemm
    python scripts/peer_llamacpp.py run -m smollm2-goliath-40l-f32 -md smollm2-135m \\
        -n 128 --threads 1,2 -o results/bench          # appends rows to results/bench/peer.csv

``build`` downloads the sdist of the pinned ``llama-cpp-python==0.3.36`` with
pip (``pip download --no-binary :all: --no-deps``), unpacks it and builds
only the targets ``llama-completion``, ``llama-speculative-simple``,
``ggml-rpc-server`` (``GGML_RPC=ON``), ``llama-batched-bench``,
``llama-server`` (scripts/bench_parallel.py runs these two) and
``llama-bench`` (scripts/bench_kernels.py) of its
vendored llama.cpp with cmake (Release, ``-march=native`` as llama-cpp-python,
AMX off: ``GGML_AMX_TILE/INT8/BF16=OFF`` and ``-mno-amx-*``, see
NOTES-llamacpp), in a cache directory outside the repository
(``$GGPIPE_PEER_DIR``, default ``~/.cache/ggpipe/peer-llamacpp``). A
finished build is reused. ``build`` alone is llama.cpp's default build
(llamafile's sgemm on: faster F32/F16 batches), in ``build/``; ``build
--llamafile off`` builds ggpipe's reference configuration
(``-DGGML_LLAMAFILE=OFF``, the kernels of ggpipe's ``--exact`` build)
into ``build-llamafile-off/``. ``run`` uses the default build, the kernels
ggpipe's default install runs.

``run`` renders each prompt of the prompt set with the target's chat template
(exactly the text ``ggpipe bench`` feeds ggpipe), writes it to a file and runs

* ``llama-completion -m TARGET -f PROMPT -n N --ignore-eos --temp 0 -t T
  -no-cnv --no-warmup`` (plain single-node decoding); tokens/s is
  llama.cpp's "eval time" figure (generated tokens after the first, per
  second of decoding: the same definition as ggpipe's tokens/s);
* ``llama-speculative-simple -m TARGET -md DRAFT ... --spec-type draft-simple
  --spec-draft-n-max 6`` (its
  synchronous speculative decoding; tokens/s from its "decoded N tokens in S
  seconds" line, which includes the first decoded token).

* ``llama-completion ... --rpc 127.0.0.1:PORT -ngl L/2`` with a local
  ``ggml-rpc-server -t T``: llama.cpp's own way across nodes (RPC), 2
  processes x T threads, the last half of the layers on the server (mode
  ``llama.cpp rpc``, ``ranks`` 2; ``--no-rpc`` skips it).

The extra buffer types stay on (repacked weights), as in ggpipe's stages;
the build has no AMX, which ggpipe leaves out too. The rows go to ``peer.csv`` in the bench's
results directory with the same columns as ``results.csv``, ``mode``
``llama.cpp`` / ``llama.cpp speculative``, ``ranks`` 1 and ``threads`` T;
``ggpipe bench --plots-only -o DIR`` draws them beside ggpipe's.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = "0.3.36"
TARGETS = ("llama-completion", "llama-speculative-simple", "ggml-rpc-server", "llama-batched-bench", "llama-server",
           "llama-bench")
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF", "-DGGML_RPC=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON",
    "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
]


def peer_dir() -> Path:
    return Path(os.environ.get("GGPIPE_PEER_DIR", Path.home() / ".cache" / "ggpipe" / "peer-llamacpp"))


def build_dir(llamafile: bool = True) -> Path:
    """Where a build lives: ``build`` for llama.cpp's default (llamafile's
    sgemm on), ``build-llamafile-off`` for ggpipe's reference configuration
    (``-DGGML_LLAMAFILE=OFF``, as scripts/install_exact.sh builds llama-cpp-python)."""
    return peer_dir() / ("build" if llamafile else "build-llamafile-off")


def bin_path(name: str, llamafile: bool = True) -> Path:
    return build_dir(llamafile) / "bin" / name


def sh(cmd: list[str], **kw) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def build(jobs: int, llamafile: bool = True) -> None:
    """Download the pinned sdist and build the peer programs (idempotent), with
    llamafile's sgemm (llama.cpp's default) or without it (ggpipe's build)."""
    d = peer_dir()
    d.mkdir(parents=True, exist_ok=True)
    if all(bin_path(t, llamafile).exists() for t in TARGETS):
        print(f"already built: {bin_path(TARGETS[0], llamafile).parent}")
        return
    src = d / f"llama_cpp_python-{VERSION}"
    if not src.exists():
        sdist = d / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.exists():
            sh([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                f"llama-cpp-python=={VERSION}", "-d", str(d)])
        with tarfile.open(sdist) as tf:
            tf.extractall(d, filter="data")
    cpp = src / "vendor" / "llama.cpp"
    gen = ["-G", "Ninja"] if subprocess.run(["which", "ninja"], capture_output=True, check=False).returncode == 0 else []
    out = build_dir(llamafile)
    sh(["cmake", "-S", str(cpp), "-B", str(out), *gen, *CMAKE_FLAGS, f"-DGGML_LLAMAFILE={'ON' if llamafile else 'OFF'}"])
    sh(["cmake", "--build", str(out), "-j", str(jobs), "--target", *TARGETS])
    print(f"built: {', '.join(str(bin_path(t, llamafile)) for t in TARGETS)}")


_EVAL = re.compile(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs.*?([\d.]+) tokens per second")
_SPEC = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
_ACCEPT = re.compile(r"accept\s*=\s*([\d.]+)%")


def parse_completion(log: str) -> dict:
    """tokens/s and ITL from llama-completion's perf print (the context's
    'eval time' line, not the sampler's 'prompt eval time')."""
    for line in log.splitlines():
        if "eval time" in line and "prompt eval" not in line:
            m = _EVAL.search(line)
            if m:
                ms, runs, tps = float(m.group(1)), int(m.group(2)), float(m.group(3))
                return {"tokens_per_s": tps, "itl_mean_ms": ms / runs if runs else None, "n_runs": runs}
    raise RuntimeError("no 'eval time' line in llama-completion's output:\n" + log[-2000:])


def parse_speculative(log: str) -> dict:
    m = _SPEC.search(log)
    if not m:
        raise RuntimeError("no 'decoded N tokens' line in llama-speculative-simple's output:\n" + log[-2000:])
    n, s, tps = int(m.group(1)), float(m.group(2)), float(m.group(3))
    a = _ACCEPT.search(log)
    return {"tokens_per_s": tps, "itl_mean_ms": 1e3 * s / n if n else None,
            "acceptance_rate": float(a.group(1)) / 100 if a else None}


def run(a) -> None:
    from ggpipe.bench.prompts import load_prompts, render_prompts
    from ggpipe.models.gguf_info import read_model_info
    from ggpipe.models.registry import resolve

    for t in TARGETS:
        if not bin_path(t).exists():
            raise SystemExit(f"{bin_path(t)} missing: run `python scripts/peer_llamacpp.py build` first")
    target, draft = str(resolve(a.model)), str(resolve(a.draft_model)) if a.draft_model else None
    prompts = load_prompts(a.prompts)
    texts = render_prompts(target, prompts, chat=not a.no_chat)
    out = Path(a.output)
    (out / "peer").mkdir(parents=True, exist_ok=True)
    rows = []
    n_layer = read_model_info(target).n_layer
    for t in [int(x) for x in a.threads.split(",")]:
        rpc = None if a.no_rpc else RpcServer(t)
        try:
            _run_thread_count(a, target, draft, prompts, texts, out, t, rpc, n_layer, rows)
        finally:
            if rpc is not None:
                rpc.stop()
    print(f"wrote {out / 'peer.csv'}")


class RpcServer:
    """A local ``ggml-rpc-server`` (127.0.0.1, a free port, ``threads``
    threads): the second process of llama.cpp's RPC pipeline."""

    def __init__(self, threads: int):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.addr = f"127.0.0.1:{port}"
        self.proc = subprocess.Popen([str(bin_path("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port),
                                      "-t", str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _run_thread_count(a, target, draft, prompts, texts, out, t, rpc, n_layer, rows) -> None:
    """Every prompt through every peer program at ``t`` threads; rows appended to ``rows`` and peer.csv."""
    for p, text in zip(prompts, texts):
        pf = out / "peer" / f"prompt-{p['id']}.txt"
        pf.write_text(text, encoding="utf-8")
        common = ["-f", str(pf), "-n", str(a.n), "--ignore-eos", "--temp", "0", "-t", str(t), "-c", "2048",
                  "-s", "1"]
        progs = [("llama.cpp", [str(bin_path("llama-completion")), "-m", target, *common, "-no-cnv",
                                "--no-display-prompt", "--no-warmup"], parse_completion)]
        if rpc is not None:  # 2 processes x t threads: the last half of the layers on the RPC server
            progs.append(("llama.cpp rpc", [str(bin_path("llama-completion")), "-m", target, *common, "-no-cnv",
                                            "--no-display-prompt", "--no-warmup", "--rpc", rpc.addr,
                                            "-ngl", str(n_layer // 2)], parse_completion))
        if draft:
            progs.append(("llama.cpp speculative",
                          [str(bin_path("llama-speculative-simple")), "-m", target, "-md", draft, *common,
                           "-td", str(t), "--spec-type", "draft-simple", "--spec-draft-n-max", str(a.draft_max)],
                          parse_speculative))
        for mode, cmd, parse in progs:
            t0 = time.perf_counter()
            pr = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False,
                                timeout=1800)
            wall = time.perf_counter() - t0
            if pr.returncode != 0:
                raise SystemExit(f"failed ({pr.returncode}): {' '.join(cmd)}\n{pr.stderr[-2000:]}")
            r = parse(pr.stdout + pr.stderr)
            row = {"mode": mode, "ranks": 2 if mode == "llama.cpp rpc" else 1, "threads": t, "link": "none",
                   "prompt": p["id"], "n": a.n,
                   "tokens_per_s": r["tokens_per_s"], "itl_mean_ms": r.get("itl_mean_ms"),
                   "acceptance_rate": r.get("acceptance_rate"), "wall_s": round(wall, 2),
                   "command": " ".join(cmd)}
            print(f"  {mode:22s} t={t} {p['id']:10s} {r['tokens_per_s']:6.1f} tok/s", flush=True)
            rows.append(row)
            write_rows(out / "peer.csv", rows)  # after every run: an interrupted sweep keeps its rows


def write_rows(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download the pinned sdist and build the peer programs")
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    b.add_argument("--llamafile", choices=("on", "off"), default="on",
                   help="llamafile's sgemm: on (llama.cpp's default build, in build/) or off (ggpipe's reference "
                   "configuration, as scripts/install_exact.sh builds llama-cpp-python; in build-llamafile-off/)")
    r = sub.add_parser("run", help="run the peers and write DIR/peer.csv")
    r.add_argument("-m", "--model", required=True)
    r.add_argument("-md", "--draft-model", default=None)
    r.add_argument("-n", type=int, default=128)
    r.add_argument("--threads", default="1,2", help="thread counts to run (the cores ggpipe's ranks use)")
    r.add_argument("--prompts", default="default", help="prompt set name or JSONL path")
    r.add_argument("--no-chat", action="store_true", help="feed prompts raw, without the chat template")
    r.add_argument("--draft-max", type=int, default=6, help="llama-speculative-simple's --spec-draft-n-max (ggpipe's --draft)")
    r.add_argument("--no-rpc", action="store_true", help="skip the llama.cpp RPC rows (2 processes)")
    r.add_argument("-o", "--output", default="results/bench")
    a = ap.parse_args()
    if a.cmd == "build":
        build(a.jobs, a.llamafile == "on")
    else:
        run(a)


if __name__ == "__main__":
    main()
