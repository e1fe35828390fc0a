"""Random-weight models of real shapes (ggpipe.models.random_model): the
Q4_K_M type plan against llama.cpp's rule, the blocks' statistics and
determinism, the registry entries, and (full tier) a 1B-shaped derivation
checked by hash and run by llama.cpp, and llama.cpp's quantizer keeping
every type of a generated file."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from conftest import assert_registry_refused, generate_json
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize

from ggpipe.errors import ModelError
from ggpipe.models import registry as reg
from ggpipe.models.gguf_info import read_model_info
from ggpipe.models.quant_plan import q4_k_m_types
from ggpipe.models.random_model import WEIGHT_STD, _RandomTensor, random_tensors, write_random_gguf
from ggpipe.models.shapes import ARCHITECTURES, Architecture

# the layers whose attn_v and ffn_down a Q4_K_M of 32 layers has in Q6_K (e.g.
# Meta-Llama-3-8B-Instruct-Q4_K_M.gguf), and of 16 layers (Llama-3.2-1B's)
MORE_BITS_32 = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}
MORE_BITS_16 = {0, 1, 4, 7, 10, 13, 14, 15}


def plan(arch: Architecture) -> dict[str, Q]:
    tensors = random_tensors(arch)
    return dict(zip([n for n, _ in tensors], q4_k_m_types(tensors, arch.n_layer, arch.n_head, arch.n_head_kv)))


def expected(arch: Architecture, more_bits: set[int], other_v: Q = Q.Q4_K) -> dict[str, Q]:
    out = {"token_embd.weight": Q.Q6_K if arch.tied else Q.Q4_K, "output_norm.weight": Q.F32}
    if not arch.tied:
        out["output.weight"] = Q.Q6_K
    for i in range(arch.n_layer):
        for t in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            out[f"blk.{i}.{t}.weight"] = Q.Q4_K
        out[f"blk.{i}.attn_norm.weight"] = out[f"blk.{i}.ffn_norm.weight"] = Q.F32
        out[f"blk.{i}.attn_v.weight"] = Q.Q6_K if i in more_bits else other_v
        out[f"blk.{i}.ffn_down.weight"] = Q.Q6_K if i in more_bits else Q.Q4_K
    return out


def test_the_7b_shape_gets_llama_cpp_q4_k_m_types():
    arch = ARCHITECTURES["llama-7b-shape"]
    assert plan(arch) == expected(arch, MORE_BITS_32)
    assert len(random_tensors(arch)) == 2 + 9 * 32 + 1


def test_the_tied_1b_shape_keeps_its_embedding_in_q6_k():
    arch = ARCHITECTURES["llama-1b-shape"]
    assert plan(arch) == expected(arch, MORE_BITS_16)


def test_a_70b_llama_with_grouped_heads_has_its_other_attn_v_in_q5_k():
    arch = Architecture(80, 256, 256, 8, 1, 256)
    more = {i for i in range(80) if i < 10 or i >= 70 or (i - 10) % 3 == 2}
    assert plan(arch) == expected(arch, more, other_v=Q.Q5_K)


def test_rows_that_are_not_whole_super_blocks_are_refused():
    with pytest.raises(ModelError, match="576.*multiple of 256"):
        plan(Architecture(30, 576, 1536, 9, 3, 49152))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_blocks_dequantize_to_small_centred_weights(qtype):
    t = _RandomTensor(qtype, (4096, 64), seed=3, index=5)
    data = np.concatenate(list(t.chunks())).reshape(t.shape)
    assert data.nbytes == t.nbytes
    w = dequantize(data, qtype)
    assert w.shape == (64, 4096) and np.isfinite(w).all()
    assert abs(float(w.std()) - WEIGHT_STD) < 0.001 and abs(float(w.mean())) < 0.001


def test_blocks_depend_on_seed_and_tensor_only():
    def raw(seed, index):
        return np.concatenate(list(_RandomTensor(Q.Q4_K, (4096, 32), seed, index).chunks())).tobytes()

    assert raw(1, 2) == raw(1, 2)
    assert raw(1, 2) != raw(1, 3) and raw(1, 2) != raw(2, 2)


def test_the_registry_has_both_shapes():
    entries = reg.load_registry()
    for name, shape in (("llama-7b-shape-q4_k_m", "llama-7b-shape:Q4_K_M"),
                        ("llama-1b-shape-q4_k_m", "llama-1b-shape:Q4_K_M")):
        e = entries[name]
        assert (e.random, e.base, e.is_random, e.is_derived, e.is_described) == (shape, "smollm2-135m", True, True,
                                                                                  False)
        assert isinstance(e.seed, int) and e.size and e.sha256 and "never acceptance" in e.description


_HEAD = f'[models.a]\narch="llama"\nsize=1\nsha256="{"0" * 64}"\n'
_BASE = '[models.b]\narch="llama"\nsize=1\nsha256="' + "0" * 64 + '"\npypi="x==1"\nmember="m"\n'


@pytest.mark.parametrize("body,words", [
    ('random="llama-7b-shape:Q4_K_M"\nseed=1\n', ["'a'", "'random' needs 'base'"]),
    ('base="b"\nrandom="llama-7b-shape:Q4_K_M"\nseed=1\nlayers="0-3"\n', ["'a'", "'layers'", "'random'"]),
    ('base="b"\nrandom="llama-7b-shape:Q4_K_M"\n', ["'a'", "seed"]),
    ('base="b"\nrandom="llama-7b-shape:Q4_K_M"\nseed=-1\n', ["'a'", "seed", "-1"]),
    ('base="b"\nrandom="llama-7b-shape:Q8_0"\nseed=1\n', ["'a'", "random", "Q4_K_M only"]),
    ('base="b"\nrandom="qwen3-30b-a3b:Q4_K_M"\nseed=1\n', ["'a'", "random", "dense"]),
    ('base="b"\nrandom="nope:Q4_K_M"\nseed=1\n', ["'a'", "random", "nope"]),
    ('base="b"\nlayers="0"\nseed=1\n', ["'a'", "'seed' only applies"]),
])
def test_bad_random_entries(tmp_path, monkeypatch, body, words):
    p = tmp_path / "models.toml"
    p.write_text(_BASE + _HEAD + body)
    monkeypatch.setenv("GGPIPE_MODELS", str(p))
    assert_registry_refused(p, words)


def test_a_base_with_another_vocabulary_is_refused(smollm2, tmp_path):
    with pytest.raises(ModelError, match="49152 tokens but the shape's vocabulary is 32000"):
        write_random_gguf(Architecture(2, 256, 256, 2, 1, 32000), smollm2, tmp_path / "x.gguf", 1, "x")
    assert not list(tmp_path.iterdir())


@pytest.mark.full  # derives 0.67 GB and runs it: ~15 s
def test_the_1b_shape_derives_to_its_hash_and_runs(smollm2, tmp_path, monkeypatch):
    monkeypatch.delenv("GGPIPE_MODELS", raising=False)
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "smollm2-135m.gguf").symlink_to(smollm2)
    monkeypatch.setenv("GGPIPE_CACHE", str(cache))
    path = reg.fetch("llama-1b-shape-q4_k_m", progress=False)  # checks size and sha256
    assert path == cache / "models" / "llama-1b-shape-q4_k_m.gguf"
    info = read_model_info(path)
    assert (info.arch, info.n_layer, info.n_embd, info.n_vocab) == ("llama", 16, 2048, 49152)
    assert info.chat_template == read_model_info(smollm2).chat_template
    out = generate_json(path, "Hello", 4, None)  # ggpipe refuses non-finite logits
    assert len(out["tokens"]) == 4


@pytest.mark.full  # llama.cpp requantizes a 32-layer file: ~10 s
def test_llama_cpp_requantizing_to_q4_k_m_keeps_every_type(smollm2, tmp_path):
    import llama_cpp

    arch = Architecture(32, 256, 512, 4, 1, 49152)  # the 7B shape's tensor list, narrow
    src, out = tmp_path / "src.gguf", tmp_path / "out.gguf"
    write_random_gguf(arch, smollm2, src, 1, "narrow")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = 15, True, 1  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(out), ctypes.byref(params)) == 0
    ours = {t.name: t.tensor_type for t in GGUFReader(src).tensors}
    theirs = {t.name: t.tensor_type for t in GGUFReader(out).tensors}
    assert ours == theirs == expected(arch, MORE_BITS_32)
