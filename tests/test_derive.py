"""Layer lists, GGUF derivation and runtime stage slices, on the real
SmolLM2-135M weights and on small synthetic GGUFs."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from ggpipe.errors import ModelError
from ggpipe.models import derive as derive_mod
from ggpipe.models import registry as reg
from ggpipe.models.cache import cached_sha256
from ggpipe.models.derive import derive_gguf, format_layer_list, parse_layer_list, stage_slice
from ggpipe.models.gguf_info import GGUFFile, read_model_info, scan_gguf

Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("GGPIPE_CACHE")
    if env:
        return Path(env)
    path = tmp_path_factory.getbasetemp() / "ggpipe-cache"  # shared with test_models.py
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def smollm2(model_cache: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GGPIPE_CACHE", str(model_cache))
        mp.delenv("GGPIPE_MODELS", raising=False)
        return reg.fetch("smollm2-135m", progress=False)


def tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def field(path: Path | gguf.GGUFReader, key: str):  # noqa: ANN201
    r = path if isinstance(path, gguf.GGUFReader) else gguf.GGUFReader(path)
    return r.fields[key].contents()


def make_gguf(path: Path, arch: str = "llama", n_layer: int = 4, per_layer: bool = True) -> Path:
    """A tiny model-shaped GGUF: token_embd, n_layer blocks, output_norm,
    a per-layer int array and a per-layer string array."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_embedding_length(32)
    w.add_context_length(64)
    w.add_uint32(f"{arch}.vocab_size", 16)
    if per_layer:
        w.add_array(f"{arch}.attention.head_count", [10 + i for i in range(n_layer)])
        w.add_array(f"{arch}.test.layer_names", [f"layer{i}" for i in range(n_layer)])
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(16)])
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.add_tensor("token_embd.weight", rng.standard_normal((16, 32), dtype=np.float32))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.full(32, i, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_up.weight", (rng.standard_normal((32, 32)) + 100 * i).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------- layer lists


@pytest.mark.parametrize(
    "text,expected",
    [
        ("0-19,10-29", list(range(20)) + list(range(10, 30))),
        ("3", [3]),
        (" 0 - 2 , 5 ,5", [0, 1, 2, 5, 5]),
        ("7-7,1", [7, 1]),
    ],
)
def test_parse_layer_list(text: str, expected: list[int]) -> None:
    assert parse_layer_list(text) == expected


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("0-", "bad item"),
        ("a-b", "bad item"),
        ("1,,2", "bad item ''"),
        ("-1", "bad item"),
        ("5-3", "backwards.*3-5"),
        ("0-2,1.5", "bad item '1.5'"),
    ],
)
def test_parse_layer_list_errors(text: str, match: str) -> None:
    with pytest.raises(ModelError, match=match):
        parse_layer_list(text)


def test_parse_layer_list_range_check() -> None:
    assert parse_layer_list("0-29", n_layer=30)[-1] == 29
    with pytest.raises(ModelError, match="layer 30 .*layers 0-29"):
        parse_layer_list("25-30", n_layer=30)
    assert format_layer_list(parse_layer_list("0-19,10-29,3")) == "0-19,10-29,3"


# ---------------------------------------------------------------- stage slices (real weights)


@pytest.fixture(scope="session")
def smol_reader(smollm2: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2)  # about 2 s: parse once


def raw_tensor(g: GGUFFile, name: str) -> np.ndarray:
    """Raw bytes of a tensor, located with our own scan (faster than GGUFReader)."""
    t = next(t for t in g.tensors if t.name == name)
    return np.memmap(g.path, dtype=np.uint8, mode="r", offset=g.data_offset + t.offset, shape=(t.nbytes,))


def test_stage_slices(smollm2: Path, smol_reader: gguf.GGUFReader, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert stage_slice(smollm2, 0, 30, cache) == smollm2
    a = stage_slice(smollm2, 0, 12, cache)
    b = stage_slice(smollm2, 12, 30, cache)
    sha = hashlib.sha256(smollm2.read_bytes()).hexdigest()
    assert a == cache / "slices" / f"{sha[:16]}-0-12.gguf"
    assert b.name == f"{sha[:16]}-12-30.gguf"
    src = {t.name: t for t in smol_reader.tensors}
    per_block = [n.split(".", 2)[2] for n in src if n.startswith("blk.0.")]
    assert len(per_block) == 9

    # Slice a, read back with gguf's own reader (independent of our scanner).
    r = gguf.GGUFReader(a)
    assert field(r, "llama.block_count") == 12
    ts = {t.name: t for t in r.tensors}
    assert set(ts) == {"token_embd.weight", "output_norm.weight"} | {f"blk.{i}.{s}" for i in range(12) for s in per_block}
    for i in (0, 11):
        for s in per_block:
            got, want = ts[f"blk.{i}.{s}"], src[f"blk.{i}.{s}"]
            assert got.tensor_type == want.tensor_type and np.array_equal(got.data, want.data)
    assert np.array_equal(ts["token_embd.weight"].data, src["token_embd.weight"].data)
    assert len(r.fields) == len(smol_reader.fields)
    for key in ("tokenizer.chat_template", "general.name", "llama.rope.freq_base", "tokenizer.ggml.eos_token_id"):
        assert field(r, key) == field(smol_reader, key)
    assert field(r, "tokenizer.ggml.tokens") == field(smol_reader, "tokenizer.ggml.tokens")

    # Slice b, with our scanner: blocks renamed, data and other metadata identical.
    gs, gb = scan_gguf(smollm2), scan_gguf(b)
    assert gb.get("llama.block_count") == 18
    names = [t.name for t in gb.tensors]
    assert names[0] == "token_embd.weight" and names[-1] == "output_norm.weight" and len(names) == 2 + 18 * 9
    for i in (0, 7, 17):
        for s in per_block:
            assert np.array_equal(raw_tensor(gb, f"blk.{i}.{s}"), raw_tensor(gs, f"blk.{12 + i}.{s}"))
    src_bytes, b_bytes = smollm2.read_bytes(), b.read_bytes()
    for key, kv in gs.kvs.items():
        if key != "llama.block_count":
            kb = gb.kvs[key]
            assert src_bytes[kv.start : kv.end] == b_bytes[kb.start : kb.end], key

    # Second call: the cached slice, not rebuilt.
    mtime = a.stat().st_mtime_ns
    assert stage_slice(smollm2, 0, 12, cache) == a and a.stat().st_mtime_ns == mtime
    # A damaged cached slice is rebuilt.
    with open(a, "r+b") as f:
        f.truncate(1000)
    assert stage_slice(smollm2, 0, 12, cache) == a and read_model_info(a).n_layer == 12
    for bad in [(0, 0), (5, 3), (-1, 4), (20, 31)]:
        with pytest.raises(ModelError, match="layer range"):
            stage_slice(smollm2, *bad, cache)


def test_model_hash_is_remembered(smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "m.gguf"
    copy.write_bytes(smollm2.read_bytes()[:1 << 20])
    want = hashlib.sha256(copy.read_bytes()).hexdigest()
    root = tmp_path / "cache"
    assert cached_sha256(copy, root) == want
    import ggpipe.models.cache as cache_mod

    def boom(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("hashed again")

    monkeypatch.setattr(cache_mod, "sha256_file", boom)
    assert cached_sha256(copy, root) == want
    # Changing the file (size / mtime) invalidates the record.
    with open(copy, "ab") as f:
        f.write(b"x")
    with pytest.raises(AssertionError, match="hashed again"):
        cached_sha256(copy, root)


def _slice_worker(args: tuple[str, str]) -> str:
    src, cache = args
    return str(stage_slice(src, 5, 17, cache))


def test_concurrent_stage_slices(smollm2: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(3) as pool:
        paths = pool.map(_slice_worker, [(str(smollm2), str(cache))] * 3)
    assert len(set(paths)) == 1
    assert read_model_info(paths[0]).n_layer == 12
    leftovers = [p.name for p in (cache / "slices").iterdir() if not p.name.endswith((".gguf", ".lock"))]
    assert leftovers == []


def test_slice_refused_for_gemma(tmp_path: Path) -> None:
    src = make_gguf(tmp_path / "g.gguf", arch="gemma3")
    with pytest.raises(ModelError, match="cannot split g.gguf.*gemma3.*embedding"):
        stage_slice(src, 1, 3, tmp_path / "cache")
    with pytest.raises(ModelError, match="gemma3"):
        derive_gguf(src, [0, 1], tmp_path / "out.gguf")
    # The whole model is fine, also converted.
    assert stage_slice(src, 0, 4, tmp_path / "cache") == src
    out = derive_gguf(src, range(4), tmp_path / "whole.gguf", "f32")
    assert read_model_info(out).n_layer == 4


# ---------------------------------------------------------------- derive: types and llama.cpp


def test_derive_f16_types_and_values(smollm2: Path, smol_reader: gguf.GGUFReader, tmp_path: Path) -> None:
    layers = [0, 29, 29]
    out = derive_gguf(smollm2, layers, tmp_path / "f16.gguf", "f16")
    g = scan_gguf(out)
    assert g.get("llama.block_count") == 3
    assert g.get("general.file_type") == int(gguf.LlamaFileType.MOSTLY_F16)
    for t in g.tensors:
        assert t.ggml_type == (Q.F32 if len(t.shape) == 1 else Q.F16), t.name
    src = {t.name: t for t in smol_reader.tensors}

    def values(name: str) -> np.ndarray:
        t = next(t for t in g.tensors if t.name == name)
        return raw_tensor(g, name).view(np.float16 if t.ggml_type == Q.F16 else np.float32).reshape(src_shape(name))

    def src_shape(name: str) -> tuple[int, ...]:
        t = next(t for t in g.tensors if t.name == name)
        return tuple(reversed(t.shape))

    for i, L in enumerate(layers):
        for s, dt in (("ffn_down.weight", np.float16), ("attn_norm.weight", np.float32)):
            st = src[f"blk.{L}.{s}"]
            assert np.array_equal(values(f"blk.{i}.{s}"), dequantize(st.data, st.tensor_type).astype(dt))
    emb = src["token_embd.weight"]
    assert np.array_equal(values("token_embd.weight"), dequantize(emb.data, emb.tensor_type).astype(np.float16))
    # Loads in llama.cpp.
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, verbose=False)
    assert llm.n_embd() == 576 and llm.n_vocab() == 49152
    assert llm.tokenize(b"Hello, world") == [19556, 28, 905]


def test_slice_loads_in_llama_cpp(smollm2: Path, tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    path = stage_slice(smollm2, 12, 30, tmp_path / "cache")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False)
    assert llm.n_embd() == 576


# ---------------------------------------------------------------- derive: synthetic files


def test_derive_reindexes_per_layer_keys(tmp_path: Path) -> None:
    src = make_gguf(tmp_path / "src.gguf")
    info = read_model_info(src)
    assert set(info.per_layer_keys) == {"llama.attention.head_count", "llama.test.layer_names"}
    assert info.n_head == 10
    out = derive_gguf(src, [3, 1, 1, 0, 2], tmp_path / "out.gguf")
    r = gguf.GGUFReader(out)
    assert field(r, "llama.block_count") == 5
    assert field(r, "llama.attention.head_count") == [13, 11, 11, 10, 12]
    assert field(r, "llama.test.layer_names") == ["layer3", "layer1", "layer1", "layer0", "layer2"]
    assert field(r, "tokenizer.chat_template") == "{{ messages }}"
    assert field(r, "tokenizer.ggml.tokens") == [f"t{i}" for i in range(16)]
    ts = {t.name: t for t in r.tensors}
    st = tensors(src)
    for i, L in enumerate([3, 1, 1, 0, 2]):
        assert np.array_equal(ts[f"blk.{i}.ffn_up.weight"].data, st[f"blk.{L}.ffn_up.weight"].data)
        assert ts[f"blk.{i}.attn_norm.weight"].data[0] == L
    assert [t.name for t in r.tensors][0] == "token_embd.weight"
    assert [t.name for t in r.tensors][-1] == "output_norm.weight"
    assert read_model_info(out).per_layer_keys == info.per_layer_keys


def test_derive_is_deterministic(tmp_path: Path) -> None:
    src = make_gguf(tmp_path / "src.gguf")
    for typ in ("keep", "f16", "f32"):
        a = derive_gguf(src, [1, 2], tmp_path / f"a-{typ}.gguf", typ)
        b = derive_gguf(src, [1, 2], tmp_path / f"b-{typ}.gguf", typ)
        assert a.read_bytes() == b.read_bytes()
    # The hash derive reports is the file's.
    _, sha = derive_mod._derive(src, [1, 2], tmp_path / "c.gguf", "f16")
    assert sha == hashlib.sha256((tmp_path / "c.gguf").read_bytes()).hexdigest()
    f32 = tensors(tmp_path / "a-f32.gguf")
    assert f32["blk.0.ffn_up.weight"].tensor_type == Q.F32
    assert np.array_equal(f32["blk.0.ffn_up.weight"].data, tensors(src)["blk.1.ffn_up.weight"].data.astype(np.float32))


def test_derive_errors_leave_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_gguf(tmp_path / "src.gguf", per_layer=False)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ModelError, match="layer 4 does not exist"):
        derive_gguf(src, [0, 4], out_dir / "x.gguf")
    with pytest.raises(ModelError, match="no layers"):
        derive_gguf(src, [], out_dir / "x.gguf")
    with pytest.raises(ModelError, match="unknown output type 'q8'"):
        derive_gguf(src, [0], out_dir / "x.gguf", "q8")
    with pytest.raises(ModelError, match="does not exist"):
        derive_gguf(src, [0], tmp_path / "nodir" / "x.gguf")

    calls = []
    real = derive_mod._write_tensor

    def failing(*args):  # noqa: ANN002, ANN202
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(derive_mod, "_write_tensor", failing)
    with pytest.raises(ModelError, match="No space left"):
        derive_gguf(src, [0, 1], out_dir / "x.gguf")
    assert list(out_dir.iterdir()) == []
