"""``ggpipe batch``: input validation with line numbers, output resumption
(torn last line), and on real ranks a job killed with SIGKILL mid-way and
rerun: every id exactly once, valid JSON, greedy tokens single-node
llama.cpp's (exactly where the build's batch rows equal lone-token rows,
losslessly elsewhere: a prompt processed beside others may end on the other
side of a near-tie), and, where the rows are exact, a seeded sampled request
equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ggpipe.errors import ConfigError
from ggpipe.frontends.batch import done_ids, load_items
from ggpipe.sampling_params import SamplingParams
from tests.conftest import ROOT, assert_greedy, ggpipe_cmd, rank_processes, rows_exact, run_ggpipe, stderr_lines

N = 12
PROMPTS = [
    "The capital of France is",
    "Once upon a time, a warrior named Goliath",
    "Write a Python function that returns the n-th Fibonacci number.",
    "The three laws of thermodynamics are",
    "MPI stands for",
    "The largest planet in the solar system is",
    "A haiku about autumn:",
    "In 1969, the first humans",
    "The recipe for pancakes needs",
    "Photosynthesis is the process",
]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def read_records(path) -> list[dict]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(ln) for ln in lines]  # every line valid JSON


# -- pure logic ----------------------------------------------------------------------


def test_load_items_defaults_and_overrides(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"id": "a", "prompt": "hi"}\n\n{"id": 1, "messages": [{"role": "user", "content": "x"}], '
                 '"n": 3, "temperature": 0.5, "seed": 7, "stop": "\\n"}\n', encoding="utf-8")
    a, b = load_items(f, 9, SamplingParams(top_p=0.9))
    assert (a.id, a.prompt, a.n_predict, a.sampling.temperature, a.sampling.top_p) == ("a", "hi", 9, 0.0, 0.9)
    assert (b.id, b.line, b.n_predict, b.sampling.temperature, b.sampling.seed, b.stop) == (1, 3, 3, 0.5, 7, ["\n"])
    assert b.messages == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("line,message", [
    ('{"id": 1, "prompt": "x"', "not valid JSON"),
    ('[1, 2]', "must be a JSON object"),
    ('{"prompt": "x"}', 'missing "id"'),
    ('{"id": true, "prompt": "x"}', "id must be"),
    ('{"id": "b"}', 'exactly one of "prompt" or "messages"'),
    ('{"id": "b", "prompt": "x", "messages": []}', "exactly one of"),
    ('{"id": "b", "prompt": ""}', "prompt must be a non-empty string"),
    ('{"id": "b", "messages": []}', "messages must be a non-empty list"),
    ('{"id": "b", "messages": [{"role": "user"}]}', "messages[0].content must be a string"),
    ('{"id": "b", "prompt": "x", "n": 0}', "n must be an integer >= 1"),
    ('{"id": "b", "prompt": "x", "max_tokens": "5"}', "max_tokens must be an integer"),
    ('{"id": "b", "prompt": "x", "temperature": -1}', "temperature must be a finite number >= 0"),
    ('{"id": "b", "prompt": "x", "seed": -3}', "seed must be an integer >= 0"),
    ('{"id": "b", "prompt": "x", "top_p": 0}', "top_p must be in (0, 1]"),
    ('{"id": "b", "prompt": "x", "stop": [1]}', "stop must be"),
    ('{"id": "b", "prompt": "x", "nn": 1}', "unknown field 'nn'"),
    ('{"id": "a", "prompt": "again"}', "id \"a\" already used on line 1"),
    # the server's limits (request_limits.py): one validation for both
    ('{"id": "b", "messages": [{"role": "robot", "content": "x"}]}', "role must be one of system, developer"),
    ('{"id": "b", "messages": [{"role": "tool", "content": "x"}]}', "role must be one of"),
    ('{"id": "b", "prompt": "x", "temperature": 5}', "temperature must be at most 2"),
    ('{"id": "b", "prompt": "x", "stop": ["s"] * 17}'.replace('["s"] * 17', json.dumps(["s"] * 17)), "at most 16"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    (json.dumps({"id": "b", "messages": [{"role": "user", "content": "x"}] * 4097}), "at most 4096"),
])
def test_bad_lines_name_their_line(tmp_path, line, message):
    f = tmp_path / "in.jsonl"
    f.write_text('{"id": "a", "prompt": "ok"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_items(f, 8, SamplingParams())
    assert f"{f}:2" in str(e.value) and message in str(e.value)


def test_empty_and_missing_input(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="has no requests"):
        load_items(f, 8, SamplingParams())
    with pytest.raises(ConfigError, match="cannot read"):
        load_items(tmp_path / "nope.jsonl", 8, SamplingParams())


def _rec(rid) -> str:
    return json.dumps({"id": rid, "text": "x", "tokens": [1], "finish_reason": "length", "n_prompt": 1,
                       "n_reused": 0, "metrics": {}}) + "\n"


def test_done_ids_drops_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    good = _rec("a") + _rec(2)
    out.write_text(good + '{"id": "c", "te', encoding="utf-8")
    assert done_ids(out) == {'"a"', "2"}
    assert out.read_text(encoding="utf-8") == good
    whole = good + _rec("c").strip()  # complete JSON but no newline: ggpipe did not cut it short, not touched
    out.write_text(whole, encoding="utf-8")
    with pytest.raises(ConfigError, match="out.jsonl:3 does not end in a newline"):
        done_ids(out)
    assert out.read_text(encoding="utf-8") == whole
    assert done_ids(tmp_path / "missing.jsonl") == set()


def test_done_ids_refuses_a_foreign_file(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("hello\n" + _rec("a"), encoding="utf-8")
    with pytest.raises(ConfigError, match="out.jsonl:1 is not a ggpipe batch record"):
        done_ids(out)


def test_a_raw_line_separator_inside_a_string_is_one_line(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"id": 1, "prompt": "a\u2028b\u2029c\x85d"}\r\n{"id": 2, "prompt": "e"}\n', encoding="utf-8")
    items = load_items(f, 8, SamplingParams())
    assert [i.prompt for i in items] == ["a\u2028b\u2029c\x85d", "e"] and [i.line for i in items] == [1, 2]


# -- real ranks ------------------------------------------------------------------------


def head_pid(mpiexec_pid: int) -> int | None:
    """The pid of rank 0 (its stage process) under a running mpiexec (None until it exists)."""
    head = rank_processes(mpiexec_pid).get(0)
    return None if head is None else head.pid


@pytest.mark.hydra
@pytest.mark.mpi
@pytest.mark.full
def test_kill_and_resume_loses_nothing(tmp_path, smollm2):
    rows = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    rows.append({"id": 99, "prompt": "Tell me a story", "temperature": 0.8, "seed": 5})
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, rows)
    args = ["batch", str(inp), "-o", str(out), "-m", str(smollm2), "-n", str(N)]

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(ggpipe_cmd(args, 2), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_text(encoding="utf-8").count("\n") >= 2:
                break
            time.sleep(0.01)
        assert proc.poll() is None, f"the job ended before it could be killed:\n{proc.communicate()[1][-2000:]}"
        pid = head_pid(proc.pid)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # the head dies mid-request: mpiexec takes the job down
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode != 0
    first = read_records(out)
    assert 2 <= len(first) < len(rows)
    with open(out, "a", encoding="utf-8") as f:  # as if the kill tore a write in half
        f.write('{"id": "p9", "text": "trunc')

    p = run_ggpipe(args, 2, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    recs = read_records(out)
    assert [r["id"] for r in recs[:len(first)]] == [r["id"] for r in first]  # kept, not redone
    ids = [r["id"] for r in recs]
    assert sorted(map(str, ids)) == sorted(str(r["id"]) for r in rows) and len(ids) == len(set(ids))
    by_id = {r["id"]: r for r in recs}
    for i, prompt in enumerate(PROMPTS):
        r = by_id[f"p{i}"]
        assert_greedy(r["tokens"], smollm2, prompt, N, msg=prompt)
        assert r["finish_reason"] in ("stop", "length") and r["text"]
        assert r["metrics"]["n_tokens"] == len(r["tokens"])

    # a fresh, uninterrupted run gives the same records (the seeded sampled one included)
    fresh = tmp_path / "fresh.jsonl"
    p = run_ggpipe(["batch", str(inp), "-o", str(fresh), "-m", str(smollm2), "-n", str(N), "--no-progress"], 2,
                   timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    again = {r["id"]: r["tokens"] for r in read_records(fresh)}
    assert sorted(map(str, again)) == sorted(map(str, by_id))
    if rows_exact(smollm2):
        assert again == {k: v["tokens"] for k, v in by_id.items()}
    else:  # the micro-batches differ from the resumed run's: lossless, not bit-identical
        for i, prompt in enumerate(PROMPTS):
            assert_greedy(again[f"p{i}"], smollm2, prompt, N, msg=prompt)

    # and a third run finds nothing to do
    p = run_ggpipe(args, None, timeout=120)
    assert p.returncode == 0 and "nothing to do" in p.stderr
    assert read_records(out) == recs


LONG = ("The three laws of thermodynamics are the rules that every engine, refrigerator and living cell obeys; "
        "they were found in the nineteenth century by engineers who wanted better steam engines. ") * 6


@pytest.mark.mpi
@pytest.mark.full
def test_a_batch_of_long_prompts_splits_the_layers_for_them(tmp_path, smollm2):
    """Prompts are 95% of the tokens: without --split, the ranks split the
    layers as --split prompts does (15/15 instead of 22/8), the head says
    so with every rank's layers, and the records are single-node llama.cpp's;
    with short prompts and long answers, with --split, or with one target
    stage, the default split stays and nothing is said."""
    rows = [{"id": i, "prompt": f"{i}. {LONG}"} for i in range(3)]
    inp, out = tmp_path / "long.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, rows)
    p = run_ggpipe(["batch", str(inp), "-o", str(out), "-m", str(smollm2), "-n", "4", "--no-progress"], 2, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    notes = [ln for ln in stderr_lines(p.stderr) if "split for them" in ln]
    assert len(notes) == 1 and "(target layers 0-14; target layers 15-29)" in notes[0], p.stderr
    got = {r["id"]: r["tokens"] for r in read_records(out)}
    for r in rows:
        assert_greedy(got[r["id"]], smollm2, r["prompt"], 4, msg=r["id"])

    one_target_stage = ["-n", "4", "-md", str(smollm2), "--mode", "speculative"]   # the draft on rank 1
    for args, name in ((["-n", "4", "--split", "1,1"], "long"), (one_target_stage, "long"), (["-n", "64"], "short")):
        if name == "short":
            write_jsonl(inp, [{"id": i, "prompt": f"Question {i}: what is MPI?"} for i in range(3)])
        out.unlink()
        p = run_ggpipe(["batch", str(inp), "-o", str(out), "-m", str(smollm2), "--no-progress", *args], 2,
                       timeout=180)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "split for them" not in p.stderr and len(read_records(out)) == 3, (args, p.stderr)


@pytest.mark.mpi
@pytest.mark.full
def test_generate_splits_the_layers_for_a_long_prompt(tmp_path, smollm2):
    """generate counts its one request as batch counts a file: a long
    prompt with a short answer gets the layers split for prompts (the note,
    15/15) and single-node llama.cpp's tokens; a short prompt keeps the
    default split, silently."""
    prompt = tmp_path / "long.txt"
    prompt.write_text(LONG, encoding="utf-8")
    p = run_ggpipe(["generate", "-f", str(prompt), "-m", str(smollm2), "-n", "4", "--json"], 2, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    notes = [ln for ln in stderr_lines(p.stderr) if "split for them" in ln]
    assert len(notes) == 1 and "(target layers 0-14; target layers 15-29)" in notes[0], p.stderr
    assert_greedy(json.loads(p.stdout)["tokens"], smollm2, LONG, 4)
    p = run_ggpipe(["generate", "-p", "Question: what is MPI?", "-m", str(smollm2), "-n", "16"], 2, timeout=180)
    assert p.returncode == 0 and "split for them" not in p.stderr, p.stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.full
def test_bad_input_is_one_line_before_generating(tmp_path, smollm2):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": 1, "prompt": "fine"}\n{"id": 2, "prompt": "x", "n": 3000}\n', encoding="utf-8")
    p = run_ggpipe(["batch", str(inp), "-o", str(out), "-m", str(smollm2), "-c", "256"], 2, timeout=120)
    assert p.returncode == 1
    err = stderr_lines(p.stderr)
    assert len(err) == 1 and err[0].startswith(f"ggpipe: error: {inp}:2: ") and "context" in err[0], p.stderr
    assert not out.exists() or out.read_text() == ""


@pytest.mark.mpi
@pytest.mark.full
def test_never_destroys_or_skips_data_it_did_not_write(tmp_path, smollm2):
    """Outputs it must not write (another program's file, the input, a
    device), for real: each refusal is one line, exit 1, and every file is
    exactly as it was (the refusal comes before any generation)."""
    inp = tmp_path / "good.jsonl"
    write_jsonl(inp, [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "MPI is"}])
    notes = tmp_path / "notes.txt"
    cases = [
        (notes, "precious data", "is not a ggpipe batch record"),
        (notes, "precious data\n", "is not a ggpipe batch record"),
        (notes, '{"id": "a", "mine": true}\n', "is not a ggpipe batch record"),   # unrelated JSON with an id
        (notes, '{"id": "q1", "prompt": "hi"}', "is not a ggpipe batch record"),  # json.dump's one line: was cut to 0 B
        (notes, '{"id": "q1", "te', "no ggpipe batch record comes before it"),  # a fragment alone: no evidence
        (inp, None, "is the input file"),
        (Path("/dev/full"), None, "is not a regular file"),
        (Path("/dev/stdout"), None, "is not a regular file"),  # a pipe here, as in `-o /dev/stdout | cat`
    ]
    before_in = inp.read_bytes()
    for out, content, message in cases:
        if content is not None:
            out.write_text(content, encoding="utf-8")
        p = run_ggpipe(["batch", str(inp), "-o", str(out), "-m", str(smollm2), "-n", "4", "--no-progress"], 2,
                       timeout=120)
        err = stderr_lines(p.stderr)
        assert p.returncode == 1 and len(err) == 1 and message in err[0], (out, p.stderr)
        assert "Traceback" not in p.stderr
        if content is not None:
            assert out.read_text(encoding="utf-8") == content
        assert inp.read_bytes() == before_in
