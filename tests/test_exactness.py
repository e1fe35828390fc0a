"""Greedy output of the pipeline equals single-node llama.cpp, token for token,
on real weights, for 1..4 real MPI ranks and even and uneven splits; sliced
stages reproduce the whole model's hidden states exactly."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import PROMPTS, generate_json

pytestmark = pytest.mark.full  # the fast tier runs the one case marked smoke

N_TOKENS = 64

SPLITS = [
    (None, None),          # one process, no MPI
    (1, None),
    (2, None),
    (2, "0.2,0.8"),
    (3, None),
    (3, "prompts"),   # the default split without the LM head: 10/10/10 where the default gives the head's stage fewer
    (4, None),
    (4, "0.1,0.2,0.3,0.4"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,split", [  # R2-even: the fast tier's smoke test of the pipeline on real ranks
    pytest.param(r, s, id=f"R{r}-{s or 'even'}", marks=[pytest.mark.smoke] if (r, s) == (2, None) else [])
    for r, s in SPLITS])
def test_smollm2_pipeline_matches_single_node(smollm2, reference, ranks, split):
    extra = ["--split", split] if split else []
    for prompt in PROMPTS:
        got = generate_json(smollm2, prompt, N_TOKENS, ranks, extra)
        want = reference(smollm2, prompt, N_TOKENS)
        assert got["tokens"] == want, f"prompt {prompt!r}, ranks={ranks}, split={split}"
        assert got["n_ranks"] == (ranks or 1)
        layers = [tuple(r["layers"]) for r in got["ranks"]]
        assert layers[0][0] == 0 and layers[-1][1] == 30
        assert all(a[1] == b[0] for a, b in zip(layers, layers[1:]))
        if split == "prompts":
            assert layers == [(0, 10), (10, 20), (20, 30)]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,split", [(2, None), (3, "0.3,0.3,0.4"), (4, None)])
def test_goliath_pipeline_matches_single_node(goliath, reference, ranks, split):
    extra = ["--split", split] if split else []
    for prompt in PROMPTS:
        got = generate_json(goliath, prompt, N_TOKENS, ranks, extra)
        assert got["tokens"] == reference(goliath, prompt, N_TOKENS), f"prompt {prompt!r}"


@pytest.mark.mpi
def test_long_prompt_in_pipelined_chunks_matches(smollm2, reference):
    """A prompt longer than the ubatch travels as several back-to-back chunks;
    the reference processes it in chunks of the same size."""
    prompt = " ".join(PROMPTS * 6)
    got = generate_json(smollm2, prompt, 16, 2, ["--ubatch", "32"])
    assert got["n_prompt"] > 64
    # the reference uses one 512-token batch: chunking must not change the tokens
    assert got["tokens"] == reference(smollm2, prompt, 16)


def _stage(path, n_layer, first, last):
    from ggpipe.runtime.stage import Stage, StageSpec

    return Stage(StageSpec(model_path=path, n_layer=n_layer, first=first, last=last, n_ctx=256))


def test_sliced_stages_reproduce_whole_model_bit_for_bit(smollm2, tmp_path):
    """Stage hidden states of a sliced model equal the whole model's (max abs
    diff 0), and the last slice's logits equal the whole model's."""
    from ggpipe.models.derive import derive_gguf
    from ggpipe.runs import Run

    a = derive_gguf(smollm2, list(range(0, 12)), tmp_path / "a.gguf")
    b = derive_gguf(smollm2, list(range(12, 30)), tmp_path / "b.gguf")
    whole_cut = _stage(smollm2, 12, True, False)   # whole model, capture l_out-11
    whole = _stage(smollm2, 30, True, True)
    s0 = _stage(a, 12, True, False)
    s1 = _stage(b, 18, False, True)
    try:
        tree = Run.linear(np.array([504, 3575, 282, 4649, 314, 2155, 7042], dtype=np.int32), 0)
        tree.outputs[:] = 1
        kw = dict(pos=tree.pos, n_seq_id=tree.n_seq_id, seq_ids=tree.seq_ids, outputs=tree.outputs)
        h_whole = whole_cut.decode(tokens=tree.tokens, **kw)
        h0 = s0.decode(tokens=tree.tokens, **kw)
        assert h0.shape == (7, 576)
        assert np.max(np.abs(h0 - h_whole)) == 0.0
        logits = s1.decode(embd=h0, **kw)
        ref = whole.decode(tokens=tree.tokens, **kw)
        assert logits.shape == ref.shape == (7, 49152)
        assert np.max(np.abs(logits - ref)) == 0.0
    finally:
        for s in (whole_cut, whole, s0, s1):
            s.close()


@pytest.mark.mpi
def test_chat_template_matches_single_node(smollm2, reference):
    """--chat wraps the prompt in the GGUF's own template (rendered here with
    llama-cpp-python's Jinja2ChatFormatter and the template from the file)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from ggpipe.models.gguf_info import read_model_info

    info = read_model_info(smollm2)
    fmt = Jinja2ChatFormatter(template=info.chat_template, eos_token="<|im_end|>", bos_token="<|im_start|>",
                              add_generation_prompt=True)
    text = fmt(messages=[{"role": "user", "content": "What is MPI?"}]).prompt
    assert "<|im_start|>assistant" in text
    got = generate_json(smollm2, "What is MPI?", 32, 2, ["--chat"])
    assert got["tokens"] == reference(smollm2, text, 32)
