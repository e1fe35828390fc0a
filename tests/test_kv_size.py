"""KV cache bytes per cell (ggpipe.models.kv_size), the one sizing of the
start-up memory check, ``ggpipe plan`` and the simulator's placement,
against llama.cpp itself: SmolLM2 and tiny models of the architectures
whose KV caches are shaped differently (head size not n_embd / n_head, MLA,
sliding-window layers, hybrids with recurrent layers, per-layer KV heads)
are loaded by llama.cpp at f16 and q8_0, flash attention on and off, and
its own log (``llama_kv_cache: size = ... K (type): X MiB, V (type): Y
MiB``, and which layers got a cache) is compared with the function's bytes
x cells. All exact: ggpipe's contexts keep llama.cpp's default
``swa_full``, so sliding-window layers hold every cell."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest
from tiny_models import load_recipe, write_tiny_model

from ggpipe.cluster import resources
from ggpipe.errors import ConfigError, SplitError
from ggpipe.models.derive import stage_slice
from ggpipe.models.gguf_info import info_from_reader, load_gguf, read_model_info
from ggpipe.models.kv_size import (
    KVLayout,
    kv_bytes_per_cell,
    kv_cells,
    kv_layout,
    kv_row_bytes,
)

MiB = 2**20
SMOL = KVLayout(((192, 192),) * 30)  # SmolLM2-135M: 3 KV heads of 64, 30 layers


# -- the sizing itself ----------------------------------------------------------------------------


def test_rows_in_the_cache_types():
    assert kv_bytes_per_cell(SMOL, 0, 30) == 30 * 2 * 192 * 2  # f16, the default
    assert kv_row_bytes("q8_0", 192) == 6 * 34 and kv_row_bytes("q4_0", 192) == 6 * 18
    assert kv_row_bytes("q8_0", 33) == 2 * 34  # whole blocks (ggml_row_size)
    assert kv_bytes_per_cell(SMOL, 0, 30, "q8_0", "q8_0") == 30 * 2 * 6 * 34
    assert kv_bytes_per_cell(SMOL, 15, 30, "q4_0", "f16") == 15 * (6 * 18 + 192 * 2)
    assert kv_bytes_per_cell(SMOL, 0, 30, "f32", "f32") == 2 * kv_bytes_per_cell(SMOL, 0, 30)
    assert kv_bytes_per_cell(SMOL, 3, 3) == 0
    with pytest.raises(ValueError, match=r"layers \[0, 31\) outside the model's 30 layers"):
        kv_bytes_per_cell(SMOL, 0, 31)


def test_hybrid_mla_and_transposed_v():
    hybrid = KVLayout((None, None, (256, 256), None, None, (256, 256)))  # attention every 3rd layer
    assert kv_bytes_per_cell(hybrid, 0, 2) == 0  # a stage of recurrent layers only
    assert kv_bytes_per_cell(hybrid, 0, 3) == kv_bytes_per_cell(hybrid, 3, 6) == 1024
    assert hybrid.kv_layers(1, 6) == [2, 5]
    mla = KVLayout(((576, 512),) * 2, v_cache=False)  # the latent (kv_lora_rank 512 + 64 rope dims), no V
    assert kv_bytes_per_cell(mla, 0, 2) == 2 * 576 * 2
    assert kv_bytes_per_cell(mla, 0, 2, "q8_0", "q8_0") == 2 * 18 * 34
    assert kv_bytes_per_cell(mla, 0, 2, v_trans=True) == 2 * 576 * 2
    mixed = KVLayout(((256, 256), (128, 128)))  # per-layer KV heads
    assert kv_bytes_per_cell(mixed, 0, 2) == (512 + 256) * 2
    assert kv_bytes_per_cell(mixed, 0, 2, v_trans=True) == (512 + 128 + 256) * 2  # V rows padded to the widest
    assert kv_bytes_per_cell(mixed, 1, 2, v_trans=True) == 256 * 2  # ... of the stage's layers


def test_cells_as_llama_cpp_allocates_them():
    assert kv_cells(1024) == 1024 and kv_cells(1000) == 1024 and kv_cells(8) == 256
    assert kv_cells(4096, 8, unified=True) == 4096
    assert kv_cells(1000, 8, unified=False) == 8 * 256  # one stream per sequence, each rounded up


def test_startup_check_counts_a_stage_layers():
    """resources.kv_bytes_per_cell (the start-up check): a stage's (start,
    stop), or a count: the most any such run of layers takes."""
    info = type("Info", (), {"kv_layout": KVLayout((None, (64, 64), None, None, (64, 64), (64, 64)))})
    assert resources.kv_bytes_per_cell(info, (0, 3)) == 256
    assert resources.kv_bytes_per_cell(info, (2, 4)) == 0
    assert resources.kv_bytes_per_cell(info, 2) == 512  # layers 4-5
    assert resources.kv_bytes_per_cell(info, 6, "q8_0", "q8_0") == 3 * 2 * 2 * 34
    assert resources.kv_bytes_per_cell(type("I", (), {"kv_layout": SMOL}), 15) == 15 * 2 * 192 * 2
    resources.check_kv_memory(1024, [("target layers 0-29", 23040)], "rank 0 (h)", available=23040 * 1024)
    with pytest.raises(ConfigError, match=r"-c 1025 needs 29.5 MB of KV cache"):  # 1280 cells
        resources.check_kv_memory(1025, [("target layers 0-29", 23040)], "rank 0 (h)", available=23040 * 1024)
    # a draft model under --parallel holds one slot's cells, not -c: 4 slots of -c 8192 -> 2048 cells
    parts = [("target layers 0-29", 23040), ("the draft model", 23040, 2048)]
    resources.check_kv_memory(8192, parts, "rank 0 (h)", available=23040 * (8192 + 2048))
    with pytest.raises(ConfigError, match=r"-c 8192 needs .* \(target layers 0-29: 23.0 KB per cell and the draft "
                                          r"model: 23.0 KB per cell x 2048 cells\)"):
        resources.check_kv_memory(8192, parts, "rank 0 (h)", available=23040 * (8192 + 2047))


def _fields(**kw) -> dict:
    base = {"attention.head_count": 4, "attention.head_count_kv": 2}
    base.update({k.replace("__", "."): v for k, v in kw.items()})
    return base


def test_header_rules():
    """The llama.cpp rules that the tiny models below do not reach."""
    # head size from key_length/value_length, else n_embd / n_head (layer 0's)
    assert kv_layout(_fields(), "llama", 2, 256).rows == ((128, 128),) * 2
    assert kv_layout(_fields(attention__key_length=96, attention__value_length=64), "qwen3", 1, 256).rows \
        == ((192, 128),)
    # Qwen3.5 without attention.recurrent_layers: attention every full_attention_interval-th layer (default 4)
    assert kv_layout(_fields(), "qwen35", 8, 256).kv_layers() == [3, 7]
    assert kv_layout(_fields(full_attention_interval=2), "qwen35", 4, 256).kv_layers() == [1, 3]
    # an MTP block (nextn_predict_layers) is not in the main context's cache
    assert kv_layout(_fields(nextn_predict_layers=1), "glm4moe", 4, 256).kv_layers() == [0, 1, 2]
    # Gemma 4: shared-KV layers reuse earlier caches; sliding-window layers have their own head size
    g4 = kv_layout(_fields(attention__key_length=512, attention__value_length=512, attention__key_length_swa=256,
                           attention__value_length_swa=256, attention__shared_kv_layers=2,
                           attention__sliding_window_pattern=[True, True, False, True, False]), "gemma4", 5, 256)
    assert g4.rows == ((512, 512), (512, 512), (1024, 1024), None, None)
    # numeric SWA period: every n-th layer dense (dense first for cohere2moe)
    assert kv_layout(_fields(attention__key_length_swa=32, attention__sliding_window_pattern=3), "x", 3, 256).rows \
        == ((64, 128), (64, 128), (128, 128))
    assert kv_layout(_fields(attention__key_length_swa=32, attention__sliding_window_pattern=3), "cohere2moe", 3,
                     256).rows == ((128, 128), (64, 128), (64, 128))
    # purely recurrent models and encoders have no KV cache
    assert kv_layout({"attention.head_count": 0}, "mamba", 3, 256).rows == (None,) * 3
    assert kv_layout(_fields(), "rwkv7", 2, 256).rows == (None, None)
    assert kv_layout(_fields(), "bert", 2, 256).rows == (None, None)
    # per-layer KV heads, 0 for a recurrent layer; no heads at all: no rows
    assert kv_layout(_fields(attention__head_count_kv=[2, 0, 1]), "jamba", 3, 256).rows == ((128, 128), None,
                                                                                             (64, 64))
    assert kv_layout({"attention.head_count": 0, "attention.head_count_kv": 0}, "llama", 1, 256).rows == (None,)


# -- against llama.cpp ------------------------------------------------------------------------------

_ORACLE = r"""
import ctypes, json, re, sys
import llama_cpp as L

lines = []
@L.llama_log_callback
def _log(level, text, user_data):
    lines.append(text.decode("utf-8", "replace"))
L.llama_log_set(_log, ctypes.c_void_p(0))
L.llama_backend_init()
TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "q4_0": 2}
out = []
for path, n_ctx, tk, tv, fa in json.loads(sys.argv[1]):
    m = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 32, 32, 1
    cp.n_threads = cp.n_threads_batch = 1
    cp.type_k, cp.type_v = TYPES[tk], TYPES[tv]
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    del lines[:]
    c = L.llama_init_from_model(m, cp)
    assert c, (path, tk, tv, fa)
    out.append({"swa_full": bool(cp.swa_full), "log": [x for x in lines if x.startswith("llama_kv_cache")]})
    L.llama_free(c)
    L.llama_model_free(m)
print(json.dumps(out))
"""
_SIZE = re.compile(r"llama_kv_cache: size = +[0-9.]+ MiB \( *(\d+) cells, +(\d+) layers.*K \((\w+)\): +([0-9.]+) MiB, "
                   r"V \((\w+)\): +([0-9.]+) MiB")
_LAYER = re.compile(r"llama_kv_cache: layer +(\d+): dev = ")


def llama_cpp_kv(cases: list[tuple]) -> list[dict]:
    """llama.cpp's own KV cache of each (model path, n_ctx, type_k, type_v,
    flash_attn): {"k_mib", "v_mib", "cells", "layers"} summed over its caches
    (a sliding-window model has two), "swa_full". One child process (log
    callback without touching this process's)."""
    p = subprocess.run([sys.executable, "-c", _ORACLE, json.dumps([[str(c[0]), *c[1:]] for c in cases])],
                       check=False, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = []
    for got in json.loads(p.stdout):
        sizes = [_SIZE.search(x) for x in got["log"] if x.startswith("llama_kv_cache: size =")]
        assert sizes and all(sizes), got["log"]
        res.append({"k_mib": sum(float(m[4]) for m in sizes), "v_mib": sum(float(m[6]) for m in sizes),
                    "cells": {int(m[1]) for m in sizes}, "n_layers": sum(int(m[2]) for m in sizes),
                    "layers": sorted(int(m[1]) for x in got["log"] if (m := _LAYER.search(x))),
                    "types": {(m[3], m[5]) for m in sizes}, "swa_full": got["swa_full"]})
    return res


def _narrow_heads(recipe: dict, head: int) -> dict:
    """The qwen3 recipe with heads of ``head`` values (n_embd / n_head is
    64): key/value length, rope dims and the attention tensors' shapes."""
    r = copy.deepcopy(recipe)
    n_head = next(v for k, _, _, v in r["metadata"] if k == "qwen3.attention.head_count")
    n_kv = next(v for k, _, _, v in r["metadata"] if k == "qwen3.attention.head_count_kv")
    for m in r["metadata"]:
        if m[0].startswith(("qwen3.attention.key_length", "qwen3.attention.value_length",
                            "qwen3.rope.dimension_count")) and "mla" not in m[0]:
            m[3] = head
    shapes = {"attn_q.weight": lambda s: [s[0], n_head * head], "attn_k.weight": lambda s: [s[0], n_kv * head],
              "attn_v.weight": lambda s: [s[0], n_kv * head], "attn_output.weight": lambda s: [n_head * head, s[1]],
              "attn_q_norm.weight": lambda s: [head], "attn_k_norm.weight": lambda s: [head],
              "attn_q.bias": lambda s: [n_head * head], "attn_k.bias": lambda s: [n_kv * head],
              "attn_v.bias": lambda s: [n_kv * head]}
    for t in r["tensors"]:
        suffix = t[0].split(".", 2)[-1]
        if t[0].startswith("blk.") and suffix in shapes:
            t[1] = shapes[suffix](t[1])
    return r


# (name, recipe, n_layer or the recipe block of each layer)
_TINY = [
    ("qwen3-heads32", lambda: _narrow_heads(load_recipe("qwen3-dense"), 32), 4),  # key_length != n_embd/n_head
    ("deepseek2-moe", lambda: load_recipe("deepseek2-moe"), 4),  # MLA: K latent only
    ("gemma3-dense", lambda: load_recipe("gemma3-dense"), 4),  # sliding-window layers
    ("gpt-oss-moe", lambda: load_recipe("gpt-oss-moe"), 4),  # sliding-window layers
    ("lfm2-dense", lambda: load_recipe("lfm2-dense"), 4),  # hybrid: head_count_kv 0 on conv layers, SWA
    ("qwen35-dense", lambda: load_recipe("qwen35-dense"), 6),  # hybrid: attention.recurrent_layers
    ("nemotron_h-dense", lambda: load_recipe("nemotron_h-dense"), [0, 1, 2, 0, 1, 2]),  # hybrid + MLP layers
    ("granitehybrid-dense", lambda: load_recipe("granitehybrid-dense"), 4),
]
# (model, start, stop): the slice a rank loads for a stage (ggpipe.models.derive.stage_slice), against the full
# model's range [start, stop)
_STAGES = [("lfm2-dense", 2, 4), ("qwen35-dense", 1, 4), ("nemotron_h-dense", 2, 5), ("deepseek2-moe", 1, 3)]
# (type_k, type_v, flash attention)
_TYPES = [("f16", "f16", True), ("q8_0", "q8_0", True), ("f16", "f16", False), ("q4_0", "f16", False)]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("kv")
    out = {}
    for name, make, layers in _TINY:
        n, layers = (layers, None) if isinstance(layers, int) else (None, layers)
        out[name] = write_tiny_model(make(), d / f"{name}.gguf", n_layer=n, layers=layers)
    for name, start, stop in _STAGES:
        out[name, start, stop] = stage_slice(out[name], start, stop, d / "cache")
    return out


def _layout(path) -> KVLayout:
    """The layout ModelInfo reads (in this process: read_model_info's bounded child takes 0.2 s a file)."""
    return info_from_reader(load_gguf(path), path).kv_layout


def _check(path, got: dict, layout: KVLayout, start: int, stop: int, n_ctx: int, tk: str, tv: str, fa: bool):
    cells = kv_cells(n_ctx)
    assert got["swa_full"] and got["cells"] == {cells}, got
    k_only = kv_bytes_per_cell(KVLayout(layout.rows, False), start, stop, tk, tv)
    total = kv_bytes_per_cell(layout, start, stop, tk, tv, v_trans=not fa)
    what = f"{path.name} [{start}, {stop}) {tk}/{tv} fa={fa}"
    # llama.cpp logs MiB with 2 decimals; 1 KV row of 32 values at 1024 cells is 0.03 MiB or more
    assert abs(cells * k_only / MiB - got["k_mib"]) <= 0.0051, what
    assert abs(cells * (total - k_only) / MiB - got["v_mib"]) <= 0.0051, what
    assert [il - start for il in layout.kv_layers(start, stop)] == got["layers"], what


def test_kv_bytes_equal_llama_cpp(smollm2, tiny_models):
    cases, expect = [], []
    smol = read_model_info(smollm2)
    assert smol.kv_layout == SMOL
    for tk, tv, fa in _TYPES:
        cases.append((smollm2, 1024, tk, tv, fa))
        expect.append((smol.kv_layout, 0, 30))
    for name, _, _ in _TINY:
        layout = _layout(tiny_models[name])
        for tk, tv, fa in _TYPES:
            if not layout.v_cache and tk != tv:  # llama.cpp: MLA "does not support different K and V cache types"
                tk, tv = "f32", "f32"
            cases.append((tiny_models[name], 1000, tk, tv, fa))  # 1024 cells
            expect.append((layout, 0, layout.n_layer))
    for name, start, stop in _STAGES:
        cases.append((tiny_models[name, start, stop], 1024, "f16", "f16", False))
        expect.append((_layout(tiny_models[name]), start, stop))
    for case, got, (layout, start, stop) in zip(cases, llama_cpp_kv(cases), expect):
        _check(case[0], got, layout, start, stop, *case[1:])


def test_the_layouts_differ_where_the_old_formula_was_wrong(tiny_models):
    """What n_embd * n_head_kv / n_head for every layer (the old start-up
    check) got wrong, and the tests above check against llama.cpp."""
    rows = {n: _layout(tiny_models[n]) for n, _, _ in _TINY}
    assert rows["qwen3-heads32"].rows == ((32, 32),) * 4  # not 256 * 1 / 4 = 64
    assert rows["deepseek2-moe"].rows == ((576, 512),) * 4 and not rows["deepseek2-moe"].v_cache
    assert rows["lfm2-dense"].kv_layers() == [0, 2] and rows["qwen35-dense"].kv_layers() == [1, 3, 5]
    assert rows["nemotron_h-dense"].kv_layers() == [0, 3]
    for name in ("deepseek2-moe", "lfm2-dense"):  # the remembered ModelInfo record (JSON) keeps the layout
        assert read_model_info(tiny_models[name]).kv_layout == rows[name]


# -- ggpipe plan and the balanced placement ------------------------------------------------------


def _plan(*args) -> dict:
    from click.testing import CliRunner

    from ggpipe.cli.main import cli

    r = CliRunner().invoke(cli, ["plan", "--json", "--launcher", "mpich", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_plan_counts_the_cache_types_and_only_attention_layers(smollm2, tiny_models):
    f16 = _plan("-n", "2", "-m", str(smollm2), "-c", "1024")
    # the default split counts the LM head on the last stage: 22 + 8 blocks (ggpipe.cluster.split)
    assert [r["kv_bytes"] for r in f16["ranks"]] == [n * 1024 * 2 * 192 * 2 for n in (22, 8)]
    q8 = _plan("-n", "2", "-m", str(smollm2), "-c", "1024", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on")
    assert [r["kv_bytes"] for r in q8["ranks"]] == [n * 1024 * 2 * 6 * 34 for n in (22, 8)]  # 34/64 of f16's
    assert " ".join(q8["command"]).endswith("generate -m " + str(smollm2) + " -c 1024 -ctk q8_0 -ctv q8_0 -fa on -p …")
    # the job command's options (after --); -c 1000 is 1024 cells
    q4 = _plan("-n", "2", "--", "generate", "-m", str(smollm2), "-c", "1000", "-ctk", "q4_0", "-p", "x")
    assert [r["kv_bytes"] for r in q4["ranks"]] == [n * 1024 * (6 * 18 + 192 * 2) for n in (22, 8)]
    # a hybrid model: only its attention layers (2 of 4, 1024 bytes a cell each) hold KV cells, whatever the split
    lfm2 = _plan("-n", "2", "-m", str(tiny_models["lfm2-dense"]), "-c", "1024")
    assert sum(r["kv_bytes"] for r in lfm2["ranks"]) == 2 * 1024 * 1024
    layout = _layout(tiny_models["lfm2-dense"])
    for r in lfm2["ranks"]:
        assert r["kv_bytes"] == 1024 * kv_bytes_per_cell(layout, *r["layers"])


def test_plan_refuses_a_quantized_v_cache_without_flash_attention(smollm2):
    from click.testing import CliRunner

    from ggpipe.cli.main import cli

    r = CliRunner().invoke(cli, ["plan", "-n", "2", "-m", str(smollm2), "-ctv", "q8_0"])
    assert isinstance(r.exception, ConfigError)
    assert str(r.exception).startswith("-ctv q8_0: a quantized V cache needs flash attention")


def test_balanced_placement_counts_the_cache_types(smollm2, tmp_path):
    """--balance: two ranks on this host with 640 MB, 320 MB each: at -c
    32768 a rank's 63 MB of weights and KV cache fit it in q8_0 (200 MB of
    KV) but not in f16 (377 MB)."""
    from ggpipe.sim.model import from_gguf
    from ggpipe.sim.profile import HostProfile, Profile

    m = from_gguf(str(smollm2))
    hosts = [HostProfile(h, layer_s=[1e-3] * 6, layer_bytes=m.layers[0].bytes, head_s=[3e-3] * 6,
                         head_bytes=m.head.bytes, rank=i, mem_bytes=640_000_000) for i, h in enumerate("ab")]
    Profile("smollm2-135m", None, hosts).save(tmp_path / "p.json")
    job = ["generate", "-m", str(smollm2), "-c", "32768", "-p", "hi"]
    from click.testing import CliRunner

    from ggpipe.cli.main import cli

    r = CliRunner().invoke(cli, ["plan", "-n", "2", "--balance", str(tmp_path / "p.json"), "--json", "--", *job])
    assert isinstance(r.exception, SplitError) and "fits their memory" in str(r.exception), r.output
    d = _plan("-n", "2", "--balance", str(tmp_path / "p.json"), "--", *job, "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on")
    assert all(x["kv_bytes"] + x["weights_bytes"] <= 320_000_000 for x in d["ranks"])
