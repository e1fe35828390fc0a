"""Described registry models: models.toml entries with a
shape (ARCH:QUANT) and a download URL instead of a source. ggpipe plan and
simulate size and cost them from the shape while their GGUF is absent;
anything that needs the weights refuses in one line saying where to get it;
a file the user puts in the cache is the model from then on. No MPI, no
weights: tiny GGUFs written here."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import assert_registry_refused
from tiny_models import write_tiny_model

from ggpipe.cli.main import cli
from ggpipe.errors import ConfigError, GGPipeError, ModelError
from ggpipe.models import registry as reg
from ggpipe.models.kv_size import kv_cells
from ggpipe.models.shapes import ARCHITECTURES, parse_shape
from ggpipe.models.sizes import model_sizes, shape_sizes
from ggpipe.sim.model import described, from_gguf, resolve_desc

ROOT = Path(__file__).resolve().parent.parent
QWEN = "qwen3-30b-a3b-q4_k_m"
DESCRIBED = {  # name -> (shape, url) of the default registry's described models
    QWEN: ("qwen3-30b-a3b:Q4_K_M", "https://huggingface.co/Qwen/Qwen3-30B-A3B-GGUF"),
    "qwen3-235b-a22b-q4_k_m": ("qwen3-235b-a22b:Q4_K_M", "https://huggingface.co/Qwen/Qwen3-235B-A22B-GGUF"),
    "gpt-oss-20b-mxfp4": ("gpt-oss-20b:MXFP4", "https://huggingface.co/ggml-org/gpt-oss-20b-GGUF"),
    "gpt-oss-120b-mxfp4": ("gpt-oss-120b:MXFP4", "https://huggingface.co/ggml-org/gpt-oss-120b-GGUF"),
    "llama3.3-70b-q4_k_m": ("llama3.3-70b:Q4_K_M", "https://huggingface.co/bartowski/Llama-3.3-70B-Instruct-GGUF"),
}
SHA = "0" * 64


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    """The default registry, an empty cache: no described model's file."""
    monkeypatch.setenv("GGPIPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GGPIPE_MODELS", raising=False)
    return tmp_path / "cache"


def _registry(tmp_path, monkeypatch, body: str) -> Path:
    p = tmp_path / "models.toml"
    p.write_text(body)
    monkeypatch.setenv("GGPIPE_MODELS", str(p))
    monkeypatch.setenv("GGPIPE_CACHE", str(tmp_path / "cache"))
    return p


def _entry(name="big", shape="qwen3-30b-a3b:Q4_K_M", url="https://example.org/big-GGUF", **extra) -> str:
    lines = [f"[models.{name}]", 'description = "x"', 'arch = "qwen3moe"']
    if shape is not None:
        lines.append(f'shape = "{shape}"')
    if url is not None:
        lines.append(f'url = "{url}"')
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


# -- the registry -------------------------------------------------------------------------------


def test_the_default_registry_describes_what_clusters_run(empty_cache):
    entries = reg.load_registry()
    for name, (shape, url) in DESCRIBED.items():
        e = entries[name]
        assert (e.shape, e.url, e.is_described, e.size, e.sha256) == (shape, url, True, None, None)
        assert e.source == f"download: {url}" and e.pypi is None and e.base is None
        parse_shape(e.shape)
        assert not reg.is_cached(name) and reg.cached_path(name) is None
    assert not entries["smollm2-135m"].is_described


def test_a_described_entry_parses_with_or_without_size_and_hash(tmp_path, monkeypatch):
    _registry(tmp_path, monkeypatch, _entry() + _entry("sized", size=123, sha256=SHA))
    e = reg.load_registry()
    assert (e["big"].shape, e["big"].url, e["big"].size, e["big"].sha256) == \
        ("qwen3-30b-a3b:Q4_K_M", "https://example.org/big-GGUF", None, None)
    assert (e["sized"].size, e["sized"].sha256) == (123, SHA)


SMOL = ('[models.s]\narch="llama"\nsize=1\nsha256="' + SHA + '"\npypi="x==1"\nmember="m.gguf"\n')
BAD = [
    (_entry(shape="nope-7b:Q4_K_M"), ["'big'", "shape", "unknown architecture 'nope-7b'"]),
    (_entry(shape="qwen3-30b-a3b:Q5_X"), ["'big'", "shape", "unknown quantization 'Q5_X'"]),
    (_entry(shape="qwen3-30b-a3b"), ["'big'", "shape", "ARCH:QUANT"]),
    (_entry(pypi="x==1", member="m.gguf"), ["'big'", "'pypi'", "not both"]),
    (SMOL + _entry(base="s", layers="0"), ["'big'", "'base'", "not both"]),
    (_entry(url=None), ["'big'", "missing field 'url'"]),
    (_entry(url="hf.co/big"), ["'big'", "'url'", "http"]),
    (_entry(shape=None, size=1, sha256=SHA, pypi="x==1", member="m.gguf"), ["'big'", "'url'", "described"]),
    (_entry(shape=None), ["'big'", "missing field 'size'"]),
    (_entry(sha256="abc"), ["'big'", "sha256", "64"]),
    (_entry(size=0), ["'big'", "size", "positive"]),
    (_entry() + f'[models.d]\narch="qwen3moe"\nsize=1\nsha256="{SHA}"\nbase="big"\nlayers="0"\n',
     ["'d'", "base", "described model 'big'"]),
]


@pytest.mark.parametrize("body,words", BAD)
def test_bad_described_entries(tmp_path, monkeypatch, body, words):
    assert_registry_refused(_registry(tmp_path, monkeypatch, body), words)


# -- what needs the weights refuses, in one line --------------------------------------------------


def _refusal(name: str, cache: Path) -> str:
    shape, url = DESCRIBED[name]
    return (f"{name} is a described model: ggpipe cannot download it; get the GGUF from {url} and pass its path, "
            f"or put it at {cache / 'models' / (name + '.gguf')}; ggpipe plan and simulate use its shape ({shape})")


@pytest.mark.parametrize("call", [
    lambda n: reg.fetch(n, progress=False),
    lambda n: reg.resolve(n),
    lambda n: reg.resolve(n, fetch_missing=False),
    lambda n: reg.verify(n),
])
def test_fetch_and_resolve_refuse_in_one_line(empty_cache, call):
    with pytest.raises(reg.DescribedModelError) as ei:
        call(QWEN)
    assert str(ei.value) == _refusal(QWEN, empty_cache)
    assert not (empty_cache / "models").exists()  # nothing created, nothing downloaded


@pytest.mark.parametrize("args", [["models", "fetch", "-q", QWEN], ["models", "path", QWEN], ["models", "info", QWEN],
                                  ["generate", "-m", QWEN, "-p", "hi", "-n", "1"]])
def test_the_cli_refuses_in_one_line(empty_cache, args):
    r = CliRunner().invoke(cli, args)
    assert r.exit_code != 0
    assert isinstance(r.exception, GGPipeError) and str(r.exception) == _refusal(QWEN, empty_cache), r.output


def test_models_list_shows_described_models(empty_cache):
    r = CliRunner().invoke(cli, ["models", "list"])
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith(QWEN))
    assert "qwen3moe" in line and "~18.5 GB" in line and " no " in line
    assert line.rstrip().endswith("download: https://huggingface.co/Qwen/Qwen3-30B-A3B-GGUF")
    assert "ggpipe cannot fetch them" in r.output


# -- sizes of a shape -------------------------------------------------------------------------------


def test_shape_sizes():
    a = ARCHITECTURES["qwen3-30b-a3b"]
    m = shape_sizes(a, "q4_k_m", "qwen3-30b-a3b:Q4_K_M")
    assert (m.n_layer, m.n_embd, m.n_vocab, m.tied, m.shape) == (48, 2048, 151936, False, "qwen3-30b-a3b:Q4_K_M")
    assert m.layer_params == [a.layer_params(il)[0] for il in range(48)]
    assert m.layer_bytes == [int(p * 4.85 / 8) for p in m.layer_params]
    assert m.embd_bytes == m.output_bytes == int(151936 * 2048 * 4.85 / 8)
    assert (m.n_expert, m.n_expert_used) == (128, 8) and m.layer_expert_params[0] == 128 * 3 * 2048 * 768
    assert m.kv.rows == ((128 * 4, 128 * 4),) * 48 and m.kv.v_cache
    assert m.kv_bytes(0, 48, 2048) == 2048 * 48 * 2 * 512 * 2  # f16 K and V rows
    assert 18.0e9 < m.slice_bytes(0, 48, True, True) < 19.0e9  # the published Q4_K_M file: 18.6 GB
    assert model_sizes("qwen3-30b-a3b:q4_k_m") == m  # ARCH:QUANT, any case
    mla = model_sizes("deepseek-v2-lite:Q4_K_M")  # MLA: one K-only latent of 576 per layer
    assert mla.kv.rows == ((576, 0),) * 27 and not mla.kv.v_cache
    tied = model_sizes("llama3.2-1b:F16")
    assert tied.tied and tied.output_bytes == 0 and tied.head_bytes == tied.embd_bytes
    with pytest.raises(ConfigError, match="unknown quantization"):
        model_sizes("qwen3-30b-a3b:Q9")


def test_a_described_name_is_sized_and_described_as_its_shape(empty_cache):
    m = model_sizes(QWEN)
    assert m.shape == "qwen3-30b-a3b:Q4_K_M" and m.layer_bytes == model_sizes("qwen3-30b-a3b:Q4_K_M").layer_bytes
    d, s = from_gguf(QWEN), described("qwen3-30b-a3b", ARCHITECTURES["qwen3-30b-a3b"], "Q4_K_M")
    assert (d.layers, d.head, d.n_embd, d.n_vocab) == (s.layers, s.head, s.n_embd, s.n_vocab)
    assert resolve_desc(QWEN).layers == resolve_desc("qwen3-30b-a3b:Q4_K_M").layers == s.layers
    assert s.layers[0].n_expert == 128 and s.layers[0].n_expert_used == 8


# -- ggpipe plan and simulate ---------------------------------------------------------------------------


def _plan(tmp_path, *args) -> tuple[dict, str]:
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"node{i}\n" for i in range(4)))
    r = CliRunner().invoke(cli, ["plan", "--json", "--launcher", "mpich", "--hostfile", str(hosts), *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), r.stderr


def test_plan_of_a_described_model(empty_cache, tmp_path):
    d, _ = _plan(tmp_path, "-n", "4", "-m", QWEN, "--mem-per-node", "16G")
    m = model_sizes("qwen3-30b-a3b:Q4_K_M")
    ranks = d["ranks"]
    assert [r["host"] for r in ranks] == ["node0", "node1", "node2", "node3"]
    assert [tuple(r["layers"]) for r in ranks] == [(0, 12), (12, 24), (24, 36), (36, 48)]
    assert sum(r["weights_bytes"] for r in ranks) == m.slice_bytes(0, 48, True, True)  # the shape's whole size
    assert ranks[0]["weights_bytes"] == sum(m.layer_bytes[:12]) + m.embd_bytes
    assert ranks[3]["weights_bytes"] == sum(m.layer_bytes[36:]) + m.output_bytes
    assert [r["kv_bytes"] for r in ranks] == [kv_cells(2048) * 12 * 2 * 512 * 2] * 4  # -c 2048, f16
    assert all(h["memory_bytes"] == 16 << 30 and h["total_bytes"] < 16 << 30 for h in d["hosts"].values())
    assert d["warnings"] == [_refusal(QWEN, empty_cache) + " (the job itself needs the file)"]
    assert "generate -m qwen3-30b-a3b-q4_k_m" in " ".join(d["command"])
    # the shape itself: the same table
    same, _ = _plan(tmp_path, "-n", "4", "-m", "qwen3-30b-a3b:Q4_K_M", "--mem-per-node", "16G")
    assert [(r["layers"], r["weights_bytes"], r["kv_bytes"]) for r in same["ranks"]] == \
        [(r["layers"], r["weights_bytes"], r["kv_bytes"]) for r in ranks]
    assert "sized from its shape qwen3-30b-a3b:Q4_K_M" in same["warnings"][0]


def test_plan_warns_when_a_described_model_does_not_fit(empty_cache, tmp_path):
    d, _ = _plan(tmp_path, "-n", "2", "-m", "gpt-oss-120b-mxfp4", "--mem-per-node", "16G")
    assert all(h["total_bytes"] > 16 << 30 for h in d["hosts"].values())
    assert any("need about" in w and "use more ranks/hosts" in w for w in d["warnings"])
    ok, _ = _plan(tmp_path, "-n", "4", "-m", "gpt-oss-120b-mxfp4", "--mem-per-node", "32G")
    assert not any("need about" in w for w in ok["warnings"])


def _simulate(*args) -> list[dict]:
    r = CliRunner().invoke(cli, ["simulate", "--profile", str(ROOT / "docs/results/described-node.json"), "--json",
                                 *args])
    assert r.exit_code == 0, r.output
    return [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]


def test_simulate_a_described_model(empty_cache):
    args = ["--modes", "iterative", "--ranks", "1,4", "--prompts", "1", "-n", "16"]
    rows = _simulate("-m", QWEN, *args)
    assert [r["ranks"] for r in rows] == [1, 4]
    shape_rows = _simulate("-m", "qwen3-30b-a3b:Q4_K_M", *args)
    assert [r["tokens_per_s"] for r in rows] == [r["tokens_per_s"] for r in shape_rows]
    # a token reads the dense weights and 8 of 128 experts (~1.8 GB of 18.5) from a 120 GB/s node
    assert 40 < rows[0]["tokens_per_s"] < 80
    r = CliRunner().invoke(cli, ["simulate", "--profile", str(ROOT / "docs/results/described-node.json"), "-m", QWEN,
                                 *args])
    assert r.exit_code == 0 and r.output.count("| shm | ") == 2, r.output


# -- the user's file, once it is there ----------------------------------------------------------------


def test_a_file_in_the_cache_is_used_instead_of_the_shape(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    gguf = write_tiny_model("llama-moe", tmp_path / "tiny.gguf")
    size = gguf.stat().st_size
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    _registry(tmp_path, monkeypatch, _entry() + _entry("sized", size=size + 1) + _entry("hashed", sha256=sha)
              + _entry("wrong-hash", sha256=SHA))
    with pytest.raises(reg.DescribedModelError):
        reg.resolve("big")
    assert model_sizes("big").shape == "qwen3-30b-a3b:Q4_K_M"

    (cache / "models").mkdir(parents=True)
    for name in ("big", "sized", "hashed", "wrong-hash"):
        (cache / "models" / f"{name}.gguf").write_bytes(gguf.read_bytes())
    final = cache / "models" / "big.gguf"
    assert reg.resolve("big") == reg.fetch("big") == reg.cached_path("big") == final and reg.is_cached("big")
    m, tiny = model_sizes("big"), model_sizes(str(gguf))
    assert m.shape is None and m.n_layer == tiny.n_layer and m.layer_bytes == tiny.layer_bytes
    assert m.n_expert == tiny.n_expert > 0 and from_gguf("big").layers[0].expert_bytes == m.layer_expert_bytes[0]
    d, _ = _plan(tmp_path, "-n", "2", "-m", "big")
    assert sum(r["n_layer"] for r in d["ranks"]) == tiny.n_layer and d["warnings"] == []
    # verify: no hash registered -> nothing to compare with; a registered one is checked, the file never removed
    with pytest.raises(ModelError, match="no sha256"):
        reg.verify("big")
    assert reg.verify("hashed") == cache / "models" / "hashed.gguf"
    with pytest.raises(ModelError, match="not the GGUF from https://example.org/big-GGUF"):
        reg.verify("wrong-hash")
    assert (cache / "models" / "wrong-hash.gguf").is_file()
    # a registered size that differs: said, not used, not removed
    for call in (lambda: reg.resolve("sized"), lambda: reg.fetch("sized"), lambda: model_sizes("sized")):
        with pytest.raises(ModelError, match=f"is {size} bytes but models.toml says {size + 1}"):
            call()
    assert (cache / "models" / "sized.gguf").is_file() and not reg.is_cached("sized")
