"""Layer lists, GGUF derivation and runtime stage slices, on the real
SmolLM2-135M weights and on small synthetic GGUFs."""

from __future__ import annotations

import dataclasses
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
from ggpipe.models import gguf_info
from ggpipe.models.cache import cached_sha256
from ggpipe.models.derive import (
    SLICE_RULES,
    derive_gguf,
    format_layer_list,
    parse_layer_list,
    stage_slice,
)
from ggpipe.models.gguf_info import info_from_reader, load_gguf, read_model_info

Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------- helpers


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
    """The GGUFReader derive itself keeps for its source (parsing the
    49152-token vocabulary takes about 2 s: done once here)."""
    return load_gguf(smollm2, keep=True)


@pytest.fixture(scope="module")
def slice_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for this module's stage slices (the model info of the source
    is remembered there once)."""
    return tmp_path_factory.mktemp("slice-cache")


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.full  # slices the real GGUF: 14 s
def test_stage_slices(smollm2: Path, smol_reader: gguf.GGUFReader, slice_cache: Path) -> None:
    cache = slice_cache
    assert stage_slice(smollm2, 0, 30, cache) == smollm2
    a = stage_slice(smollm2, 0, 12, cache)
    b = stage_slice(smollm2, 12, 30, cache)
    sha = sha256_of(smollm2)
    assert a == cache / "slices" / f"{sha[:16]}-0-12-r{SLICE_RULES}.gguf"
    assert b.name == f"{sha[:16]}-12-30-r{SLICE_RULES}.gguf"
    src = {t.name: t for t in smol_reader.tensors}
    per_block = [n.split(".", 2)[2] for n in src if n.startswith("blk.0.")]
    assert len(per_block) == 9

    # Slice a: its model info (remembered in the cache, so the second call
    # below does not parse it again).
    info_a, info_src = read_model_info(a, cache), read_model_info(smollm2, cache)
    assert info_a.n_layer == 12 and info_a.n_tensors == 2 + 12 * len(per_block)
    assert info_a.kv_rows == info_src.kv_rows[:12]  # per layer: the slice's own
    assert dataclasses.replace(info_a, path=smollm2, n_layer=30, n_tensors=272, file_size=0,
                               kv_rows=info_src.kv_rows) == dataclasses.replace(
        info_src, file_size=0
    )

    # Slice b: blocks renamed, data identical; every other metadata entry has
    # the source's type and value, in the source's order.
    rb = gguf.GGUFReader(b)
    assert field(rb, "llama.block_count") == 18
    names = [t.name for t in rb.tensors]
    assert names[0] == "token_embd.weight" and names[-1] == "output_norm.weight" and len(names) == 2 + 18 * 9
    tb = {t.name: t for t in rb.tensors}
    for i in (0, 7, 17):
        for s in per_block:
            got, want = tb[f"blk.{i}.{s}"], src[f"blk.{12 + i}.{s}"]
            assert got.tensor_type == want.tensor_type and list(got.shape) == list(want.shape)
            assert np.array_equal(got.data, want.data)
    assert np.array_equal(tb["token_embd.weight"].data, src["token_embd.weight"].data)
    assert list(rb.fields) == list(smol_reader.fields)
    for key, f in smol_reader.fields.items():
        if key not in ("llama.block_count", "GGUF.tensor_count"):
            assert rb.fields[key].types == f.types and field(rb, key) == f.contents(), key

    # Second call: the cached slice, not rebuilt.
    mtime = a.stat().st_mtime_ns
    assert stage_slice(smollm2, 0, 12, cache) == a and a.stat().st_mtime_ns == mtime
    # A damaged cached slice is rebuilt, the same bytes again.
    sha_a = sha256_of(a)
    with open(a, "r+b") as f:
        f.truncate(1000)
    assert stage_slice(smollm2, 0, 12, cache) == a and sha256_of(a) == sha_a
    for bad in [(0, 0), (5, 3), (-1, 4), (20, 31)]:
        with pytest.raises(ModelError, match="layer range"):
            stage_slice(smollm2, *bad, cache)

    # The last slice loads in llama.cpp.
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(b), n_ctx=64, verbose=False)
    assert llm.n_embd() == 576


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


def test_model_info_is_remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """read_model_info parses once per (realpath, size, mtime) and remembers
    the result next to the remembered hashes; an unusable cache just parses."""
    src = make_gguf(tmp_path / "src.gguf")
    root = tmp_path / "cache"
    info = read_model_info(src, root)
    assert info == info_from_reader(load_gguf(src), src)
    assert len(list((root / "hashes").glob("*.info.json"))) == 1

    def boom(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("parsed again")

    monkeypatch.setattr(gguf_info, "_parse_in_child", boom)  # the parse runs in a bounded child process
    again = read_model_info(src, root)
    assert again == info and isinstance(again.per_layer_keys, tuple)
    link = tmp_path / "link.gguf"
    link.symlink_to(src)
    assert read_model_info(link, root) == dataclasses.replace(info, path=link)  # same realpath
    # Changing the file invalidates the record; so does a damaged record.
    os.utime(src, ns=(0, 0))
    with pytest.raises(AssertionError, match="parsed again"):
        read_model_info(src, root)
    monkeypatch.undo()
    assert read_model_info(src, root) == info
    for rec in (root / "hashes").glob("*.info.json"):
        rec.write_text("{not json")
    monkeypatch.setattr(gguf_info, "_parse_in_child", boom)
    with pytest.raises(AssertionError, match="parsed again"):
        read_model_info(src, root)
    monkeypatch.undo()
    # An unwritable cache: no error, parsed each time.
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert read_model_info(src, blocker / "cache") == info
    # Errors are not remembered.
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(src.read_bytes()[:200])
    for _ in range(2):
        with pytest.raises(ModelError, match="truncated"):
            read_model_info(bad, root)


def _slice_worker(args: tuple[str, str]) -> str:
    src, cache = args
    return str(stage_slice(src, 5, 17, cache))


@pytest.mark.full  # 9 s
def test_concurrent_stage_slices(smollm2: Path, slice_cache: Path, tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(3) as pool:
        paths = pool.map(_slice_worker, [(str(smollm2), str(slice_cache))] * 3)
    assert len(set(paths)) == 1
    assert Path(paths[0]).read_bytes() == derive_gguf(smollm2, range(5, 17), tmp_path / "ref.gguf").read_bytes()
    leftovers = [p.name for p in (slice_cache / "slices").iterdir() if not p.name.endswith((".gguf", ".lock"))]
    assert leftovers == []


def test_slice_refused_for_gemma(tmp_path: Path) -> None:
    src = make_gguf(tmp_path / "g.gguf", arch="gemma2")
    cache = tmp_path / "cache"
    with pytest.raises(ModelError, match="cannot split g.gguf.*gemma2.*input by sqrt"):
        stage_slice(src, 1, 3, cache)
    with pytest.raises(ModelError, match="gemma2"):
        derive_gguf(src, [0, 1], tmp_path / "out.gguf")
    # The whole model is fine, also converted.
    assert stage_slice(src, 0, 4, cache) == src
    out = derive_gguf(src, range(4), tmp_path / "whole.gguf", "f32")
    assert read_model_info(out, cache).n_layer == 4


# ---------------------------------------------------------------- derive: types and llama.cpp


@pytest.mark.full  # 6 s
def test_derive_f16_types_and_values(smollm2: Path, smol_reader: gguf.GGUFReader, tmp_path: Path) -> None:
    layers = [0, 29, 29]
    out = derive_gguf(smollm2, layers, tmp_path / "f16.gguf", "f16")
    r = gguf.GGUFReader(out)
    assert field(r, "llama.block_count") == 3
    assert field(r, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_F16)
    assert r.fields["general.file_type"].types == [gguf.GGUFValueType.UINT32]
    assert list(r.fields) == list(smol_reader.fields)  # file_type stays in its place
    for t in r.tensors:
        assert t.tensor_type == (Q.F32 if len(t.shape) == 1 else Q.F16), t.name
    got = {t.name: t for t in r.tensors}
    src = {t.name: t for t in smol_reader.tensors}
    for i, L in enumerate(layers):
        for s, dt in (("ffn_down.weight", np.float16), ("attn_norm.weight", np.float32)):
            st, gt = src[f"blk.{L}.{s}"], got[f"blk.{i}.{s}"]
            assert list(gt.shape) == list(st.shape)
            assert gt.data.dtype == dt and np.array_equal(gt.data, dequantize(st.data, st.tensor_type).astype(dt))
    emb = src["token_embd.weight"]
    assert np.array_equal(got["token_embd.weight"].data, dequantize(emb.data, emb.tensor_type).astype(np.float16))
    # Loads in llama.cpp.
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, verbose=False)
    assert llm.n_embd() == 576 and llm.n_vocab() == 49152
    assert llm.tokenize(b"Hello, world") == [19556, 28, 905]


# ---------------------------------------------------------------- derive: synthetic files


def test_derive_reindexes_per_layer_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = make_gguf(tmp_path / "src.gguf")
    cache = tmp_path / "cache"
    info = read_model_info(src, cache)
    assert set(info.per_layer_keys) == {"llama.attention.head_count", "llama.test.layer_names"}
    assert info.n_head == 10
    with caplog.at_level("WARNING"):
        out = derive_gguf(src, [3, 1, 1, 0, 2], tmp_path / "out.gguf")
    assert not [rec for rec in caplog.records if "Duplicated" in rec.getMessage()]
    r = gguf.GGUFReader(out)  # it would raise on a duplicated key
    assert list(r.fields) == list(gguf.GGUFReader(src).fields)
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
    assert read_model_info(out, cache).per_layer_keys == info.per_layer_keys


def test_derive_keeps_alignment_and_quantized_shapes(tmp_path: Path) -> None:
    """A custom general.alignment is kept (the writer pads to it) and raw
    quantized tensors keep their element shape."""
    src = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_custom_alignment(64)
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_array("tokenizer.ggml.tokens", ["a", "b"])
    rng = np.random.default_rng(1)
    for i in range(2):
        q = gguf.quants.quantize(rng.standard_normal((3, 64), dtype=np.float32), Q.Q8_0)
        w.add_tensor(f"blk.{i}.ffn_up.weight", q, raw_dtype=Q.Q8_0)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.full(5, i, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = derive_gguf(src, [1, 0, 1], tmp_path / "out.gguf")
    r, s = gguf.GGUFReader(out), tensors(src)
    assert r.alignment == 64 and field(r, "general.alignment") == 64
    for t in r.tensors:
        assert t.data_offset % 64 == 0
    t = {t.name: t for t in r.tensors}["blk.0.ffn_up.weight"]
    assert t.tensor_type == Q.Q8_0 and list(t.shape) == [64, 3]
    assert np.array_equal(t.data, s["blk.1.ffn_up.weight"].data)
    f16 = derive_gguf(src, [1], tmp_path / "f16.gguf", "f16")
    t = tensors(f16)["blk.0.ffn_up.weight"]
    assert t.tensor_type == Q.F16 and list(t.shape) == [64, 3]
    want = dequantize(s["blk.1.ffn_up.weight"].data, Q.Q8_0).astype(np.float16)
    assert np.array_equal(t.data, want)


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

    # The disk fills up while the writer writes tensor data.
    calls = []
    real = gguf.GGUFWriter.write_padding

    def failing(self, *args):  # noqa: ANN001, ANN002, ANN202
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(self, *args)

    monkeypatch.setattr(gguf.GGUFWriter, "write_padding", failing)
    for typ in ("keep", "f16"):
        calls.clear()
        with pytest.raises(ModelError, match="No space left"):
            derive_gguf(src, [0, 1], out_dir / "x.gguf", typ)
        assert list(out_dir.iterdir()) == []
