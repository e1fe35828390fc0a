"""The batch output file: ggpipe appends only to its own records, repairs only
a record it cut short, and never leaves half a record (no MPI, no model)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from ggpipe.errors import ConfigError
from ggpipe.frontends.batch_output import RecordWriter, check_output_path, repair, scan_output


def rec(rid, text="x") -> dict:
    return {"id": rid, "text": text, "tokens": [1, 2], "finish_reason": "length", "n_prompt": 3, "n_reused": 0,
            "metrics": {"tokens_per_s": 1.0}}


def lines(*recs) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)


def test_own_records_are_read_and_a_torn_one_is_found(tmp_path):
    out = tmp_path / "out.jsonl"
    good = lines(rec("a"), rec(2, "line\u2028sep \U0001f600"))
    out.write_text(good + '{"id": "c", "te', encoding="utf-8")
    assert scan_output(out) == ({'"a"', "2"}, len(good.encode()))
    assert out.read_text(encoding="utf-8").startswith(good + '{"id": "c"')  # scanning changes nothing
    repair(out, len(good.encode()))
    assert out.read_text(encoding="utf-8") == good
    assert scan_output(tmp_path / "missing.jsonl") == (set(), None)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert scan_output(tmp_path / "empty.jsonl") == (set(), None)


@pytest.mark.parametrize("content", [
    "precious data",                                   # no newline, not ggpipe's: someone's notes.txt
    "precious data\n",
    lines(rec("a")) + "not json\n",                    # a last line that ends in a newline is never torn
    lines(rec("a")) + '{"id": "b", "prompt": "hi"}\n',  # an input line (unrelated JSON with an id)
    '{"id": "b", "note": "mine"}\n' + lines(rec("a")),
    lines(rec("a")) + '{"x": 1, "id": "b"',            # cut short, but not how ggpipe's records start
    lines(rec("a")) + '{"id": true, "text": "", "tokens": [], "finish_reason": "stop"}\n',
    '{"id": "q1", "prompt": "The capital of France is"}',  # the README's input, one line by json.dump: no newline
    '{"id": 1, "prompt": "hi"}',                        # ... or by printf
    lines(rec("a")) + '{"id": "b", "prompt": "hi"}',    # a whole JSON line that is not a record: never torn
    lines(rec("a")) + '{"id": "b", "x\rprecious\n',  # a CR is no line end: this is not a last line cut short
])
def test_anything_not_ggpipes_is_refused_untouched(tmp_path, content):
    out = tmp_path / "notes.txt"
    out.write_bytes(content.encode())
    with pytest.raises(ConfigError, match="is not a ggpipe batch record"):
        scan_output(out)
    assert out.read_bytes() == content.encode()


@pytest.mark.parametrize("content", [
    '{"id": "c", "te',                                  # a fragment alone: nothing shows the file is ggpipe's
    '\n\n{"id": "c", "te',
    json.dumps(rec("c")),                               # a whole record with no newline: not how ggpipe ends one
    lines(rec("a")) + json.dumps(rec("c")),
])
def test_no_evidence_of_a_torn_record_is_refused_untouched(tmp_path, content):
    """A last line is treated as a record cut short only if it does not parse
    and every other line of the file is a ggpipe record (at least one)."""
    out = tmp_path / "out.jsonl"
    out.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match="ggpipe only appends to its own output"):
        scan_output(out)
    assert out.read_text(encoding="utf-8") == content


def test_one_line_json_input_given_as_output_is_not_cut(tmp_path):
    """A one-line file written by json.dump (no newline), given as the output,
    is not taken for a torn record and cut to 0 bytes by the resume path."""
    from ggpipe.frontends.batch import done_ids

    out = tmp_path / "prompts.json"
    with open(out, "w") as f:
        json.dump({"id": "q1", "prompt": "The capital of France is"}, f)
    before = out.read_bytes()
    with pytest.raises(ConfigError, match="is not a ggpipe batch record"):
        done_ids(out)
    assert out.read_bytes() == before
    good = lines(rec("a"))
    out.write_text(good + '{"id": "b", "text": "cut', encoding="utf-8")  # ggpipe's records + a torn one: repaired
    assert done_ids(out) == {'"a"'} and out.read_text(encoding="utf-8") == good


def test_output_must_be_a_regular_file_other_than_the_input(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "hi"}\n')
    with pytest.raises(ConfigError, match="is the input file"):
        check_output_path(inp, inp)
    os.symlink(inp, tmp_path / "link.jsonl")
    with pytest.raises(ConfigError, match="is the input file"):
        check_output_path(tmp_path / "link.jsonl", inp)
    for dev in ("/dev/full", "/dev/null", "/dev/zero"):
        with pytest.raises(ConfigError, match="not a regular file"):
            scan_output(dev)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        scan_output(fifo)  # refused before it is opened: opening a FIFO would block
    with pytest.raises(ConfigError, match="is a directory"):
        check_output_path(tmp_path)
    check_output_path(tmp_path / "new.jsonl", inp)


def test_repair_on_a_read_only_file_is_one_error(tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    out.write_text(lines(rec("a")) + '{"id": "b"', encoding="utf-8")

    def erofs(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr("builtins.open", erofs)
    with pytest.raises(ConfigError, match="cut short by an earlier run and cannot be removed .Read-only file system"):
        repair(out, 10)


def test_writer_cannot_create_its_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot write the output file .*Not a directory"):
        RecordWriter(tmp_path / "file" / "sub" / "out.jsonl")


def test_disk_full_leaves_no_half_record(tmp_path):
    """A record that does not fit (RLIMIT_FSIZE, as a full disk) is cut back;
    the records before it stay. Run in a child: the limit is per process."""
    out = tmp_path / "out.jsonl"
    code = f"""
import resource, sys
sys.path.insert(0, {str(os.getcwd())!r})
from ggpipe.errors import ConfigError
from ggpipe.frontends.batch_output import RecordWriter
resource.setrlimit(resource.RLIMIT_FSIZE, (600, 600))
w = RecordWriter({str(out)!r})
try:
    for i in range(100):
        w.write({{"id": i, "text": "y" * 100, "tokens": [], "finish_reason": "length"}})
except ConfigError as e:
    print(e)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "cannot write to the output file" in p.stdout and "records written before are kept" in p.stdout, p
    data = out.read_bytes()
    assert data.endswith(b"\n") and len(data) <= 600
    assert scan_output(out)[1] is None and len(scan_output(out)[0]) == data.count(b"\n") >= 1


def test_what_record_writes_is_recognised_as_a_record():
    """record() and is_record() are one definition of the shape: a record
    ggpipe writes is never refused as foreign on the next run."""
    from types import SimpleNamespace

    from ggpipe.frontends.batch_output import is_record, record

    from ggpipe.sampling import TokenLogprob

    done = SimpleNamespace(metrics={"tokens_per_s": 1.0}, decoder={"acceptance_rate": 0.5, "other": 1},
                           text="hi", tokens=[1, 2], finish_reason="stop", n_prompt=3, n_reused=0, logprobs=None)
    rec = record("q1", done)
    assert is_record(json.loads(json.dumps(rec))) and rec["metrics"] == {"tokens_per_s": 1.0, "acceptance_rate": 0.5}
    done.logprobs = [TokenLogprob(1, -0.5, ((1, -0.5), (7, -1.5))), TokenLogprob(2, -0.1, ((2, -0.1), (3, -3.0)))]
    rec = record("q2", done)
    assert is_record(json.loads(json.dumps(rec))) and rec["logprobs"][1] == [2, -0.1, [[2, -0.1], [3, -3.0]]]
