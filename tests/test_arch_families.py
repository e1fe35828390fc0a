"""Every architecture family ggpipe cuts, proven on a tiny random-weight model:
the model written in the form llama.cpp's converters give real GGUFs (periods
instead of per-layer arrays, Granite's embedding scale, ...), then every split
at 1-4 ranks must give the whole model's greedy tokens in llama-cpp-python,
token for token, in iterative mode and in pipeinfer with the model drafting for
itself; recurrent and hybrid models refuse the speculative modes in one line;
Gemma 2 refuses to be cut. The architecture table of docs/user-guide/models.md
is checked against the same facts (``test_readme_table``)."""

from __future__ import annotations

import functools
import json
import re
import zlib
from pathlib import Path

import pytest
from conftest import ROOT, generate_json, run_ggpipe, stderr_lines
from tiny_models import load_recipe, recipe_names, write_tiny_model

from ggpipe.bench import baseline
from ggpipe.cluster.split import parse_split, plan_layers, repair_ranges
from ggpipe.models.sizes import model_sizes
from ggpipe.models.slicing import FAMILIES
from ggpipe.runtime.llama import file_is_recurrent

N_LAYER = 8
N_TOKENS = 24
# About 60 tokens of the "test" tokenizer: prompt and reply run far past the
# 8-token sliding window set below, so a wrong window pattern changes tokens.
PROMPT = ("The pipeline must compute exactly what the whole model computes, for every split of its blocks, "
          "for dense and mixture-of-experts models alike, with sliding windows and recurrent layers.")
# (ranks, --split weights): even splits and uneven ones; sliding-window
# families also get a stage holding only their first global-attention block.
SPLITS = [(2, None), (3, None), (4, None), (2, "1,7"), (2, "3,5"), (3, "5,1,2")]
FULL_TIER_SPLITS = [(4, None), (3, "5,1,2")]   # 4 stages and an uneven 3; every split with --all
REFUSED = {"gemma2"}


def _arch(name: str) -> str:
    return load_recipe(name)["arch"]


def converter_form(name: str) -> dict:
    """The recipe as llama.cpp's converters write real GGUFs of that family:
    test-llama-archs' saver writes every hyperparameter, including per-layer
    arrays that real files replace by a period (sliding-window layers: the
    family's default period; Qwen 3.5 / Qwen3-Next: full_attention_interval)
    and keys real files do not have. Granite keeps an embedding scale (12, as
    Granite 4 has), which only the first stage may apply."""
    recipe = load_recipe(name)
    arch = recipe["arch"]
    interval = arch in ("qwen35", "qwen3next")
    drop = {f"{arch}.nextn_predict_layers", f"{arch}.attention.recurrent_layers"}
    if arch not in ("deepseek2", "glm4moe"):
        drop.add(f"{arch}.leading_dense_block_count")
    if arch in ("gemma2", "gemma3", "gpt-oss", "cohere2"):  # converters write the window, not the pattern
        drop.add(f"{arch}.attention.sliding_window_pattern")
    meta = []
    for key, vtype, sub, val in recipe["metadata"]:
        if key in drop:
            continue
        if key == f"{arch}.attention.sliding_window" and val:
            val = 8  # a short window: local and global attention differ from the 9th token on
        if key == f"{arch}.embedding_scale":
            val = 12.0 if arch == "granitehybrid" else 0.0
        if key == f"{arch}.full_attention_interval" and interval:
            val = 2  # the recipe's blocks: recurrent, then full attention
        if key == f"{arch}.attention.head_count" and vtype == "ARRAY":
            vtype, sub, val = "UINT32", None, max(val)  # one count; only head_count_kv is per layer
        meta.append([key, vtype, sub, val])
    if interval and all(m[0] != f"{arch}.full_attention_interval" for m in meta):
        meta.append([f"{arch}.full_attention_interval", "UINT32", None, 2])
    return {**recipe, "metadata": meta}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tiny_archs")
    # stdev 0.5: varied greedy tokens (0.1 settles into repeats); a seed per
    # architecture, so families with the same tensor names differ too
    return {name: write_tiny_model(converter_form(name), d / f"{name}.gguf", n_layer=N_LAYER, stdev=0.5,
                                   seed=zlib.crc32(name.encode()))
            for name in recipe_names()}


@functools.lru_cache(maxsize=None)
def whole_model(model: Path) -> list[int]:
    """Greedy tokens of the whole model in llama-cpp-python (1 thread, -c 256,
    as the runs below: Phi-3 picks its RoPE factors by context size)."""
    return baseline.greedy(model, PROMPT, N_TOKENS, n_ctx=256, ignore_eos=True).tokens


# Block kinds of the hybrid recipes, repeating: A attention, R recurrent, M MLP only.
HYBRID_BLOCKS = {"lfm2": "AR", "granitehybrid": "AR", "qwen35": "RA", "qwen3next": "RA", "nemotron_h": "ARM"}


def expected_refusal(name: str, ranks: int, split: str | None, model: Path) -> str | None:
    """What a split that llama.cpp cannot run is refused with, or None: a
    hybrid stage without an attention or a recurrent block; a stage of
    global-attention blocks only where the family cannot turn its window
    off (blocks g with g % period == period - 1 are global). The default
    split (no --split) moves its boundaries to the nearest split without
    such stages, when there is one."""
    fam = FAMILIES[_arch(name)]
    kinds = HYBRID_BLOCKS.get(_arch(name))
    p = fam.swa_period if fam.swa_period and not fam.swa_optional else None

    def problem(a: int, b: int) -> str | None:
        if kinds and not {"A", "R"} <= {kinds[i % len(kinds)] for i in range(a, b)}:
            return "hold no"
        if p and all(i % p == p - 1 for i in range(a, b)):
            return "all global-attention blocks"
        return None

    ranges = plan_layers(N_LAYER, ranks, parse_split(split).target, layer_bytes=model_sizes(model).layer_bytes)
    if split is None:
        ranges = repair_ranges(ranges, lambda a, b: problem(a, b) is None)
    return next((why for why in (problem(a, b) for a, b in ranges) if why), None)


NAMES = recipe_names()
CUT = [n for n in NAMES if _arch(n) not in REFUSED]


def test_recipes_cover_the_families():
    archs = {_arch(n) for n in NAMES}
    assert archs == set(FAMILIES) - {"gemma"}, "a family without a tiny model proves nothing"


def test_models_info_says_how_it_splits(tiny_models):
    p = run_ggpipe(["models", "info", str(tiny_models["gemma3-dense"])])
    assert p.returncode == 0, p.stderr
    assert re.search(r"can be split\s+yes, at any block boundary \(.*sliding-window pattern", p.stdout)
    p = run_ggpipe(["models", "info", str(tiny_models["gemma2-dense"])])
    assert re.search(r"can be split\s+no: .*sqrt\(n_embd\)", p.stdout), p.stdout


@pytest.mark.full
@pytest.mark.mpi
@pytest.mark.parametrize("name", CUT)
def test_every_split_equals_the_whole_model(name, tiny_models, whole_matrix):
    model = tiny_models[name]
    want = whole_model(model)
    assert len(want) == N_TOKENS
    fam = FAMILIES[_arch(name)]
    splits = list(SPLITS if whole_matrix else FULL_TIER_SPLITS)
    if fam.swa_period is not None:  # block g = period - 1 is global: a stage of it alone
        g = fam.swa_period - 1
        splits.append((3, f"{g},1,{N_LAYER - g - 1}"))
    for ranks, split in splits:
        extra = ["--ignore-eos", "-c", "256", *(["--split", split] if split else [])]
        refusal = expected_refusal(name, ranks, split, model)
        if refusal:
            p = run_ggpipe(["generate", "-m", str(model), "-p", PROMPT, "-n", "4", *extra], ranks)
            lines = stderr_lines(p.stderr)
            assert p.returncode != 0 and len(lines) == 1 and refusal in lines[0], (ranks, split, p.stderr[-2000:])
            continue
        got = generate_json(model, PROMPT, N_TOKENS, ranks, extra)
        assert got["tokens"] == want, (name, ranks, split)


# The speculative modes: pipeinfer with the model drafting for itself on a rank
# of its own; the speculative mode with n-gram drafting over a 2-stage target;
# PipeDec, whose draft grows a tree through 3 target stages.
SPEC_RUNS = {
    "pipeinfer": (3, lambda m: ["--mode", "pipeinfer", "-md", str(m)]),
    "speculative-ngram": (2, lambda m: ["--mode", "speculative", "--spec-type", "ngram"]),
    "pipedec": (4, lambda m: ["--mode", "pipedec", "-md", str(m), "--split", "1,1,1/1"]),
}


@pytest.mark.full
@pytest.mark.mpi
@pytest.mark.parametrize("mode", list(SPEC_RUNS))
@pytest.mark.parametrize("name", CUT)
def test_speculative_modes(name, mode, tiny_models):
    """Exact in every speculative mode; a recurrent or hybrid model is
    refused in one line instead."""
    model = tiny_models[name]
    ranks, extra = SPEC_RUNS[mode]
    args = ["generate", "-m", str(model), "-p", PROMPT, "-n", str(N_TOKENS), "--json", "--ignore-eos", "-c", "256",
            *extra(model)]
    if mode == "pipedec" and (expected_refusal(name, 3, None, model) or file_is_recurrent(model)):
        args[args.index("1,1,1/1")] = "1,1/1"  # 2 target stages where 3 cannot hold both kinds of block
        ranks = 3
    p = run_ggpipe(args, ranks)
    if file_is_recurrent(model):
        lines = stderr_lines(p.stderr)
        assert p.returncode != 0 and len(lines) == 1, p.stderr[-2000:]
        assert "cannot run" in lines[0] and "recurrent state" in lines[0] and "--mode iterative" in lines[0]
        return
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["tokens"] == whole_model(model)


# Requests one after the other in one job, as batch and serve run them: the
# same prompt again, a prompt that shares only its first words, another one.
# A recurrent state cannot be cut at a position, so the cache is kept whole
# (the next turn of a conversation) or dropped.
BATCH_PROMPTS = [PROMPT, PROMPT, PROMPT.split(",")[0] + ", and then something else entirely.", "Another prompt."]


@pytest.mark.full
@pytest.mark.mpi
@pytest.mark.parametrize("parallel", [1, 2])
@pytest.mark.parametrize("name", [n for n in CUT if n.split("-")[0] in ("lfm2", "granitehybrid", "qwen35")])
def test_recurrent_and_hybrid_models_take_request_after_request(name, parallel, tiny_models, tmp_path):
    model = tiny_models[name]
    assert file_is_recurrent(model)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p, "n": 8}) + "\n" for i, p in enumerate(BATCH_PROMPTS)))
    p = run_ggpipe(["batch", str(inp), "-o", str(out), "-m", str(model), "--parallel", str(parallel), "-c", str(256 * parallel),
                    "--ignore-eos", "--no-progress"], 2)
    assert p.returncode == 0, p.stderr[-3000:]
    got = {r["id"]: r["tokens"] for r in map(json.loads, out.read_text().splitlines())}
    for i, prompt in enumerate(BATCH_PROMPTS):
        assert got[i] == baseline.greedy(model, prompt, 8, n_ctx=256, ignore_eos=True).tokens, (name, parallel, i)


@pytest.mark.full
@pytest.mark.mpi
def test_gemma2_runs_whole_and_refuses_a_split(tiny_models):
    model = tiny_models["gemma2-dense"]
    assert generate_json(model, PROMPT, N_TOKENS, 1, ["--ignore-eos", "-c", "256"])["tokens"] == whole_model(model)
    p = run_ggpipe(["generate", "-m", str(model), "-p", PROMPT, "-n", "4", "-c", "256"], 2)
    lines = stderr_lines(p.stderr)
    assert p.returncode != 0 and len(lines) == 1 and "cannot split" in lines[0] and "sqrt(n_embd)" in lines[0], \
        p.stderr[-2000:]


@pytest.mark.mpi
def test_mla_needs_one_cache_type(tiny_models):
    """DeepSeek-2's MLA cache holds K only: llama.cpp refuses different K
    and V types (llama_init_from_model), ggpipe says so in one line first."""
    p = run_ggpipe(["generate", "-m", str(tiny_models["deepseek2-moe"]), "-p", PROMPT, "-n", "4", "-c", "256",
                    "-ctk", "q8_0", "-ctv", "f16"], 2)
    lines = stderr_lines(p.stderr)
    assert p.returncode != 0 and len(lines) == 1, p.stderr[-2000:]
    assert "-ctk q8_0 -ctv f16" in lines[0] and "MLA latent" in lines[0] and "the same type" in lines[0]


def test_readme_table(tiny_models):
    """The architecture table (docs/user-guide/models.md, "Architectures"): one row per family, in FAMILIES order, its
    speculative column from llama.cpp's recurrent/hybrid flag."""
    text = (ROOT / "docs" / "user-guide" / "models.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([\w.-]+)` \| ([^|]+) \| ([^|]+) \|", text, flags=re.M)
    table = {arch: (split.strip(), spec.strip()) for arch, split, spec in rows}
    for arch, fam in FAMILIES.items():
        assert arch in table, f"README architecture table lacks {arch}"
        split, spec = table[arch]
        assert split.startswith("no") == (fam.refuse is not None), arch
        names = [n for n in NAMES if _arch(n) == arch]
        if fam.refuse is None and names:
            recurrent = file_is_recurrent(tiny_models[names[0]])
            assert spec.startswith("no") == recurrent, arch


def test_models_info_on_moe_and_hybrid(tiny_models):
    p = run_ggpipe(["models", "info", str(tiny_models["qwen3moe-moe"])])
    assert re.search(r"experts\s+2, 2 per token", p.stdout) and re.search(r"speculative modes\s+yes", p.stdout)
    p = run_ggpipe(["models", "info", str(tiny_models["lfm2-dense"])])
    assert re.search(r"speculative modes\s+no: a recurrent state", p.stdout), p.stdout
    assert "every stage needs an attention and a recurrent block" in p.stdout


def test_plan_shows_the_repaired_default_split(tiny_models):
    """ggpipe plan computes the job's default split: moved off one-kind
    hybrid stages where it can be (3 stages of Nemotron-H), refused as the
    job refuses it where it cannot (4 stages, 3 attention blocks)."""
    model = str(tiny_models["nemotron_h-dense"])
    p = run_ggpipe(["plan", "-n", "3", "-m", model])
    assert p.returncode == 0, p.stderr
    layers = re.findall(r"^\d+\s+\S+\s+target\s+(\d+)-(\d+)", p.stdout, flags=re.M)
    assert len(layers) == 3
    for a, b in layers:
        kinds = {HYBRID_BLOCKS["nemotron_h"][i % 3] for i in range(int(a), int(b) + 1)}
        assert {"A", "R"} <= kinds, (a, b)
    p = run_ggpipe(["plan", "-n", "4", "-m", model])
    lines = stderr_lines(p.stderr)
    assert p.returncode != 0 and len(lines) == 1 and "no split of 4 stages avoids such a stage" in lines[0]
