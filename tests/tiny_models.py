"""Tiny random-weight GGUF models of many llama.cpp architectures, written
with the ``gguf`` package from the JSON recipes in tests/data/tiny_archs
(made by ``python scripts/tiny_recipes.py dump`` from llama.cpp's own
fixture generator test-llama-archs: its metadata and tensor list, no
weights).

The models are small: 128-token vocabulary (tokenizer model ``test``, tokens
``tok_i``), embedding 128 or 256, 2 or 3 recipe blocks that
``write_tiny_model`` repeats to any depth, about 2.5 MB of F32 a block.

    from tiny_models import recipe_names, write_tiny_model
    path = write_tiny_model("deepseek2-moe", tmp_path / "m.gguf", n_layer=6)
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import gguf
import numpy as np

RECIPES_DIR = Path(__file__).resolve().parent / "data" / "tiny_archs"
_DTYPES = {"F32": np.float32, "F16": np.float16}


def recipe_names() -> list[str]:
    """Stems of the recipes (``llama-moe``, ``qwen3next-moe``, ...), sorted."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.json"))


def load_recipe(name: str) -> dict:
    """Recipe ``name``: {"arch", "source", "metadata": [[key, GGUFValueType
    name, array item type name or None, value], ...], "tensors": [[name,
    shape in GGUF order (ne0 first), GGMLQuantizationType name], ...]}."""
    return json.loads((RECIPES_DIR / f"{name}.json").read_text(encoding="utf-8"))


def _meta(recipe: dict, key: str):
    return next((v for k, _, _, v in recipe["metadata"] if k == key), None)


def _split(recipe: dict) -> tuple[list, list[list], list]:
    """(pre-block tensors, per recipe block [(suffix, shape, type), ...],
    post-block tensors), each in recipe order. Suffix: the name after ``blk.N.``."""
    pre, post, blocks = [], [], [[] for _ in range(_meta(recipe, f"{recipe['arch']}.block_count"))]
    for name, shape, qtype in recipe["tensors"]:
        if name.startswith("blk."):
            _, i, suffix = name.split(".", 2)
            blocks[int(i)].append((suffix, shape, qtype))
        else:
            (post if any(blocks) else pre).append((name, shape, qtype))
    return pre, blocks, post


def default_layers(recipe: dict, n_layer: int) -> list[int]:
    """The recipe block each of ``n_layer`` output blocks copies.

    A recipe whose block 0 alone differs (names/shapes/types) and whose
    metadata says ``{arch}.leading_dense_block_count`` = 1 (deepseek2,
    glm4moe: a dense block before the MoE ones) gives [0, 1, 1, ...]. Any
    other recipe cycles its blocks, [0, 1, 0, 1, ...] ([0, 1, 2, 0, ...] for
    3), so hybrid models keep their attention/recurrent pattern, which the
    loader takes from per-layer metadata (head_count_kv arrays, recurrent
    layer lists) or from a fixed interval (qwen35/qwen3next: every 2nd layer
    is attention)."""
    blocks = _split(recipe)[1]
    nb = len(blocks)
    if (nb > 1 and blocks[0] != blocks[1] and all(b == blocks[1] for b in blocks[1:])
            and _meta(recipe, f"{recipe['arch']}.leading_dense_block_count") == 1):
        return [0] + [1] * (n_layer - 1)
    return [i % nb for i in range(n_layer)]


def tensor_data(name: str, shape: list[int], qtype: str, seed: int = 0, stdev: float = 0.1) -> np.ndarray:
    """Normal(0, stdev) values for tensor ``name`` (its OUTPUT name), seeded by
    (seed, crc32(name)): the same name and seed give the same values, two
    names different ones. ``shape`` is in GGUF order (ne0 first); the numpy
    array is the reverse (C order, ne0 the last axis). F32 -> float32, F16 ->
    float16 (rounded from the same float64 draws). Tensors whose name holds
    ``ssm_a`` (Mamba's A, a decay) get -|values|, as test-llama-archs does."""
    if qtype not in _DTYPES:
        raise ValueError(f"{name}: tensor type {qtype} not supported (F32 and F16 only)")
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    v = rng.normal(0.0, stdev, size=tuple(reversed(shape)))
    if "ssm_a" in name:
        v = -np.abs(v)
    return v.astype(_DTYPES[qtype])


def write_tiny_model(recipe_or_name: dict | str, out_path: str | Path, n_layer: int | None = None,
                     layers: list[int] | None = None, seed: int = 0, stdev: float = 0.1) -> Path:
    """Write a GGUF of the recipe's architecture with ``len(layers)`` blocks
    and random weights; return its path.

    ``layers[i]`` is the recipe block that output block i copies (names,
    shapes, types); default ``default_layers(recipe, n_layer)``, ``n_layer``
    defaulting to the recipe's block count. Metadata: the recipe's, with its
    value types, in its order; ``{arch}.block_count`` = len(layers); every
    ``{arch}.*`` array as long as the recipe's block count (a per-layer
    array: head counts, recurrent layers, SWA pattern, ...) re-indexed by
    ``layers``; empty arrays are left out (gguf's writer refuses them; the
    recipes' are the unused tokenizer.ggml.merges and classifier labels).
    Tensors: pre-block ones, blk.0 .. blk.{n-1}, then post-block ones, each
    with ``tensor_data(output name, ...)``, so repeated blocks get different
    weights. The same arguments give the same bytes."""
    recipe = load_recipe(recipe_or_name) if isinstance(recipe_or_name, str) else recipe_or_name
    arch = recipe["arch"]
    pre, blocks, post = _split(recipe)
    if layers is None:
        layers = default_layers(recipe, len(blocks) if n_layer is None else n_layer)
    elif n_layer is not None and n_layer != len(layers):
        raise ValueError(f"n_layer {n_layer} != len(layers) {len(layers)}")
    if not layers or any(not 0 <= j < len(blocks) for j in layers):
        raise ValueError(f"layers {layers}: need at least one, each in 0..{len(blocks) - 1}")

    out_path = Path(out_path)
    w = gguf.GGUFWriter(out_path, arch)
    for key, vtype, sub, val in recipe["metadata"]:
        if key == "general.architecture" or (vtype == "ARRAY" and not val):
            continue
        if key == f"{arch}.block_count":
            val = len(layers)
        elif vtype == "ARRAY" and key.startswith(f"{arch}.") and len(val) == len(blocks):
            val = [val[j] for j in layers]
        w.add_key_value(key, val, gguf.GGUFValueType[vtype], gguf.GGUFValueType[sub] if sub else None)
    named = [*pre, *((f"blk.{i}.{s}", shape, q) for i, j in enumerate(layers) for s, shape, q in blocks[j]), *post]
    for name, shape, qtype in named:
        w.add_tensor(name, tensor_data(name, shape, qtype, seed, stdev))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
