"""Every row of the bad-input table in docs/ERRORS.md, run for real: one line
on stderr containing the documented message, a non-zero exit, no traceback,
no stdout (and, for the disk-full row, no GGUF left under its final name)."""

from __future__ import annotations

import os
import re
import resource
import shlex
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, mpiexec

pytestmark = pytest.mark.full  # every row as a real ggpipe job, most under mpiexec: 43 s in all

DOC = ROOT / "docs" / "ERRORS.md"


def table_rows() -> list[dict]:
    text = DOC.read_text()
    body = text.split("<!-- bad-input-table -->")[1].split("<!-- /bad-input-table -->")[0]
    rows = []
    for line in body.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rid, _, command, ranks, env, message = cells
        rows.append({"id": rid, "command": command.strip("`"), "ranks": None if ranks == "-" else int(ranks),
                     "env": env, "message": message})
    return rows


ROWS = table_rows()


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2):
    import gguf

    from ggpipe.models.derive import derive_gguf

    d = tmp_path_factory.mktemp("bad-input")
    (d / "truncated.gguf").write_bytes(smollm2.read_bytes()[:1_000_000])
    (d / "notgguf.gguf").write_text("this is not a model\n")
    three = derive_gguf(smollm2, [0, 1, 2], d / "three-layers.gguf")

    def fake(path, arch):
        w = gguf.GGUFWriter(str(path), arch)
        w.add_block_count(4)
        w.add_embedding_length(64)
        w.add_context_length(128)
        w.add_token_list(["a", "b", "c"])
        w.add_tensor("token_embd.weight", np.zeros((3, 64), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    smol_entry = ROOT.joinpath("models.toml").read_text().split("# A \"passthrough")[0]
    bad_registry = d / "bad.toml"
    bad_registry.write_text('[models.a]\narch="llama"\nsize=1\npypi="x==1"\nmember="m.gguf"\n')
    hash_registry = d / "hash.toml"
    hash_registry.write_text(smol_entry + f'\n[models.bad-hash]\narch="llama"\nsize=1\nsha256="{"0" * 64}"\n'
                             'base="smollm2-135m"\nlayers="0"\n')
    cache = d / "cache"
    (cache / "models").mkdir(parents=True)
    os.symlink(smollm2, cache / "models" / "smollm2-135m.gguf")
    long_prompt = d / "long.txt"
    long_prompt.write_text("word " * 300)
    out = d / "out"
    out.mkdir()
    batch_in = d / "batch-in.jsonl"
    batch_in.write_text('{"id": 1, "prompt": "hi"}\n{"id": 2, "prompt": "MPI is"}\n')
    notes = d / "notes.txt"
    notes.write_text("precious data")
    notutf8 = d / "not-utf8.txt"
    notutf8.write_bytes(b"hello \xff\xfe world")
    nested = d / "nested.jsonl"
    nested.write_text("[" * 100000 + "]" * 100000 + "\n")
    from ggpipe.sim.profile import HostProfile, Profile

    profile = d / "profile.json"
    Profile("x", None, [HostProfile("h", mem_bw_Bps=1e10, flops=1e11)]).save(profile)
    bad_agreement = d / "bad-agreement.json"
    Profile("x", "y", [HostProfile("h", mem_bw_Bps=1e10, flops=1e11)], agreement={"rate": 5}).save(bad_agreement)
    blank = d / "blank.txt"
    blank.write_text("\n  \n")
    return {"smollm2": smollm2, "trunc": d / "truncated.gguf", "notgguf": d / "notgguf.gguf", "three": three,
            "gemma": fake(d / "gemma2-fake.gguf", "gemma2"), "othervocab": fake(d / "llama-3-tokens.gguf", "llama"),
            "bad_registry": bad_registry, "hash_registry": hash_registry, "cache": cache,
            "long_prompt": long_prompt, "out": out,
            "batch_in": batch_in, "notes": notes, "notutf8": notutf8, "nested": nested,
            "profile": profile, "bad_agreement": bad_agreement, "blank": blank}


@pytest.mark.mpi
@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_documented_bad_input(row, files):
    fill = {k: str(v) for k, v in files.items()}

    def filled(text: str) -> str:   # only {name} placeholders: a JSON schema's braces stay as they are
        return re.sub(r"\{(\w+)\}", lambda m: fill.get(m.group(1), m.group(0)), text)

    args = [filled(a) for a in shlex.split(row["command"])][1:]  # drop "ggpipe"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    fsize = None
    for kv in row["env"].split():
        k, v = kv.split("=", 1)
        if k == "FSIZE":
            fsize = int(v)
        else:
            env[k] = filled(v)
    cmd = [sys.executable, "-m", "ggpipe", *args]
    if row["ranks"] is not None:
        cmd = [mpiexec(), "-n", str(row["ranks"]), *cmd]

    def limit():
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, preexec_fn=limit)
    assert p.returncode != 0, p.stdout[-500:]
    assert "Traceback" not in p.stderr, p.stderr
    # progress bars (fetching, deriving) may share stderr; exactly one error line
    errors = [ln[ln.index("ggpipe: error: "):] for ln in re.split(r"[\r\n]+", p.stderr) if "ggpipe: error: " in ln]
    assert len(errors) == 1, p.stderr
    others = [ln for ln in re.split(r"[\r\n]+", p.stderr)
              if ln.strip() and "ggpipe: error: " not in ln and not re.match(r"^(deriving|Writing|cutting)", ln)]
    assert not others, p.stderr
    assert row["message"] in errors[0], errors[0]
    if "notes" in row["command"]:
        assert files["notes"].read_text() == "precious data"
    assert not (files["out"] / "newdir").exists()   # outputs are checked before any folder is made
    if row["id"] == "batch-disk-full":
        data = (files["out"] / "results.jsonl").read_bytes()
        assert data == b"", data  # the first record does not fit in 200 bytes: cut back, no half record
    if row["id"] == "disk-full":
        assert not [f for f in files["out"].iterdir() if f.suffix == ".gguf"], list(files["out"].iterdir())
