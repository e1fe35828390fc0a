"""Constrained sampling (ggpipe.sampling, step 0 of its chain): the logit
bias, the penalties and min-p do what llama.cpp's own samplers do, to the
bit; a grammar keeps every output inside it; speculative verification keeps
the *constrained* distribution (chi-square, as tests/test_spec_statistics.py),
with each position constrained by the tokens on its path."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import numpy as np
import pytest

from ggpipe.errors import ConfigError
from ggpipe.sampling import Sampler, target_probs
from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.verify import verify_step
from tests.test_spec_statistics import assert_fits, assert_rejects, two_level_pair


def _llama_apply(samplers, logits: np.ndarray, history=()) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's sampler chain (``samplers``: llama_sampler pointers,
    applied in order) over ``logits`` after accepting ``history``; the
    candidates it keeps (ids) and their logits."""
    from ggpipe.runtime.grammar import sampler_apply
    from ggpipe.runtime.llama import lib

    L = lib()
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    for s in samplers:
        L.llama_sampler_chain_add(chain, s)
    try:
        for t in history:
            L.llama_sampler_accept(chain, int(t))
        return sampler_apply(chain, logits)
    finally:
        L.llama_sampler_free(chain)


def _row(seed: int, n: int = 1000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 3, n).astype(np.float32)
    x[rng.integers(0, n, 50)] *= -1   # negative and positive logits both penalised
    return x


@pytest.mark.parametrize("repeat, freq, present, last_n", [
    (1.3, 0.0, 0.0, 64), (1.0, 0.7, 0.0, 64), (1.0, 0.0, -1.5, 64), (1.1, 0.4, 0.6, 8), (0.8, -0.3, 2.0, -1),
])
def test_penalties_and_bias_equal_llama_cpps_samplers(repeat, freq, present, last_n):
    """Sampler.constrain against llama_sampler_init_logit_bias then
    llama_sampler_init_penalties (llama-server's order), prompt tokens
    accepted first as llama-server does: the same float32 logits."""
    from ggpipe.runtime.llama import lib

    L = lib()
    n = 1000
    rng = np.random.default_rng(5)
    history = [int(t) for t in rng.integers(0, 40, 120)]     # repeats in and out of the window
    bias = ((3, -100.0), (7, 2.5), (11, 0.25))
    params = SamplingParams(repeat_penalty=repeat, frequency_penalty=freq, presence_penalty=present,
                            repeat_last_n=last_n, logit_bias=bias)
    for seed in range(3):
        x = _row(seed, n)
        got = Sampler(params, history=history).constrain(x)
        lb = (L.llama_logit_bias * len(bias))(*[L.llama_logit_bias(t, b) for t, b in bias])
        window = len(history) if last_n < 0 else last_n
        ids, want = _llama_apply([L.llama_sampler_init_logit_bias(n, len(bias), lb),
                                  L.llama_sampler_init_penalties(n, window, repeat, freq, present)], x, history)
        assert np.array_equal(ids, np.arange(n))
        assert got.dtype == np.float32 and np.array_equal(got, want), np.flatnonzero(got != want)[:5]


def test_the_window_follows_decided_tokens():
    """Tokens accepted after the prompt enter the window; the oldest leave it."""
    params = SamplingParams(repeat_penalty=2.0, repeat_last_n=2)
    s = Sampler(params, history=[1, 2])
    x = np.ones(5, dtype=np.float32)
    assert s.constrain(x).tolist() == [1, 0.5, 0.5, 1, 1]
    s.accept(3)
    assert s.constrain(x).tolist() == [1, 1, 0.5, 0.5, 1]


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_keeps_what_llama_cpps_min_p_keeps(min_p):
    from ggpipe.runtime.llama import lib

    L = lib()
    for seed in range(3):
        x = _row(seed)
        p = target_probs(x, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=min_p))
        ids, _ = _llama_apply([L.llama_sampler_init_min_p(min_p, 1)], x)
        assert set(np.flatnonzero(p).tolist()) == set(ids.tolist())


def test_greedy_takes_the_argmax_of_the_constrained_row():
    x = _row(1, 50)
    best = int(np.argmax(x))
    s = Sampler(SamplingParams(logit_bias=((best, -100.0),)))
    second = int(np.argsort(-x, kind="stable")[1])
    assert verify_step(x, [best, second], s) == (second, 1)
    assert s.params.reply_k() == 0     # a constrained run asks for full rows


@pytest.mark.parametrize("bad, word", [
    (dict(min_p=5), "min_p"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(presence_penalty=1e308), "presence_penalty"), (dict(repeat_penalty=0), "repeat_penalty"),
    (dict(repeat_last_n=-2), "repeat_last_n"), (dict(logit_bias=((1, 101.0),)), "logit_bias"),
    (dict(logit_bias=((-1, 1.0),)), "logit_bias"), (dict(grammar=""), "grammar"), (dict(logprobs=21), "log-prob"),
])
def test_impossible_settings_are_one_line_naming_them(bad, word):
    with pytest.raises(ConfigError, match=word):
        SamplingParams(**bad).validate()


# -- speculation keeps the constrained distribution ------------------------------------------


def _two_level_counts(params: SamplingParams, history: list[int], v: int, n: int, seed: int,
                      sampler_params: SamplingParams | None = None):
    """Counts of the token pair (t1, t2) SpecGraph decides over random
    two-level trees drawn from unconstrained drafts (as tests/test_spec_statistics.py),
    a fresh sampler per trial (``sampler_params``: the verifier's settings,
    for a negative control); and the constrained target's joint law."""
    rng = np.random.default_rng(seed)
    l1 = rng.normal(0, 1.0, v).astype(np.float32)
    l2 = rng.normal(0, 1.0, (v, v)).astype(np.float32)
    dparams = SamplingParams(temperature=1.2, top_k=0, top_p=1.0)
    q1 = target_probs(rng.normal(0, 1.0, v).astype(np.float32), dparams)
    q2 = np.stack([target_probs(rng.normal(0, 1.0, v).astype(np.float32), dparams) for _ in range(v)])
    joint = []
    for a in range(v):
        ref = Sampler(params, history=history)
        pa = target_probs(ref.constrain(l1), params)[a]
        ref.accept(a)
        joint.append(pa * target_probs(ref.constrain(l2[a]), params))
    joint = np.concatenate(joint)
    counts = np.zeros(v * v, dtype=np.int64)
    draws = np.random.default_rng(seed + 1)
    for i in range(n):
        sampler = Sampler(replace(sampler_params or params, seed=seed * 100_000 + i), history=history)
        t1, t2, _ = two_level_pair(sampler, l1, l2, q1, q2, draws)
        counts[t1 * v + t2] += 1
    return counts, joint


CONSTRAINED = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, repeat_penalty=1.6, presence_penalty=0.8,
                             frequency_penalty=0.3, logit_bias=((0, 1.5), (4, -100.0)), min_p=0.02)


def test_speculation_keeps_the_constrained_distribution():
    """Pairs decided through a speculation tree follow p(t1) p(t2 | t1), each
    position penalised by the tokens before it (the prompt, then t1)."""
    counts, joint = _two_level_counts(CONSTRAINED, history=[1, 2, 2], v=6, n=12_000, seed=3)
    assert counts[[4 * 6 + k for k in range(6)]].sum() == 0   # the banned token never comes first
    assert_fits(counts, joint, "constrained two levels")


def test_the_test_rejects_a_verifier_that_ignores_the_constraints():
    """Negative control: verified without the penalties (only the bias), the
    pairs do not follow the penalised law."""
    target = replace(CONSTRAINED, min_p=0.0)    # no token the plain verifier draws is impossible under it
    plain = replace(target, repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    counts, joint = _two_level_counts(target, history=[1, 2, 2], v=6, n=12_000, seed=3, sampler_params=plain)
    assert_rejects(counts, joint, "penalties ignored")


# -- grammars ------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def vocab(smollm2):
    from ggpipe.runtime.llama import lib
    from ggpipe.runtime.vocab import Vocab

    L = lib()
    p = L.llama_model_default_params()
    p.vocab_only = True
    model = L.llama_model_load_from_file(str(smollm2).encode(), p)
    yield Vocab(model, L.llama_model_get_vocab(model))
    L.llama_model_free(model)


def _text(vocab, tokens) -> str:
    return b"".join(vocab.piece(t) for t in tokens if not vocab.is_eog(t)).decode("utf-8")


def test_a_json_schema_holds_every_sampled_output(vocab):
    """20 outputs sampled from random logits (each position a speculative
    verification with drafted children that ignore the grammar) all parse
    and validate against the schema, and end with end-of-generation."""
    from ggpipe.runtime.grammar import json_grammar

    gbnf = json_grammar(SCHEMA)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, grammar=gbnf)
    for seed in range(20):
        s = Sampler(replace(params, seed=seed), grammar=vocab.grammar(gbnf))
        rng = np.random.default_rng(seed)
        out: list[int] = []
        while len(out) < 200 and not (out and vocab.is_eog(out[-1])):
            x = rng.normal(0, 2, vocab.n_vocab).astype(np.float32)
            q = target_probs(rng.normal(0, 2, vocab.n_vocab).astype(np.float32), SamplingParams(temperature=1.0))
            kids = [int(k) for k in rng.choice(vocab.n_vocab, size=2, p=q)]
            t, _ = verify_step(x, kids, s)
            out.append(t)
        assert vocab.is_eog(out[-1]), _text(vocab, out)
        jsonschema.validate(json.loads(_text(vocab, out)), SCHEMA)


@pytest.mark.parametrize("schema", [None, SCHEMA])
def test_no_control_character_inside_a_json_string(vocab, schema):
    """JSON strings hold no raw control character: after '{"name": "x' a
    newline token is refused, a letter allowed."""
    from ggpipe.runtime.grammar import json_grammar

    g = vocab.grammar(json_grammar(schema))
    for t in vocab.tokenize('{"name": "x', add_special=False):
        g.accept(int(t))
    ok = np.isfinite(g.mask(np.zeros(vocab.n_vocab, dtype=np.float32)))
    newline, letter = (int(vocab.tokenize(c, add_special=False)[0]) for c in ("\n", "a"))
    assert ok[letter] and not ok[newline]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05)],
                         ids=["greedy", "top-k"])
def test_asking_the_grammar_about_the_best_tokens_first_decides_the_same(vocab, params):
    """Grammar.mask(best=k) (the k most likely allowed tokens, all else
    -inf) gives the same distribution as the whole vocabulary masked, in
    JSON structure (few tokens allowed) and inside strings (most allowed)."""
    from ggpipe.runtime.grammar import json_grammar

    gbnf = json_grammar(SCHEMA)
    fast, full = vocab.grammar(gbnf), vocab.grammar(gbnf)
    rng = np.random.default_rng(9)
    for t in vocab.tokenize('{"name": "Ada Byron", "age": 36, "tags": ["a"]}', add_special=False):
        for _ in range(3):
            x = (rng.normal(0, 2, vocab.n_vocab) * rng.choice([1, 4])).astype(np.float32)
            best = 1 if params.greedy else params.top_k
            assert np.array_equal(target_probs(fast.mask(x, best=best), params),
                                  target_probs(full.mask(x), params))
        fast.accept(int(t))
        full.accept(int(t))


def test_json_object_and_a_bad_grammar(vocab):
    from ggpipe.runtime.grammar import json_grammar

    s = Sampler(SamplingParams(grammar="x"), grammar=vocab.grammar(json_grammar(None)))
    first = s.constrain(np.zeros(vocab.n_vocab, dtype=np.float32))
    allowed = [vocab.token_text(int(t)) for t in np.flatnonzero(np.isfinite(first))]
    assert allowed and all(a.lstrip().startswith("{") or not a.strip() for a in allowed)
    with pytest.raises(ConfigError, match="grammar: llama.cpp cannot parse it: .*expecting"):
        vocab.grammar("root ::= (")
    with pytest.raises(ValueError, match="does not allow token"):    # not llama.cpp's abort
        s.accept(int(vocab.tokenize("x", add_special=False)[0]))


@pytest.mark.parametrize("schema, where", [
    ({"type": "integer", "maximum": 3}, "maximum"),
    ({"properties": {"age": {"type": "integer", "minimum": 0}}}, "properties.age.minimum"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}, "anyOf.1.not"),
])
def test_a_schema_keyword_the_grammar_would_ignore_is_refused(schema, where):
    from ggpipe.runtime.grammar import json_grammar

    with pytest.raises(ConfigError, match=f"at {where}.*not enforced"):
        json_grammar(schema)


def test_logprobs_are_the_raw_rows_log_softmax():
    x = _row(2, 30).astype(np.float32)
    s = Sampler(SamplingParams(logprobs=3, logit_bias=((int(np.argmax(x)), -100.0),)))
    t = s.sample(x)
    lse = np.log(np.exp(x.astype(np.float64) - x.max()).sum()) + x.max()
    (lp,) = s.logprobs
    assert lp.token == t and lp.logprob == pytest.approx(float(x[t]) - lse)
    assert [i for i, _ in lp.top] == np.argsort(-x, kind="stable")[:3].tolist()   # the model's, before the bias
