"""``ggpipe plan`` (layers, weight and KV-cache bytes against the GGUF, host
placement, the memory warning, launcher flags) and the cluster scripts:
``--dry-run`` output of each, real runs of the NUMA script (with and without
numactl) and of the hostfile launcher on this machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from gguf import GGUFReader
from llama_cpp import Llama

from ggpipe.errors import ConfigError
from ggpipe.cluster.plan import launcher_command, parse_bytes, parse_hostfile, place_ranks
from ggpipe.models.gguf_info import read_model_info
from tests.conftest import ROOT, run_ggpipe

SCRIPTS = ROOT / "scripts" / "cluster"
GGPIPE = f"{sys.executable} -m ggpipe"
PROMPT = "The capital of France is"


def script(name: str, args: list[str], env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    e = dict(os.environ, GGPIPE=GGPIPE, PYTHONUNBUFFERED="1")
    e.update(env or {})
    return subprocess.run(["bash", str(SCRIPTS / name), *args], capture_output=True, text=True, cwd=ROOT, env=e,
                          timeout=timeout)


def plan_json(args: list[str]) -> dict:
    p = run_ggpipe(["plan", "--json", *args], None, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


# -- ggpipe plan ---------------------------------------------------------------------------


@pytest.mark.full  # reads every tensor of the GGUF: 4 s
def test_plan_bytes_match_the_gguf(smollm2):
    info = read_model_info(smollm2)
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(smollm2).tensors}
    total = sum(tensors.values())
    embd = tensors["token_embd.weight"]
    assert "output.weight" not in tensors  # SmolLM2 ties its output to token_embd

    one = plan_json(["-n", "1", "-m", str(smollm2), "-c", "1024"])["ranks"]
    assert one[0]["layers"] == [0, 30] and one[0]["weights_bytes"] == total
    head_dim = info.n_embd // info.n_head
    kv = 30 * 1024 * 2 * head_dim * info.n_head_kv * 2  # layers x cells x (K + V) x n_embd_kv x f16
    assert one[0]["kv_bytes"] == kv == 30 * 1024 * 2 * 192 * 2

    two = plan_json(["-n", "2", "-m", str(smollm2), "-c", "1024"])
    r0, r1 = two["ranks"]
    assert (r0["layers"], r1["layers"]) == ([0, 22], [22, 30])   # the LM head counted on the last stage
    assert (r0["kv_bytes"], r1["kv_bytes"]) == (kv // 30 * 22, kv // 30 * 8)
    # token_embd is read by the first stage and, tied, by the last stage's LM head
    assert r0["weights_bytes"] + r1["weights_bytes"] == total + embd
    blk0 = sum(n for k, n in tensors.items() if k.startswith(tuple(f"blk.{i}." for i in range(22))))
    assert r0["weights_bytes"] == blk0 + embd + tensors.get("rope_freqs.weight", 0)
    assert two["command"][:3] == ["mpiexec", "-n", "2"] and "generate" in two["command"]
    assert two["warnings"] == []


def test_plan_uneven_split_draft_and_hosts(smollm2, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# cluster\nnode-a slots=2\nnode-b:1\nnode-c\n")
    d = plan_json(["-n", "3", "--hostfile", str(hosts), "--mem-per-node", "64G", "--",
                   "generate", "-m", str(smollm2), "-md", str(smollm2), "--split", "0.2,0.8/1", "-t", "2,1,4",
                   "-p", "x"])
    r = d["ranks"]
    assert [x["host"] for x in r] == ["node-a", "node-b", "node-c"]  # --map-by node: round-robin
    assert [x["model"] for x in r] == ["target", "target", "draft"]
    assert [x["layers"] for x in r] == [[0, 6], [6, 30], [0, 30]]
    assert [x["threads"] for x in r] == [2, 1, 4]
    assert d["hosts"]["node-a"]["memory_bytes"] == 64 * 2**30
    assert d["command"][d["command"].index("ggpipe") + 1:] == ["generate", "-m", str(smollm2), "-md",
                                                                str(smollm2), "--split", "0.2,0.8/1", "-t",
                                                                "2,1,4", "-p", "x"]
    # one rank holding target and draft (no draft rank)
    one = plan_json(["-n", "1", "-m", str(smollm2), "-md", str(smollm2)])["ranks"][0]
    assert one["model"] == "target+draft" and one["draft_layers"] == [0, 30]


def test_plan_sizes_the_slots_of_parallel_jobs(smollm2, tmp_path):
    """batch/serve with --parallel: the KV as the job lays it out (checked
    against llama.cpp's own log by hand: 180 and 45 MiB): -c shared by the
    slots, --parallel auto's 8 slots x 2048 cells at 2 ranks without -c, and a
    draft model's context of one slot's cells and one sequence (it drafts for
    one request at a time)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "x"}\n')
    job = ["batch", str(inp), "-o", str(tmp_path / "o.jsonl"), "-m", str(smollm2)]
    md = plan_json(["-n", "2", "--", *job, "-md", str(smollm2), "--parallel", "4", "-c", "8192"])["ranks"]
    assert [r["model"] for r in md] == ["target", "draft"]
    assert md[0]["kv_bytes"] == 180 * 2**20 and md[1]["kv_bytes"] == 45 * 2**20
    auto = plan_json(["-n", "2", "--", *job])
    one = plan_json(["-n", "2", "--", *job, "--parallel", "1"])
    assert sum(r["kv_bytes"] for r in auto["ranks"]) == 8 * sum(r["kv_bytes"] for r in one["ranks"])  # 8 x 2048 cells
    # the slots and the micro-batches in flight, as the job runs them (2 stages: at most 2, fewer if the CPUs
    # this test may use cannot hold both); none for one request at a time
    assert auto["slots"]["slots"] == 8 and auto["slots"]["cells_per_slot"] == 2048
    assert 1 <= auto["slots"]["micro_batches"] <= 2 and not auto["slots"]["micro_batches_given"]
    assert "slots" not in one
    given = plan_json(["-n", "3", "--", *job, "--parallel", "4", "-c", "1000", "--micro-batches", "3"])["slots"]
    assert given == {"slots": 4, "cells_per_slot": 256, "micro_batches": 3, "micro_batches_given": True}


def test_plan_table_and_memory_warning(smollm2, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("far-away-1\nfar-away-2\n")
    p = run_ggpipe(["plan", "-n", "2", "-m", str(smollm2), "--hostfile", str(hosts), "--mem-per-node", "50M",
                    "--launcher", "openmpi", "-c", "4096"], None, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith(f"mpiexec -n 2 --hostfile {hosts} --map-by node --bind-to none ggpipe generate")
    assert lines[2].split()[:4] == ["rank", "host", "model", "layers"]
    assert lines[3].split()[:5] == ["0", "far-away-1", "target", "0-21", "1"]
    assert "66.0 MiB" in lines[3]  # KV: 22 layers x 4096 cells x 768 B
    warn = [ln for ln in p.stderr.splitlines() if ln.startswith("ggpipe: warning: host far-away-")]
    assert len(warn) == 2 and "of memory" in warn[0]
    # this host: its own memory from psutil, no warning for a small model
    p = run_ggpipe(["plan", "-n", "2", "-m", str(smollm2)], None, timeout=120)
    assert p.returncode == 0 and "warning" not in p.stderr and " GiB" in p.stdout


def test_plan_bad_input_is_one_line(smollm2, tmp_path):
    p = run_ggpipe(["plan", "-n", "3", "-m", str(smollm2), "--split", "1,1"], None, timeout=60)
    assert p.returncode == 1 and p.stderr.startswith("ggpipe: error: --split describes 2 target stages")
    bad = tmp_path / "hosts"
    bad.write_text("node1 slots=two\n")
    p = run_ggpipe(["plan", "-n", "2", "-m", str(smollm2), "--hostfile", str(bad)], None, timeout=60)
    assert p.returncode == 1 and f"hostfile {bad}:1" in p.stderr and "Traceback" not in p.stderr
    p = run_ggpipe(["plan", "-n", "2", "-m", "x", "--", "generate"], None, timeout=60)
    assert p.returncode == 2 and "not to plan as well" in p.stderr


def test_hostfile_placement_and_launcher_flags(tmp_path):
    f = tmp_path / "h"
    f.write_text("a slots=2\nb:3  # comment\n\nc\n")
    hosts = parse_hostfile(f)
    assert hosts == [("a", 2), ("b", 3), ("c", 1)]
    assert place_ranks(4, hosts, "node") == ["a", "b", "c", "a"]
    assert place_ranks(4, hosts, "slot") == ["a", "a", "b", "b"]
    assert launcher_command("openmpi", 4, "h", "node", "core", 8) == [
        "mpiexec", "-n", "4", "--hostfile", "h", "--map-by", "node:PE=8", "--bind-to", "core"]
    assert launcher_command("mpich", 4, "h", "node", "core", 8) == [
        "mpiexec", "-n", "4", "-disable-auto-cleanup", "-f", "h", "-ppn", "1", "-bind-to", "core:8"]
    assert launcher_command("mpich", 2, None, "node", "none", 1) == ["mpiexec", "-n", "2", "-disable-auto-cleanup"]
    assert parse_bytes("64G") == 64 * 2**30 and parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("100") == 100
    with pytest.raises(ConfigError):
        parse_bytes("lots")


# -- scripts: --dry-run --------------------------------------------------------------------


@pytest.mark.parametrize("flavor,flags", [
    ("openmpi", ["--hostfile", "--map-by node:PE=2 --bind-to core"]),
    ("mpich", ["-f ", "-ppn 1 -bind-to core:2"]),
])
def test_hostfile_launcher_dry_run(smollm2, tmp_path, flavor, flags):
    hosts = tmp_path / "hosts"
    hosts.write_text("n1:2\nn2 slots=1\n")  # mixed formats are converted
    p = script("mpirun-hostfile.sh", ["--hostfile", str(hosts), "--bind-to", "core", "--dry-run", "--",
                                      "generate", "-m", str(smollm2), "-t", "2", "-p", "Hello there"],
               {"MPI_FLAVOR": flavor})
    assert p.returncode == 0, p.stderr
    out = p.stdout
    cmd = next(ln for ln in out.splitlines() if ln.startswith("mpiexec "))
    assert cmd.startswith("mpiexec -n 2 ") and all(f in cmd for f in flags)
    assert cmd.endswith(f"-m {smollm2} -t 2 -p 'Hello there'")
    conv = "n1 slots=2" if flavor == "openmpi" else "n2:1"
    assert f"#   {conv}" in out
    rows = [ln.split() for ln in out.splitlines() if ln[:2] in ("0 ", "1 ")]
    assert [r[1] for r in rows] == ["n1", "n2"] and [r[3] for r in rows] == ["0-21", "22-29"]  # the LM head counted on the last stage
    assert not list(tmp_path.glob("ggpipe-hosts.*"))


def test_hostfile_launcher_detects_this_mpi(smollm2, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    p = script("mpirun-hostfile.sh", ["--hostfile", str(hosts), "--dry-run", "--", "generate", "-m", str(smollm2),
                                      "-p", "x"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("# MPI: mpich")  # the test environment's MPICH (Hydra)
    p = script("mpirun-hostfile.sh", ["--hostfile", str(tmp_path / "missing"), "--", "generate"])
    assert p.returncode == 2 and "not found" in p.stderr


def fake_numa(tmp_path, lists: list[str]):
    root = tmp_path / "node"
    for i, cpus in enumerate(lists):
        (root / f"node{i}").mkdir(parents=True)
        (root / f"node{i}" / "cpulist").write_text(cpus + "\n")
    return root


@pytest.fixture
def fake_numactl(tmp_path):
    """A stand-in numactl (drops its options, runs the command)."""
    exe = tmp_path / "bin" / "numactl"
    exe.parent.mkdir()
    exe.write_text('#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift 2; done\nexec "$@"\n')
    exe.chmod(0o755)
    return exe


def test_numa_dry_run_two_sockets(smollm2, tmp_path, fake_numactl):
    sysfs = fake_numa(tmp_path, ["0-3,8-11", "4-7,12-15", ""])  # node 2: memory only
    env = {"NUMA_SYSFS": str(sysfs), "NUMACTL": str(fake_numactl)}
    p = script("numa.sh", ["--dry-run", "--", "generate", "-m", str(smollm2), "-p", "Hi"], env)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "# NUMA nodes: 2" in out and "rank 1: node 1, CPUs 4,5,6,7,12,13,14,15, 8 threads" in out
    cmd = next(ln for ln in out.splitlines() if ln.startswith("mpiexec "))
    parts = cmd.split(" : ")
    assert len(parts) == 2
    assert parts[0].startswith(f"mpiexec -disable-auto-cleanup -n 1 {fake_numactl} --cpunodebind 0 --membind 0 {GGPIPE} generate")
    assert parts[1].startswith(f"-n 1 {fake_numactl} --cpunodebind 1 --membind 1 {GGPIPE} generate")
    assert all(x.endswith("-t 8,8") for x in parts)
    rows = [ln.split() for ln in out.splitlines() if ln[:2] in ("0 ", "1 ")]
    assert [r[3] for r in rows] == ["0-21", "22-29"]  # the LM head counted on the last stage and [r[4] for r in rows] == ["8", "8"]

    p = script("numa.sh", ["--dry-run", "--ranks-per-node", "2", "--", "generate", "-m", str(smollm2), "-p", "Hi"],
               env)
    assert p.returncode == 0, p.stderr
    assert "--physcpubind 0,1,2,3 --membind 0" in p.stdout and "--physcpubind 12,13,14,15 --membind 1" in p.stdout
    assert "-t 4,4,4,4" in p.stdout

    # no numactl: the launcher binds to NUMA nodes
    p = script("numa.sh", ["--dry-run", "--", "generate", "-m", str(smollm2), "-p", "Hi"],
               {"NUMA_SYSFS": str(sysfs), "NUMACTL": "none", "MPI_FLAVOR": "openmpi"})
    assert p.returncode == 0 and "numactl not available" in p.stderr
    assert f"mpiexec -n 2 --map-by numa --bind-to numa {GGPIPE} generate" in p.stdout


def test_numa_dry_run_fallbacks_and_errors(smollm2, tmp_path):
    p = script("numa.sh", ["--dry-run", "--", "generate", "-m", str(smollm2), "-p", "Hi"],
               {"NUMA_SYSFS": str(tmp_path / "none"), "NUMACTL": "none"})
    assert p.returncode == 0, p.stderr
    n = os.cpu_count()
    assert "treating the machine as one node" in p.stderr
    assert f"mpiexec -disable-auto-cleanup -n 1 {GGPIPE} generate -m {smollm2} -p Hi -t {n}" in p.stdout
    p = script("numa.sh", ["--", "generate", "-t", "2", "-p", "Hi"])
    assert p.returncode == 2 and "sets -t itself" in p.stderr


def test_sbatch_dry_run(smollm2, tmp_path):
    p = script("ggpipe.sbatch", ["--dry-run", "generate", "-m", str(smollm2), "-p", "Hello there"])
    assert p.returncode == 0, p.stderr
    assert f"srun --ntasks=2 --cpus-per-task=8 --cpu-bind=cores {GGPIPE} generate -m {smollm2} -p 'Hello there' -t 8" \
        in p.stdout
    rows = [ln.split() for ln in p.stdout.splitlines() if ln[:2] in ("0 ", "1 ")]
    assert [r[1] for r in rows] == ["node1", "node2"]
    env = {"SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS_PER_NODE": "2(x1)", "SLURM_CPUS_PER_TASK": "3",
           "SLURM_MEM_PER_NODE": "10", "GGPIPE_LAUNCHER": "mpiexec"}
    p = script("ggpipe.sbatch", ["--dry-run", "batch", "in.jsonl", "-o", "out.jsonl", "-m", str(smollm2)], env)
    assert p.returncode == 0, p.stderr
    assert f"mpiexec -n 2 {GGPIPE} batch in.jsonl -o out.jsonl -m {smollm2} -t 3" in p.stdout
    assert "ggpipe: warning: host node1" in p.stderr  # 10 MB per node is not enough
    p = script("ggpipe.sbatch", ["generate", "-p", "x"], {"SLURM_JOB_ID": ""})
    assert p.returncode == 2 and "not inside a Slurm job" in p.stderr


# -- scripts: real runs on this machine -------------------------------------------------------------


@pytest.fixture(scope="module")
def expected_text(smollm2, reference):
    toks = reference(smollm2, PROMPT, 4)
    vocab = Llama(model_path=str(smollm2), vocab_only=True, verbose=False)
    return vocab.detokenize(toks).decode()


@pytest.mark.mpi
@pytest.mark.full
@pytest.mark.parametrize("numactl", ["system", "none"])
def test_numa_script_real_run(smollm2, expected_text, numactl):
    if numactl == "system" and shutil.which("numactl") is None:
        pytest.skip("numactl is not installed here (the 'none' case covers this machine)")
    env = {"NUMACTL": "numactl" if numactl == "system" else "none"}
    p = script("numa.sh", ["--", "generate", "-m", str(smollm2), "-n", "4", "-p", PROMPT], env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == expected_text.strip()


@pytest.mark.mpi
@pytest.mark.full
def test_numa_script_two_ranks_per_node(smollm2, expected_text, fake_numactl):
    numactl = shutil.which("numactl") or str(fake_numactl)
    p = script("numa.sh", ["--ranks-per-node", "2", "--", "generate", "-m", str(smollm2), "-n", "4", "-p", PROMPT],
               {"NUMACTL": numactl})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == expected_text.strip()


@pytest.mark.mpi
@pytest.mark.full
def test_hostfile_launcher_real_run(smollm2, expected_text, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")  # Open MPI format, converted for MPICH
    p = script("mpirun-hostfile.sh", ["--hostfile", str(hosts), "-n", "2", "--", "generate", "-m", str(smollm2),
                                      "-n", "4", "-p", PROMPT])
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == expected_text.strip()
