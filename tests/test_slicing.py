"""The slicing rule (ggpipe.models.slicing): which metadata a layer slice
must carry so that llama.cpp computes for its blocks what the whole model
computes (fast, no llama.cpp). The per-architecture proof on real graphs is
tests/test_arch_families.py."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGUFValueType

from ggpipe.errors import ConfigError, ModelError
from ggpipe.models.derive import derive_gguf
from ggpipe.models.slicing import check_speculation, slice_metadata


def _model(path: Path, arch: str, n_layer: int, **meta) -> gguf.GGUFReader:
    """A GGUF with ``n_layer`` one-tensor blocks and ``{arch}.<key>`` entries
    from ``meta`` (ints as UINT32, floats as FLOAT32, lists as bool arrays)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_embedding_length(8)
    w.add_uint32(f"{arch}.vocab_size", 4)
    for key, v in meta.items():
        key = f"{arch}.{key.replace('__', '.')}"
        if isinstance(v, list):
            w.add_array(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        else:
            w.add_uint32(key, v)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.full(8, i, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


def _flags(meta: dict, key: str) -> list[bool]:
    value, vtype, sub = meta[key]
    assert (vtype, sub) == (GGUFValueType.ARRAY, GGUFValueType.BOOL)
    return value


def test_sliding_window_pattern_is_written_per_layer(tmp_path):
    """Gemma 3's default period 6 (load_swa_pattern(ml, 6)): five local
    layers then a global one, counted from the whole model's block 0."""
    r = _model(tmp_path / "g.gguf", "gemma3", 12, attention__sliding_window=32)
    m = slice_metadata(r, "gemma3", 12, range(3, 9))
    assert _flags(m, "gemma3.attention.sliding_window_pattern") == [True, True, False, True, True, True]
    r = _model(tmp_path / "g4.gguf", "gemma3", 12, attention__sliding_window_pattern=4)  # the GGUF's own period
    assert _flags(slice_metadata(r, "gemma3", 12, range(2, 5)),
                  "gemma3.attention.sliding_window_pattern") == [True, False, True]
    for arch, period in (("gpt-oss", 2), ("cohere2", 4)):
        r = _model(tmp_path / f"{arch}.gguf", arch, 8)
        assert _flags(slice_metadata(r, arch, 8, range(1, 8)), f"{arch}.attention.sliding_window_pattern") == [
            il % period < period - 1 for il in range(1, 8)]


def test_a_per_layer_array_is_kept(tmp_path):
    r = _model(tmp_path / "g.gguf", "gemma3", 4, attention__sliding_window_pattern=[True, False, True, False])
    assert _flags(slice_metadata(r, "gemma3", 4, range(1, 3)), "gemma3.attention.sliding_window_pattern") == [
        False, True]


def test_a_slice_of_global_layers_only(tmp_path):
    """llama.cpp asserts is_swa_any() for a sliding-window model: Gemma 3's
    slice turns the window off (sliding_window 0: its non-SWA graph); an
    architecture that cannot is refused in one line."""
    r = _model(tmp_path / "g.gguf", "gemma3", 8, attention__sliding_window=32)
    m = slice_metadata(r, "gemma3", 8, range(5, 6))
    assert _flags(m, "gemma3.attention.sliding_window_pattern") == [False]
    assert m["gemma3.attention.sliding_window"][0] == 0
    assert "gemma3.attention.sliding_window" not in slice_metadata(r, "gemma3", 8, range(4, 6))
    r = _model(tmp_path / "o.gguf", "gpt-oss", 8, attention__sliding_window=32)
    with pytest.raises(ModelError, match="blocks 5-5 of this gpt-oss model are all global-attention blocks"):
        slice_metadata(r, "gpt-oss", 8, range(5, 6))


def test_recurrent_layers_of_qwen35(tmp_path):
    """Recurrent unless (il + 1) % full_attention_interval == 0 (default 4)."""
    r = _model(tmp_path / "q.gguf", "qwen35", 8, attention__head_count=2)
    assert _flags(slice_metadata(r, "qwen35", 8, range(2, 8)), "qwen35.attention.recurrent_layers") == [
        True, False, True, True, True, False]
    r = _model(tmp_path / "q2.gguf", "qwen35", 8, full_attention_interval=2, attention__head_count=2)
    assert _flags(slice_metadata(r, "qwen35", 8, range(0, 3)), "qwen35.attention.recurrent_layers") == [
        True, False, True]


def test_leading_dense_blocks_are_shifted(tmp_path):
    r = _model(tmp_path / "d.gguf", "deepseek2", 8, leading_dense_block_count=3)
    assert slice_metadata(r, "deepseek2", 8, range(0, 4))["deepseek2.leading_dense_block_count"][0] == 3
    assert slice_metadata(r, "deepseek2", 8, range(2, 6))["deepseek2.leading_dense_block_count"][0] == 1
    assert slice_metadata(r, "deepseek2", 8, range(4, 8))["deepseek2.leading_dense_block_count"][0] == 0
    with pytest.raises(ModelError, match="leading dense block .* after a mixture-of-experts block"):
        slice_metadata(r, "deepseek2", 8, [0, 5, 1])


def test_embedding_scale_only_on_the_first_stage(tmp_path):
    """llama.cpp's build_inp_embd scales hidden-state input too: later slices get 0 (no scale)."""
    r = _model(tmp_path / "g.gguf", "granitehybrid", 6, embedding_scale=12.0, attention__head_count_kv=[2, 0] * 3)
    assert "granitehybrid.embedding_scale" not in slice_metadata(r, "granitehybrid", 6, range(0, 3))
    assert slice_metadata(r, "granitehybrid", 6, range(3, 6))["granitehybrid.embedding_scale"][0] == 0.0


def test_a_hybrid_slice_needs_both_kinds_of_block(tmp_path):
    """llama.cpp's hybrid memory aborts with an empty KV cache or recurrent
    state: every slice holds an attention and a recurrent block."""
    r = _model(tmp_path / "l.gguf", "lfm2", 6, attention__head_count_kv=[2, 0, 0, 0, 2, 0])
    slice_metadata(r, "lfm2", 6, range(0, 2))
    for layers, what in ((range(1, 4), "attention"), (range(4, 5), "recurrent")):
        with pytest.raises(ModelError, match=f"blocks {layers[0]}-{layers[-1]} of this lfm2 model hold no {what}"):
            slice_metadata(r, "lfm2", 6, layers)
    # Nemotron-H: no KV heads and a feed-forward part is an MLP block (neither kind)
    r = _model(tmp_path / "n.gguf", "nemotron_h", 3, attention__head_count_kv=[2, 0, 0], feed_forward_length=[0, 0, 64])
    slice_metadata(r, "nemotron_h", 3, range(0, 2))
    with pytest.raises(ModelError, match="hold no recurrent block"):
        slice_metadata(r, "nemotron_h", 3, [0, 2])
    with pytest.raises(ModelError, match="hold no attention block"):
        slice_metadata(r, "nemotron_h", 3, range(1, 3))
    # Qwen 3.5: recurrent unless (il + 1) % 4 == 0
    r = _model(tmp_path / "q.gguf", "qwen35", 8, attention__head_count=2)
    slice_metadata(r, "qwen35", 8, range(2, 4))
    with pytest.raises(ModelError, match="hold no attention block"):
        slice_metadata(r, "qwen35", 8, range(4, 7))


def test_mtp_blocks_stay_whole_at_the_end(tmp_path):
    r = _model(tmp_path / "m.gguf", "glm4moe", 10, nextn_predict_layers=2)
    assert slice_metadata(r, "glm4moe", 10, range(0, 4))["glm4moe.nextn_predict_layers"][0] == 0
    assert slice_metadata(r, "glm4moe", 10, range(4, 10))["glm4moe.nextn_predict_layers"][0] == 2
    with pytest.raises(ModelError, match="only part of the model's 2 MTP blocks"):
        slice_metadata(r, "glm4moe", 10, range(4, 9))


def test_derive_writes_what_the_slice_needs(tmp_path):
    src = _model(tmp_path / "g.gguf", "gemma3", 12, attention__sliding_window=32)
    del src
    out = derive_gguf(tmp_path / "g.gguf", range(5, 8), tmp_path / "s.gguf")
    f = gguf.GGUFReader(str(out)).fields["gemma3.attention.sliding_window_pattern"]
    assert [bool(x) for x in f.contents()] == [False, True, True]
    whole = derive_gguf(tmp_path / "g.gguf", range(12), tmp_path / "w.gguf")  # the whole model: nothing added
    assert "gemma3.attention.sliding_window_pattern" not in gguf.GGUFReader(str(whole)).fields


def test_speculation_refuses_recurrent_models():
    from ggpipe.decoding.mode import mode_class

    assert not mode_class("iterative").speculates  # the engine checks speculating modes only
    check_speculation("pipeinfer", {"a.gguf": False, "b.gguf": False})
    with pytest.raises(ConfigError, match=r"^--mode pipeinfer cannot run lfm2.gguf: .*recurrent.*--mode iterative$"):
        check_speculation("pipeinfer", {"t.gguf": False, "lfm2.gguf": True})


def test_rope_sections_are_not_per_layer(tmp_path):
    """M-RoPE's 4 sections stay whole in a slice of a 4-block model."""
    from ggpipe.models.gguf_info import read_model_info

    _model(tmp_path / "q.gguf", "qwen35", 4, rope__dimension_sections=[11, 11, 10, 0],
           attention__head_count_kv=[0, 0, 0, 2])
    info = read_model_info(tmp_path / "q.gguf", tmp_path / "cache")
    assert info.per_layer_keys == ("qwen35.attention.head_count_kv",)
    out = derive_gguf(tmp_path / "q.gguf", range(1, 4), tmp_path / "s.gguf")
    assert list(gguf.GGUFReader(str(out)).fields["qwen35.rope.dimension_sections"].contents()) == [11, 11, 10, 0]
