"""Every GGPIPE_* variable is checked when a command starts (ggpipe.env_check);
the commands' cases are rows of docs/ERRORS.md's bad-input table."""

from __future__ import annotations

import pytest

from ggpipe.env_check import check_environment, check_trace_dir
from ggpipe.errors import ConfigError


@pytest.mark.parametrize("name, value, message", [
    ("GGPIPE_LINK", "garbage", "GGPIPE_LINK='garbage': bad link"),
    ("GGPIPE_FAULT", "1:boom:2", "GGPIPE_FAULT='1:boom:2'"),
    ("GGPIPE_FAULT", "1:nan:3", "this job has no rank 1"),          # no launcher: one rank
    ("GGPIPE_LINK", "1e400gbit,1ms", "not a finite number"),
    ("GGPIPE_LINK", "1gbit,1e400s", "not a finite number"),
    ("GGPIPE_LINK", "0gbit,1ms", "bandwidth must be positive"),
    ("GGPIPE_LOOKAHEAD", "sometimes", "use on, off or auto"),
    ("GGPIPE_INIT_TIMEOUT", "-5", "GGPIPE_INIT_TIMEOUT='-5'"),
    ("GGPIPE_INIT_TIMEOUT", "nan", "GGPIPE_INIT_TIMEOUT='nan'"),
    ("GGPIPE_FIRST_RUN_ID", "1e3", "give a whole number"),
    ("GGPIPE_GUARD", "off", "GGPIPE_GUARD='off'"),
    ("GGPIPE_MODELS", "/nonexistent/models.toml", "no such file"),
    ("GGPIPE_TRACE_DIR", "/proc/ggpipe-trace", "cannot write the traces there"),
])
def test_a_bad_value_is_one_error_naming_the_variable(name, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        check_environment({name: value})


def test_good_values_pass(tmp_path):
    check_environment({"GGPIPE_LINK": "1gbit,200us", "GGPIPE_FAULT": "0:nan:3", "GGPIPE_LOOKAHEAD": "on",
                       "GGPIPE_INIT_TIMEOUT": "60", "GGPIPE_FIRST_RUN_ID": "2147483600", "GGPIPE_GUARD": "0",
                       "GGPIPE_TRACE_DIR": str(tmp_path / "traces"), "GGPIPE_VERBOSE": "anything",
                       "GGPIPE_CMD": "not ggpipe's"})
    assert (tmp_path / "traces").is_dir() and not list((tmp_path / "traces").iterdir())


def test_a_trace_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        check_trace_dir(str(tmp_path / "f"))
    with pytest.raises(ConfigError, match="cannot write the traces there"):
        check_trace_dir(str(tmp_path / "f" / "sub"))


def test_a_fault_names_a_rank_of_the_launched_job(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    check_environment({"GGPIPE_FAULT": "1:nan:3"})
    with pytest.raises(ConfigError, match=r"no rank 2 \(its ranks are 0..1\)"):
        check_environment({"GGPIPE_FAULT": "2:nan:3"})
