"""The kernels a job runs, and what they mean for exactness (README
"Exactness"): llama.cpp's extra buffer types on by default with AMX's left
out, the batch-row probe, ``--exact``'s one-line refusal on a build that
cannot give it, and iterative decoding equal to single-node llama.cpp of the
same build on Q4_0, Q4_1, Q8_0 and Q4_K_M weights (repacked where llama.cpp
repacks them)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time

import pytest

from ggpipe.bench import baseline
from ggpipe.runtime.llama import llamafile_sgemm
from tests.conftest import assert_greedy, EXACT, generate_json, run_ggpipe, stderr_lines
from tests.tiny_models import load_recipe, write_tiny_model

QUANTS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K_M")


def _quantize(src, dst, ftype: str):
    import llama_cpp as L  # noqa: PLC0415

    from ggpipe.runtime.llama import lib  # noqa: PLC0415

    lib()
    p = L.llama_model_quantize_default_params()
    p.ftype = getattr(L, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    p.nthread = 1
    assert L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) == 0
    return dst


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict:
    """A 4-block random-weight llama (n_embd 256, FFN 512: every matrix a
    multiple of 256 wide, so Q4_K_M is real K-quants) in each of QUANTS."""
    d = tmp_path_factory.mktemp("quants")
    recipe = load_recipe("llama-dense")
    recipe["metadata"] = [[k, t, s, 512 if k == "llama.feed_forward_length" else v] for k, t, s, v in recipe["metadata"]]
    recipe["tensors"] = [[n, [512 if x == 384 else x for x in shape], q] for n, shape, q in recipe["tensors"]]
    f32 = write_tiny_model(recipe, d / "f32.gguf", n_layer=4)
    return {q: _quantize(f32, d / f"{q}.gguf", q) for q in QUANTS}


def _in_child(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_amx_is_left_out_and_the_other_extra_buffer_types_stay():
    out = json.loads(_in_child(
        "import json; from ggpipe.runtime import kernels as k; before = k.extra_buffer_types(); "
        "k.use_extra_bufts(True); print(json.dumps([before, k.extra_buffer_types()]))"))
    before, after = out
    assert "AMX" not in after
    assert after == [b for b in before if b != "AMX"]


def test_a_buffer_type_left_out_is_not_used_by_later_loads(quantized):
    """The mechanism that leaves AMX out, shown on the buffer type every
    x86 CPU with AVX2 has: Q4_0 weights are repacked, then not."""
    code = ("import sys; from ggpipe.runtime import llama as l, kernels as k; l.set_verbose(True); L = l.lib(); "
            "{drop}mp = L.llama_model_default_params(); mp.use_extra_bufts = True; "
            f"m = L.llama_model_load_from_file({str(quantized['Q4_0'])!r}.encode(), mp); assert m")
    kept = subprocess.run([sys.executable, "-c", code.format(drop="")], capture_output=True, text=True, timeout=60)
    if "CPU_REPACK model buffer" not in kept.stderr:
        pytest.skip("this CPU's llama.cpp repacks no Q4_0 weights")
    dropped = subprocess.run([sys.executable, "-c", code.format(drop="k.drop_extra_buffer_types(('CPU_REPACK',)); ")],
                             capture_output=True, text=True, timeout=60)
    assert dropped.returncode == 0, dropped.stderr[-2000:]
    assert "CPU_REPACK model buffer" not in dropped.stderr


@pytest.mark.full
def test_the_probe_measures_the_build(goliath, smollm2):
    """Rows agree bit for bit without llamafile's sgemm, for Q4_1 and F16
    weights, with and without repacking; with it they differ (the weights'
    products for F16, attention's for both at a few hundred tokens of
    context)."""
    from ggpipe.models.row_probe import RowSetting, probe

    for model in (smollm2, goliath):
        for extra in (True, False):
            r = probe(model, RowSetting(extra_bufts=extra))
            assert r["batch_rows_exact"] == (not llamafile_sgemm()), (model, extra, r)
            assert (r["max_abs_diff"] > 0) == llamafile_sgemm()


def test_the_probe_runs_apart_from_the_asking_process(smollm2, tmp_path):
    """The cached probe runs in a child process: its answer is the probe's,
    and a file llama.cpp cannot load is a RuntimeError naming it, never a
    crash of the rank that asked."""
    from ggpipe.models.row_probe import RowSetting, probe_in_child

    r = probe_in_child(smollm2, RowSetting())
    assert set(r) == {"batch_rows_exact", "max_abs_diff", "rows"} and r["rows"] == 5
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(RuntimeError, match=r"row probe of .*bad\.gguf failed: llama\.cpp could not load"):
        probe_in_child(bad, RowSetting())


def test_exact_on_a_build_with_sgemm_is_one_line_before_loading(smollm2):
    if not llamafile_sgemm():
        pytest.skip("this build has no llamafile sgemm: --exact runs")
    t0 = time.monotonic()
    p = run_ggpipe(["generate", "-m", str(smollm2), "--exact", "-p", "hi", "-n", "4"], 2, timeout=120,
                   env={"GGPIPE_EXACT": ""})
    lines = stderr_lines(p.stderr)
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "--exact needs llama-cpp-python built without llamafile's sgemm" in lines[0]
    assert "-DGGML_LLAMAFILE=OFF" in lines[0]
    assert time.monotonic() - t0 < 60


@pytest.mark.mpi
@pytest.mark.full
@pytest.mark.parametrize("quant", QUANTS)
def test_iterative_equals_single_node_on_quantized_weights(quantized, quant):
    """2 ranks, iterative, with the job's kernels (repacked where llama.cpp
    repacks; with --exact none), against single-node llama.cpp with the
    same kernels; --json names them."""
    model = quantized[quant]
    ref = baseline.greedy(model, "tok_5 tok_9 tok_3", 24, ignore_eos=True, extra_bufts=not EXACT).tokens
    out = generate_json(model, "tok_5 tok_9 tok_3", 24, 2, ["--ignore-eos"])
    assert out["tokens"] == ref
    k = out["kernels"]
    assert k["llamafile_sgemm"] == llamafile_sgemm() and k["exact"] == EXACT
    assert "AMX" not in k["extra_bufts"] and (k["extra_bufts"] == [] if EXACT else True)
    if EXACT:
        assert k["batch_rows_exact"]


@pytest.mark.mpi
@pytest.mark.full
def test_greedy_speculation_reports_its_smallest_margin(goliath, smollm2, reference):
    """pipeinfer's --json says how close an accepted draft token came to a
    tie (the top-1 minus top-2 logit); its tokens are the reference's."""
    prompt = "The three laws of thermodynamics are"
    out = generate_json(goliath, prompt, 32, 2, ["-md", str(smollm2), "--mode", "pipeinfer"])
    d = out["decoder"]
    assert d["draft_accepted"] == 0 or d["min_accepted_margin"] >= 0
    assert out["kernels"]["batch_rows_exact"] == (EXACT or not llamafile_sgemm())
    assert_greedy(out["tokens"], goliath, prompt, 32)


@pytest.mark.mpi
@pytest.mark.full
@pytest.mark.parametrize("ubatch", ["24", "512"])
def test_iterative_equals_single_node_at_any_prompt_chunking(quantized, goliath, ubatch):
    """A 300-token prompt through 2 stages in chunks of at most --ubatch
    (ggpipe.pipeline.prefill: 4 even chunks at 512, 13 at 24): the same
    tokens as single-node llama.cpp, which decodes it in one batch, on
    repacked Q4_0 weights and on F16 (llamafile's sgemm in the default
    build)."""
    tiny_prompt = " ".join(f"tok_{(7 * i) % 120}" for i in range(300))
    model = quantized["Q4_0"]
    ref = baseline.greedy(model, tiny_prompt, 16, ignore_eos=True, extra_bufts=not EXACT).tokens
    assert generate_json(model, tiny_prompt, 16, 2, ["--ignore-eos", "--ubatch", ubatch])["tokens"] == ref
    text = " ".join(["The pipeline keeps every node busy while the prompt streams through its stages."] * 20)
    ref = baseline.greedy(goliath, text, 16, ignore_eos=True, extra_bufts=not EXACT).tokens
    assert generate_json(goliath, text, 16, 2, ["--ignore-eos", "--ubatch", ubatch])["tokens"] == ref
