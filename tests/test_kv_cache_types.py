"""-ctk/-ctv (llama.cpp's KV cache types): q8_0 K and V with flash attention
give every split and a speculative mode the tokens of single-node llama.cpp
with the same type_k/type_v/flash_attn, and halve the KV cache of every rank
(as llama.cpp's own log reports it); a quantized V cache without flash
attention is refused in one line naming -fa on, as llama.cpp refuses it; the
memory check counts the chosen types' bytes."""

from __future__ import annotations

import ctypes
import json
import pathlib
import re

import pytest
from conftest import assert_greedy, PROMPTS, generate_json, run_ggpipe, stderr_lines

from ggpipe.cluster.config import ClusterConfig
from ggpipe.cluster.resources import kv_bytes_per_cell
from ggpipe.models.kv_size import KVLayout, kv_row_bytes
from ggpipe.errors import ConfigError
from ggpipe.runtime import llama as _llama
from ggpipe.runtime.stage import check_cache_types

N_TOKENS = 64
Q8 = ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]


# -- fast: names, sizes, checks ------------------------------------------------


def test_type_table_matches_ggml():
    """Every -ctk/-ctv name, its ggml id, block and block bytes are ggml's own
    (ggml_type_name, ggml_blck_size, ggml_type_size of the loaded libggml)."""
    import llama_cpp._ggml as ggml_mod

    libdir = pathlib.Path(ggml_mod.libggml_base_path)
    lib = ctypes.CDLL(str(sorted(libdir.glob("libggml-base.*"))[0]))
    lib.ggml_type_name.restype = ctypes.c_char_p
    lib.ggml_type_size.restype = ctypes.c_size_t
    lib.ggml_blck_size.restype = ctypes.c_int64
    lib.ggml_is_quantized.restype = ctypes.c_bool
    for name, (tid, block, size) in _llama.KV_CACHE_TYPES.items():
        assert lib.ggml_type_name(tid).decode() == name
        assert (lib.ggml_blck_size(tid), lib.ggml_type_size(tid)) == (block, size), name
        assert _llama.kv_type_is_quantized(name) == lib.ggml_is_quantized(tid), name
    # llama.cpp's tools accept exactly these (common/arg.cpp kv_cache_types)
    assert list(_llama.KV_CACHE_TYPES) == ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]


class _Info:  # SmolLM2-135M's shape: 576 wide, 9 heads, 3 KV heads -> KV rows of 192 values
    kv_layout = KVLayout(((192, 192),) * 30)


def test_kv_bytes_follow_the_cache_types():
    """The start-up check's bytes per cell (ggpipe.models.kv_size, tested
    against llama.cpp in test_kv_size)."""
    assert kv_bytes_per_cell(_Info, 30) == 30 * 2 * 192 * 2  # f16, the default, as before
    assert kv_row_bytes("q8_0", 192) == 6 * 34 and kv_row_bytes("q4_0", 192) == 6 * 18
    assert kv_bytes_per_cell(_Info, 30, "q8_0", "q8_0") == 30 * 2 * 6 * 34
    assert kv_bytes_per_cell(_Info, 30, "q4_0", "f16") == 30 * (6 * 18 + 192 * 2)
    assert kv_bytes_per_cell(_Info, 30, "f32", "f32") == 2 * kv_bytes_per_cell(_Info, 30)
    assert kv_row_bytes("q8_0", 33) == 2 * 34  # whole blocks (ggml_row_size)


def test_a_quantized_v_cache_needs_flash_attention():
    with pytest.raises(ConfigError, match=r"^-ctv q8_0: a quantized V cache needs flash attention .*-fa on"):
        check_cache_types("f16", "q8_0", "off")
    for fa in ("on", "auto"):  # auto: llama.cpp turns flash attention on for it
        check_cache_types("q8_0", "q8_0", fa)
    check_cache_types("q4_0", "f16", "off")  # a quantized K alone is fine without it
    with pytest.raises(ConfigError, match="-ctvd q4_0"):
        ClusterConfig(model="m", draft_model="d", cache_type_v_draft="q4_0").check_cache_types()
    with pytest.raises(ConfigError, match="-ctk: unknown KV cache type 'q3_k'"):
        check_cache_types("q3_k", "f16", "on")


def test_the_settings_are_compared_between_ranks():
    base = ClusterConfig(model="m")
    for change in ({"cache_type_k": "q8_0"}, {"cache_type_v": "q8_0"}, {"cache_type_k_draft": "q4_0"},
                   {"mlock": True}, {"no_mmap": True}, {"numa": "distribute"}):
        assert ClusterConfig(model="m", **change).digest() != base.digest(), change
    assert ClusterConfig(model="m", draft_model="d", cache_type_k="q8_0").draft_cache_types == ("q8_0", "f16")
    assert ClusterConfig(model="m", cache_type_k="q8_0", cache_type_k_draft="f16").draft_cache_types == ("f16",
                                                                                                         "f16")


def test_load_modes():
    L = _llama.lib()
    assert _llama.load_mode(False, False) == L.LLAMA_LOAD_MODE_AUTO  # llama.cpp's default: mmap
    assert _llama.load_mode(False, True) == L.LLAMA_LOAD_MODE_NONE
    assert _llama.load_mode(True, False) == L.LLAMA_LOAD_MODE_MMAP_MLOCK
    assert _llama.load_mode(True, True) == L.LLAMA_LOAD_MODE_MLOCK


@pytest.mark.parametrize("args, message", [
    (["-ctv", "q8_0"], "ggpipe: error: -ctv q8_0: a quantized V cache needs flash attention (llama.cpp refuses it "
                       "with -fa off): add -fa on (or -fa auto)"),
    (["-md", "smollm2-135m", "--mode", "pipeinfer", "-ctvd", "q4_0"], "ggpipe: error: -ctvd q4_0: a quantized V"),
    (["-ctk", "q3_k"], "ggpipe: error: Invalid value for '-ctk' / '--cache-type-k': 'q3_k' is not one of"),
    (["--numa", "mirror"], "ggpipe: error: Invalid value for '--numa': 'mirror' is not one of"),
])
def test_bad_settings_are_one_line(args, message):
    p = run_ggpipe(["generate", "-p", "hi", "-n", "4", *args], timeout=60)
    lines = stderr_lines(p.stderr)
    assert p.returncode != 0 and p.stdout == "", p.stderr
    assert len(lines) == 1 and lines[0].startswith(message), p.stderr


# -- full: exactness and memory on real weights --------------------------------


@pytest.mark.full
def test_the_cache_types_change_the_numbers(smollm2, reference):
    """The types reach llama.cpp: greedy text with a q8_0 cache (and with a
    q4_0 K) differs from f16's on these prompts, so the tests below would
    catch a pipeline that ignored them."""
    assert any(reference(smollm2, p, N_TOKENS, "on", "q8_0", "q8_0") != reference(smollm2, p, N_TOKENS, "on")
               for p in PROMPTS)
    assert any(reference(smollm2, p, N_TOKENS, "off", "q4_0") != reference(smollm2, p, N_TOKENS) for p in PROMPTS)


@pytest.mark.full
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_q8_0_pipeline_equals_reference(smollm2, reference, ranks):
    for prompt in PROMPTS:
        got = generate_json(smollm2, prompt, N_TOKENS, ranks, Q8)
        assert got["tokens"] == reference(smollm2, prompt, N_TOKENS, "on", "q8_0", "q8_0"), (ranks, prompt)


@pytest.mark.full
@pytest.mark.mpi
def test_q8_0_with_flash_attention_auto(smollm2, reference):
    """-fa auto with a quantized V: flash attention on, as llama.cpp resolves it."""
    got = generate_json(smollm2, PROMPTS[0], N_TOKENS, 2, ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "auto"])
    assert got["tokens"] == reference(smollm2, PROMPTS[0], N_TOKENS, "on", "q8_0", "q8_0")


@pytest.mark.full
@pytest.mark.mpi
def test_q8_0_pipeinfer_equals_reference(goliath, smollm2, reference):
    """pipeinfer with the F16 goliath target and the SmolLM2 draft on a rank
    of its own (the draft stage takes -ctk/-ctv too): verification batches
    over a q8_0 cache give the reference's tokens. (The draft is about 3x
    faster than the target, so it runs ahead and its tokens are verified; a
    target drafting for itself got ahead only while something slowed the
    target.)"""
    accepted = 0
    for prompt in PROMPTS:
        got = generate_json(goliath, prompt, N_TOKENS, 2, ["-md", str(smollm2), "--mode", "pipeinfer", *Q8])
        assert_greedy(got["tokens"], goliath, prompt, N_TOKENS, "on", "q8_0", "q8_0", msg=prompt)
        accepted += got["decoder"]["draft_accepted"]
    assert accepted > 0


@pytest.mark.full
@pytest.mark.mpi
def test_q4_0_k_without_flash_attention_equals_reference(smollm2, reference):
    """llama.cpp accepts a quantized K cache with flash attention off."""
    for prompt in PROMPTS:
        got = generate_json(smollm2, prompt, N_TOKENS, 2, ["-ctk", "q4_0"])
        assert got["tokens"] == reference(smollm2, prompt, N_TOKENS, "off", "q4_0"), prompt


@pytest.mark.full
@pytest.mark.parametrize("args, mode", [([], "mmap"), (["--no-mmap"], "none"), (["--mlock"], "mmap+mlock"),
                                        (["--mlock", "--no-mmap", "--numa", "distribute"], "mlock")])
def test_load_options_reach_llama_cpp(smollm2, args, mode):
    """--mlock / --no-mmap as llama.cpp's load mode (its -vv log names it); --numa runs."""
    p = run_ggpipe(["-vv", "generate", "-m", str(smollm2), "-p", "Hi", "-n", "2", *args])
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"(load_mode = {mode})" in p.stderr


def _kv_run(model, types: str, ctx: int) -> tuple[list[float], dict]:
    """(llama.cpp's logged KV sizes in MiB, one per rank, --json summary) of a 2-rank run at -c ctx."""
    p = run_ggpipe(["-vv", "generate", "-m", str(model), "-p", PROMPTS[0], "-n", "4", "--json", "-c", str(ctx),
                    "-ctk", types, "-ctv", types, "-fa", "on"], 2)
    assert p.returncode == 0, p.stderr[-3000:]
    sizes = [float(m) for m in re.findall(r"llama_kv_cache: size = +([0-9.]+) MiB", p.stderr)]
    return sizes, json.loads(p.stdout)


@pytest.mark.full
@pytest.mark.mpi
def test_q8_0_halves_the_kv_cache_of_every_rank(smollm2):
    """-c 32768 at 2 ranks: llama.cpp's own KV size line per rank is
    34/64 of f16's (q8_0: 34 bytes per 32 values) and what the memory check
    computes; each rank's peak RSS falls by about the difference."""
    from ggpipe.models.gguf_info import read_model_info

    info = read_model_info(smollm2)
    ctx = 32768
    f16, j16 = _kv_run(smollm2, "f16", ctx)
    q8, j8 = _kv_run(smollm2, "q8_0", ctx)
    assert len(f16) == len(q8) == 2
    # the ranks' log lines come in no fixed order: compared as sets, each rank's own sizes from its layers
    mib = {types: [ctx * kv_bytes_per_cell(info, tuple(r["layers"]), types, types) / 2**20 for r in j8["ranks"]]
           for types in ("f16", "q8_0")}
    assert sorted(f16) == pytest.approx(sorted(mib["f16"]), abs=0.006)   # llama.cpp logs MiB to 2 decimals
    assert sorted(q8) == pytest.approx(sorted(mib["q8_0"]), abs=0.006)
    for a, b in zip(mib["f16"], mib["q8_0"]):
        assert b / a == pytest.approx(34 / 64)
    for r16, r8, a, b in zip(j16["ranks"], j8["ranks"], mib["f16"], mib["q8_0"]):
        assert r16["peak_rss_bytes"] - r8["peak_rss_bytes"] > 0.8 * (a - b) * 2**20, (r16, r8)
