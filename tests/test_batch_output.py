"""The batch output file: ggpipe appends only to its own records, repairs only
a record it cut short, and never leaves half a record (no MPI, no model)."""

from __future__ import annotations

import errno
import json
import os
import resource
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
    out.write_text(good + json.dumps(rec("c")), encoding="utf-8")  # whole JSON, no newline: cut before it
    assert scan_output(out)[1] == len(good.encode())
    assert scan_output(tmp_path / "missing.jsonl") == (set(), None)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert scan_output(tmp_path / "empty.jsonl") == (set(), None)


@pytest.mark.parametrize("content", [
    "precious data",                                   # no newline, not ggpipe's: the notes.txt
    "precious data\n",
    lines(rec("a")) + "not json\n",                    # a last line that ends in a newline is never torn
    lines(rec("a")) + '{"id": "b", "prompt": "hi"}\n',  # an input line (unrelated JSON with an id)
    '{"id": "b", "note": "mine"}\n' + lines(rec("a")),
    lines(rec("a")) + '{"x": 1, "id": "b"',            # cut short, but not how ggpipe's records start
    lines(rec("a")) + '{"id": true, "text": "", "tokens": [], "finish_reason": "stop"}\n',
])
def test_anything_not_ggpipes_is_refused_untouched(tmp_path, content):
    out = tmp_path / "notes.txt"
    out.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match="is not a ggpipe batch record"):
        scan_output(out)
    assert out.read_text(encoding="utf-8") == content


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

    done = SimpleNamespace(metrics={"tokens_per_s": 1.0}, decoder={"acceptance_rate": 0.5, "other": 1},
                           text="hi", tokens=[1, 2], finish_reason="stop", n_prompt=3, n_reused=0)
    rec = record("q1", done)
    assert is_record(json.loads(json.dumps(rec))) and rec["metrics"] == {"tokens_per_s": 1.0, "acceptance_rate": 0.5}
