"""Recipes for tiny random-weight GGUF models of many llama.cpp architectures.

    python scripts/tiny_recipes.py build        # once: builds llama.cpp's test-llama-archs
    python scripts/tiny_recipes.py dump         # writes tests/data/tiny_archs/<stem>.json

``build`` builds llama.cpp's own fixture generator ``test-llama-archs``
(tests/test-llama-archs.cpp of the llama.cpp vendored in the pinned
llama-cpp-python sdist) in the peer build directory of
scripts/peer_llamacpp.py: its ``build()`` downloads and unpacks the sdist
(and builds the peer programs, once), then the same directory is configured
again with the same cmake flags but ``-DLLAMA_BUILD_TESTS=ON`` and only the
generator target is built. A finished build is reused.

``dump`` runs ``test-llama-archs -a '^(ARCH|...)$' -o TMP`` (2-layer models,
3 for nemotron_h, random F32 weights) and reads each GGUF it wrote with
``gguf.GGUFReader`` into a JSON recipe: every metadata field except the
reader's virtual ``GGUF.*`` ones, in file order, as ``[key, value type,
array sub-type or null, value]`` (GGUFValueType names), and every tensor as
``[name, shape in GGUF order (ne0 first), GGMLQuantizationType name]``.
No weights are kept: tests/tiny_models.py writes a GGUF of any depth from a
recipe with fresh random weights. Non-finite floats are stored as Python's
json does (``-Infinity``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import peer_llamacpp as peer

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "tests" / "data" / "tiny_archs"
TARGET = "test-llama-archs"
ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen3next", "qwen35", "phi3", "gemma2", "gemma3", "cohere2",
         "deepseek2", "glm4moe", "nemotron_h", "granitehybrid", "gpt-oss", "lfm2", "mistral3")
TEST_FLAGS = [("-DLLAMA_BUILD_TESTS=ON" if f.startswith("-DLLAMA_BUILD_TESTS=") else f) for f in peer.CMAKE_FLAGS]


def build(jobs: int) -> Path:
    """Build ``test-llama-archs`` in the peer build directory (idempotent)."""
    exe = peer.bin_path(TARGET)
    if exe.exists():
        print(f"already built: {exe}")
        return exe
    peer.build(jobs)  # downloads and unpacks the pinned sdist; builds the peer programs once
    d = peer.peer_dir()
    cpp = d / f"llama_cpp_python-{peer.VERSION}" / "vendor" / "llama.cpp"
    if not cpp.exists():
        raise SystemExit(f"{cpp} missing: remove {d / 'build'} and run this again")
    # the same generator choice as peer.build(): cmake refuses to switch generators in one build directory
    gen = ["-G", "Ninja"] if subprocess.run(["which", "ninja"], capture_output=True, check=False).returncode == 0 else []
    peer.sh(["cmake", "-S", str(cpp), "-B", str(d / "build"), *gen, *TEST_FLAGS])
    peer.sh(["cmake", "--build", str(d / "build"), "-j", str(jobs), "--target", TARGET])
    print(f"built: {exe}")
    return exe


def _py(v):
    """numpy scalars and lists of them -> plain Python values."""
    if isinstance(v, list):
        return [_py(x) for x in v]
    return v.item() if hasattr(v, "item") else v


def recipe(path: Path, source: str) -> dict:
    """The recipe of one GGUF (see the module docstring)."""
    import gguf

    r = gguf.GGUFReader(path)
    meta = []
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = None
        if vtype == gguf.GGUFValueType.ARRAY:
            # parts: name length, name, value type, item type, length, items...; item type also for empty arrays
            sub = gguf.GGUFValueType(int(f.parts[3][0])).name
        meta.append([f.name, vtype.name, sub, _py(f.contents())])
    tensors = [[t.name, [int(x) for x in t.shape], t.tensor_type.name] for t in r.tensors]
    arch = r.fields["general.architecture"].contents()
    return {"arch": arch, "source": source, "metadata": meta, "tensors": tensors}


def dumps(rec: dict) -> str:
    """Compact JSON, one metadata field or tensor a line."""
    head = ",\n".join(f"  {json.dumps(k)}: {json.dumps(rec[k])}" for k in ("arch", "source"))
    body = [f'  "{k}": [\n' + ",\n".join("    " + json.dumps(x, separators=(",", ":")) for x in rec[k]) + "\n  ]"
            for k in ("metadata", "tensors")]
    return "{\n" + head + ",\n" + ",\n".join(body) + "\n}\n"


def dump(archs: list[str], out_dir: Path) -> list[Path]:
    """Run the generator for ``archs`` and write one recipe per GGUF it wrote."""
    import llama_cpp

    exe = peer.bin_path(TARGET)
    if not exe.exists():
        raise SystemExit(f"{exe} missing: run `python scripts/tiny_recipes.py build` first")
    regex = "^(" + "|".join(archs) + ")$"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(exe), "-a", regex, "-o", tmp]
        print("+ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
        source = (f"{TARGET} (tests/test-llama-archs.cpp of the llama.cpp vendored in llama-cpp-python "
                  f"{peer.VERSION}; llama_cpp {llama_cpp.__version__} installed), "
                  f"command: {TARGET} -a '{regex}' -o DIR; via scripts/tiny_recipes.py dump")
        for g in sorted(Path(tmp).glob("*.gguf")):
            p = out_dir / f"{g.stem}.json"
            p.write_text(dumps(recipe(g, source)), encoding="utf-8")
            print(f"  {p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}  {p.stat().st_size / 1024:.1f} KiB")
            written.append(p)
    if not written:
        raise SystemExit(f"the generator wrote no GGUF for {regex}")
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help=f"build {TARGET} in the peer build directory")
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    d = sub.add_parser("dump", help="run the generator and write JSON recipes")
    d.add_argument("-a", "--arch", action="append", help=f"an architecture (repeatable; default: {', '.join(ARCHS)})")
    d.add_argument("-o", "--output", type=Path, default=OUT_DIR)
    a = ap.parse_args()
    if a.cmd == "build":
        build(a.jobs)
    else:
        dump(a.arch or list(ARCHS), a.output)


if __name__ == "__main__":
    sys.exit(main())
