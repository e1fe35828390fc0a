"""The output file of ``ggpipe batch``: what may be appended to, what may be
repaired, and how a record is written so that no half record is left behind.

Rules (never destroy or skip data ggpipe did not write):

* The output must be a regular file (or not exist yet) and must not be the
  input file. A device, a FIFO, a terminal or ``/dev/stdout`` on a pipe is
  refused before anything is read from it.
* Every non-blank line must be a ggpipe batch record: a JSON object whose
  keys are those :func:`record` writes (``id``, ``text``, ``tokens``,
  ``finish_reason``, ``n_prompt``, ``n_reused``, ``metrics``; records of
  older versions lack the last three), ending in a newline. Anything else, anywhere,
  and the file is refused untouched.
* The one repair: a last line with **no** newline that does **not** parse as
  JSON, that begins the way every ggpipe record begins (``{"id": ``), in a
  file whose every other non-blank line is a ggpipe record (one at least), is
  a record a kill cut short (the newline is the last byte of each write). It
  is removed and its request runs again. A last line without a newline that
  parses (a one-line file written by ``json.dump`` or ``printf``, even a whole
  record) was not cut short by ggpipe, and a fragment with no record before
  it is no evidence that the file is ggpipe's: both are refused untouched.
* A record is appended with one ``write`` of the whole line and fsync'd; if
  the write fails (disk full, quota, I/O error), the file is cut back to its
  size before the write, so no half record stays.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from ggpipe.errors import ConfigError
from ggpipe.output_paths import check_output

#: Keys of a batch record: always / sometimes present.
RECORD_KEYS = frozenset({"id", "text", "tokens", "finish_reason"})
OPTIONAL_KEYS = frozenset({"n_prompt", "n_reused", "metrics", "logprobs"})
#: How every record line starts (``json.dumps`` of a dict whose first key is "id").
RECORD_PREFIX = b'{"id": '


def record(rid: str | int, done) -> dict:
    """The output record of a finished request ``rid`` (``done``: a
    Completion); its keys are RECORD_KEYS | OPTIONAL_KEYS, which
    :func:`is_record` checks."""
    m = dict(done.metrics)
    m.update({k: v for k, v in done.decoder.items() if k in ("acceptance_rate", "accepted_per_pass", "drafted",
                                                              "draft_accepted", "target_passes",
                                                              "acceptance_per_position", "prompt_steps",
                                                              "step_tokens")})
    out = {"id": rid, "text": done.text, "tokens": done.tokens, "finish_reason": done.finish_reason,
           "n_prompt": done.n_prompt, "n_reused": done.n_reused, "metrics": m}
    if done.logprobs is not None:   # per token: [token, logprob, [[id, logprob], ...]]
        out["logprobs"] = [[lp.token, lp.logprob, [list(t) for t in lp.top]] for lp in done.logprobs]
    return out


def id_key(value) -> str:
    """Canonical text of an id (so 1 and "1" stay different ids)."""
    return json.dumps(value)


def is_record(obj) -> bool:
    """True if ``obj`` (a decoded JSON value) has the shape of a batch record."""
    if not isinstance(obj, dict):
        return False
    keys = set(obj)
    return (RECORD_KEYS <= keys <= RECORD_KEYS | OPTIONAL_KEYS and isinstance(obj["text"], str)
            and isinstance(obj["tokens"], list) and isinstance(obj["finish_reason"], str)
            and (isinstance(obj["id"], (str, int)) and not isinstance(obj["id"], bool)))


def check_output_path(output: str | os.PathLike, input_path: str | os.PathLike | None = None) -> Path:
    """Refuse an output that batch must not read or append to; returns it
    resolved (``..`` and symlinks, also through folders not made yet:
    :func:`ggpipe.output_paths.check_output`), the path to write to.

    Raises:
        ConfigError: the output is not a regular file (device, FIFO, socket,
            directory), is the input file itself, or lies under a file.
    """
    return check_output(output, inputs=(input_path,))


def scan_output(path: str | os.PathLike) -> tuple[set[str], int | None]:
    """Read an existing output file without changing it.

    Returns:
        ``(done, cut_at)``: the ids (:func:`id_key`) already recorded, and the
        byte offset where a record cut short by a kill begins (None if there
        is none). A missing file -> ``(set(), None)``.

    Raises:
        ConfigError: the file cannot be read, or holds anything that is not a
            ggpipe batch record (naming the first such line).
    """
    check_output_path(path)
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        return set(), None
    except OSError as e:
        raise ConfigError(f"cannot read the output file {p}: {e.strerror or e}") from None
    done: set[str] = set()
    records = 0
    offset = 0
    parts = data.split(b"\n")  # lines end at "\n" only (bytes.splitlines would also end one at a "\r")
    chunks = [part + b"\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    for i, raw in enumerate(chunks, start=1):
        if raw.strip():
            cut = False  # does not parse: the only shape a record cut short can have
            try:
                rec = json.loads(raw)
            except ValueError:  # JSONDecodeError, UnicodeDecodeError
                rec, cut = None, True
            except RecursionError:  # nested too deeply: no record either way
                rec = None
            if not raw.endswith(b"\n"):  # the last line: every other one ends in its newline
                if cut and raw.startswith(RECORD_PREFIX):
                    if records:
                        return done, offset  # torn by a kill: the newline is the last byte ggpipe writes
                    raise ConfigError(f"the output file {p}:{i} is cut short and no ggpipe batch record comes "
                                      f"before it, so nothing shows the file is ggpipe's; ggpipe only appends to "
                                      f"its own output: give another -o, or delete the file if an earlier run "
                                      f"was killed while writing its first record (the file is left as it is)")
                if is_record(rec):
                    raise ConfigError(f"the output file {p}:{i} does not end in a newline, which every record "
                                      f"ggpipe writes does; ggpipe only appends to its own output: give another "
                                      f"-o (the file is left as it is)")
            if not (raw.endswith(b"\n") and is_record(rec)):
                raise ConfigError(f"the output file {p}:{i} is not a ggpipe batch record; ggpipe only appends to "
                                  f"its own output: give another -o (the file is left as it is)")
            done.add(id_key(rec["id"]))
            records += 1
        offset += len(raw)
    return done, None


def repair(path: str | os.PathLike, cut_at: int) -> None:
    """Remove the record a kill cut short (from byte ``cut_at`` on).

    Raises:
        ConfigError: the file cannot be changed (read-only file system, ...).
    """
    p = Path(path)
    try:
        with open(p, "r+b") as f:
            f.truncate(cut_at)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ConfigError(f"the last record of {p} was cut short by an earlier run and cannot be removed "
                          f"({e.strerror or e}); make the file writable and run the same command again") from None


class RecordWriter:
    """Appends whole records to the output file.

    Args:
        path: the output file (created with its directory if missing).

    Raises:
        ConfigError: the directory or file cannot be created or opened.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0),
                              0o644)
        except OSError as e:
            raise ConfigError(f"cannot write the output file {self.path}: {e.strerror or e}") from None

    def write(self, rec: dict) -> None:
        """Append ``rec`` as one JSON line, then fsync.

        Raises:
            ConfigError: the write failed (disk full, ...); the file is cut
                back to the records before it.
        """
        line = (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")
        size = os.fstat(self.fd).st_size
        try:
            view = memoryview(line)
            while view:
                n = os.write(self.fd, view)
                if n <= 0:
                    raise OSError(errno.EIO, "short write")
                view = view[n:]
            os.fsync(self.fd)
        except OSError as e:
            try:
                os.ftruncate(self.fd, size)
            except OSError:
                pass
            raise ConfigError(f"cannot write to the output file {self.path} ({e.strerror or e}); the records "
                              f"written before are kept: free space and run the same command again") from None

    def close(self) -> None:
        """Close the output file's descriptor."""
        os.close(self.fd)
