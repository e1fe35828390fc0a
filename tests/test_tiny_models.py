"""The tiny random-weight models of tests/tiny_models.py: every recipe,
written at its own block count and at 6 layers, loads in llama-cpp-python
and greedy-decodes; files are deterministic; repeated blocks get their own
weights; every block reaches the logits."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_models import (
    RECIPES_DIR,
    default_layers,
    load_recipe,
    recipe_names,
    write_tiny_model,
)

NAMES = recipe_names()
EXPECTED = {"llama-dense", "llama-moe", "qwen2-dense", "qwen3-dense", "qwen3moe-moe", "qwen3next-moe", "qwen35-dense",
            "phi3-dense", "gemma2-dense", "gemma3-dense", "cohere2-dense", "deepseek2-moe", "glm4moe-moe",
            "nemotron_h-dense", "granitehybrid-dense", "gpt-oss-moe", "lfm2-dense", "mistral3-dense", "mistral3-moe"}


def greedy(path: Path, n: int = 8) -> tuple[list[int], np.ndarray]:
    """(n greedy tokens after "hello world", the logits after the prompt) with
    llama-cpp-python, 1 thread; asserts every step's logits are finite."""
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=128, n_threads=1, verbose=False, logits_all=True)
    try:
        toks = llm.tokenize(b"hello world")
        assert toks
        llm.eval(toks)
        first = np.array(llm.scores[llm.n_tokens - 1])
        out = []
        for _ in range(n):
            logits = llm.scores[llm.n_tokens - 1]
            assert np.isfinite(logits).all()
            out.append(int(np.argmax(logits)))
            llm.eval([out[-1]])
        return out, first
    finally:
        llm.close()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_recipes() -> None:
    assert set(NAMES) == EXPECTED
    assert sum(p.stat().st_size for p in RECIPES_DIR.glob("*.json")) < 1 << 20
    for name in NAMES:
        r = load_recipe(name)
        assert r["metadata"][0] == ["general.architecture", "STRING", None, r["arch"]]
        assert r["tensors"] and all(q == "F32" for _, _, q in r["tensors"])


def test_default_layers() -> None:
    assert default_layers(load_recipe("llama-dense"), 6) == [0, 1, 0, 1, 0, 1]
    assert default_layers(load_recipe("lfm2-dense"), 5) == [0, 1, 0, 1, 0]  # hybrid: attention, shortconv, ...
    assert default_layers(load_recipe("nemotron_h-dense"), 6) == [0, 1, 2, 0, 1, 2]
    for name in ("deepseek2-moe", "glm4moe-moe"):  # one leading dense block, then MoE blocks
        assert default_layers(load_recipe(name), 6) == [0, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("n_layer", [None, 6], ids=["own", "6"])
@pytest.mark.parametrize("name", NAMES)
def test_loads_and_decodes(name: str, n_layer: int | None, tmp_path: Path) -> None:
    path = write_tiny_model(name, tmp_path / "m.gguf", n_layer=n_layer)
    toks, _ = greedy(path)
    assert len(toks) == 8 and all(0 <= t < 128 for t in toks)


@pytest.mark.parametrize("name", NAMES)
def test_deterministic(name: str, tmp_path: Path) -> None:
    a = write_tiny_model(name, tmp_path / "a.gguf", n_layer=6)
    b = write_tiny_model(load_recipe(name), tmp_path / "b.gguf", n_layer=6)
    c = write_tiny_model(name, tmp_path / "c.gguf", n_layer=6, seed=1)
    assert sha256(a) == sha256(b) != sha256(c)


@pytest.mark.parametrize("name", NAMES)
def test_repeated_blocks(name: str, tmp_path: Path) -> None:
    """Blocks of a 6-layer model that copy the same recipe block (2 and 4 of
    a 2-block recipe, 2 and 5 of a 3-block one) have its tensor names and
    shapes with different weights; per-layer metadata arrays follow the
    layer list."""
    recipe = load_recipe(name)
    arch, layers = recipe["arch"], default_layers(recipe, 6)
    r = gguf.GGUFReader(write_tiny_model(recipe, tmp_path / "m.gguf", n_layer=6))
    ts = {t.name: t for t in r.tensors}

    def block(i: int) -> dict:
        return {n[len(f"blk.{i}."):]: t for n, t in ts.items() if n.startswith(f"blk.{i}.")}

    pairs = [(i, j) for j in range(6) for i in range(j) if layers[i] == layers[j]]
    assert (2, 4) in pairs or (2, 5) in pairs
    for i, j in pairs:
        bi, bj = block(i), block(j)
        assert bi and bi.keys() == bj.keys()
        for s, t in bi.items():
            assert t.shape.tolist() == bj[s].shape.tolist()
            assert not np.array_equal(t.data, bj[s].data), (i, j, s)
    assert r.fields[f"{arch}.block_count"].contents() == 6
    n_rec = next(v for k, _, _, v in recipe["metadata"] if k == f"{arch}.block_count")
    for key, vtype, _, val in recipe["metadata"]:
        if vtype == "ARRAY" and key.startswith(f"{arch}.") and len(val) == n_rec:
            assert r.fields[key].contents() == pytest.approx([val[j] for j in layers]), key


@pytest.mark.parametrize("name", NAMES)
def test_last_block_matters(name: str, tmp_path: Path) -> None:
    """Dropping block 5 of the 6-layer model changes the logits after the
    prompt (the other blocks' weights are the same: seeded by tensor name)."""
    recipe = load_recipe(name)
    layers = default_layers(recipe, 6)
    _, l6 = greedy(write_tiny_model(recipe, tmp_path / "6.gguf", layers=layers), n=0)
    _, l5 = greedy(write_tiny_model(recipe, tmp_path / "5.gguf", layers=layers[:5]), n=0)
    assert np.abs(l6 - l5).max() > 0.05 * l6.std()
