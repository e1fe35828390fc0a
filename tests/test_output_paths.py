"""Outputs are resolved before they are checked (ggpipe.output_paths); the
commands' own cases are rows of docs/ERRORS.md's bad-input table."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ggpipe.errors import ConfigError
from ggpipe.output_paths import check_output, make_parent


def test_a_path_through_a_folder_not_made_yet_is_the_file_it_reaches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="is the input file"):
        check_output("newdir/../in.jsonl", inputs=["in.jsonl"])
    assert not (tmp_path / "newdir").exists()
    assert check_output("newdir/../out.jsonl", inputs=["in.jsonl"]) == tmp_path / "out.jsonl"


def test_a_symlink_to_the_input_is_the_input(tmp_path):
    (tmp_path / "in.jsonl").write_text("{}\n")
    os.symlink(tmp_path / "in.jsonl", tmp_path / "link.jsonl")
    with pytest.raises(ConfigError, match="is the input file"):
        check_output(tmp_path / "link.jsonl", inputs=[tmp_path / "in.jsonl"])


def test_a_foreign_file_is_refused_with_the_callers_reason(tmp_path):
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(ConfigError, match=r"notes.txt\) exists and is not mine"):
        check_output(tmp_path / "x" / ".." / "notes.txt", foreign=lambda p: "exists and is not mine")
    assert check_output(tmp_path / "notes.txt", foreign=lambda p: None) == tmp_path / "notes.txt"


def test_kinds_and_parents(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a folder"):
        check_output(tmp_path / "f", directory=True)
    with pytest.raises(ConfigError, match="is a directory"):
        check_output(tmp_path)
    with pytest.raises(ConfigError, match="is not a regular file"):
        check_output("/dev/null")
    with pytest.raises(ConfigError, match="is not a folder"):
        check_output(tmp_path / "f" / "sub" / "p.json")
    out = check_output(tmp_path / "a" / "b" / "p.json")
    assert not (tmp_path / "a").exists()
    make_parent(out)
    assert (tmp_path / "a" / "b").is_dir()


@pytest.mark.full
def test_calibrate_makes_the_profiles_folder(tmp_path, smollm2):
    """``calibrate -o nodir/p.json`` makes ``nodir`` (was a traceback after the whole run)."""
    out = tmp_path / "nodir" / "p.json"
    p = subprocess.run([sys.executable, "-m", "ggpipe", "calibrate", "-m", str(smollm2), "--reps", "1", "-o",
                        str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert out.is_file() and "Traceback" not in p.stderr
