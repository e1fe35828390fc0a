"""``ggpipe chat``: a multi-turn conversation on the head rank.

One user turn per line of stdin (a terminal, or a scripted conversation
piped in). The conversation is rendered with the GGUF's own chat template;
the KV cache keeps the earlier turns, so only the new turn is decoded (see
ggpipe.service.engine). Replies stream to stdout.

Commands: ``/reset`` (forget the conversation), ``/stats`` (the last reply's
speed, TTFT, acceptance rate), ``/quit`` (or end of input).

Ctrl-C: under ``mpiexec`` the launcher forwards SIGINT to every rank. Worker
ranks ignore it; the head stops the current reply at the next accepted token
and waits for the next turn. At the input prompt, Ctrl-C ends the chat
cleanly (a second Ctrl-C makes ``mpiexec`` abort the job).
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
from dataclasses import dataclass

from ggpipe.errors import ConfigError
from ggpipe.service.engine import Engine
from ggpipe.service.job import JobSpec, head_signals, ignore_signals, run_job
from ggpipe.sampling_params import SamplingParams
from ggpipe.transport.launcher_signal import launched_rank

HELP = "commands: /reset (new conversation), /stats (last reply), /quit"


def format_stats(engine: Engine) -> str:
    """One line about the last reply: tokens, tokens/s, TTFT (ms), acceptance."""
    c = engine.last
    if c is None:
        return "no reply yet"
    m = c.metrics
    parts = [f"{len(c.tokens)} tokens", f"prompt {c.n_prompt} tokens ({c.n_reused} reused from the KV cache)"]
    if m.get("tokens_per_s"):
        parts.append(f"{m['tokens_per_s']:.1f} tokens/s")
    if m.get("ttft_wall_s") is not None:
        parts.append(f"TTFT {1000 * m['ttft_wall_s']:.0f} ms")
    acc = c.decoder.get("acceptance_rate")
    if acc is not None:
        parts.append(f"acceptance {acc:.2f}")
    if c.decoder.get("accepted_per_pass"):
        parts.append(f"{c.decoder['accepted_per_pass']:.2f} tokens per target pass")
    parts.append(f"finish: {c.finish_reason}")
    return ", ".join(parts)


#: The longest chat line read, in bytes (its newline not counted): a longer one is counted while
#: it is read, not kept, and answered with one note (:class:`OverlongLine`).
LINE_MAX_BYTES = 1 << 20
#: The most bytes of read lines waiting for the chat loop; beyond it the reader waits for the loop.
QUEUE_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class OverlongLine:
    """A line of more than :data:`LINE_MAX_BYTES`, read and dropped.

    Attributes:
        n_bytes: its length in bytes, newline not counted.
    """

    n_bytes: int


class LineSplitter:
    """Cuts a byte stream into lines (at ``\n`` only), each with its newline;
    a line longer than ``max_bytes`` becomes an :class:`OverlongLine`, and
    at most ``max_bytes`` of it is held at any time.

    Args:
        max_bytes: the longest line kept, in bytes, newline not counted.
    """

    def __init__(self, max_bytes: int = LINE_MAX_BYTES):
        self.max_bytes = max_bytes
        self.pending = bytearray()  # the line being read
        self.dropped = 0            # bytes of the over-long line being read (0: none)

    def feed(self, data: bytes) -> list[bytes | OverlongLine]:
        """The lines that ``data`` completes, in order."""
        out: list[bytes | OverlongLine] = []
        start = 0
        while start < len(data):
            nl = data.find(b"\n", start)
            end = len(data) if nl < 0 else nl
            if self.dropped or len(self.pending) + end - start > self.max_bytes:
                self.dropped += len(self.pending) + end - start
                self.pending.clear()
            else:
                self.pending += data[start:end]
            if nl < 0:
                break
            out.append(self._line(b"\n"))
            start = nl + 1
        return out

    def end(self) -> list[bytes | OverlongLine]:
        """The last line, if the stream did not end with a newline."""
        return [self._line(b"")] if self.pending or self.dropped else []

    def _line(self, newline: bytes) -> bytes | OverlongLine:
        line: bytes | OverlongLine = OverlongLine(self.dropped) if self.dropped else bytes(self.pending) + newline
        self.pending.clear()
        self.dropped = 0
        return line


class StdinReader:
    """Reads stdin's lines (bytes) on a thread from the moment it starts, so
    the pipe is always drained: MPICH's hydra forwards a rank's stdin without
    back-pressure and aborts the job ("process reading stdin too slowly;
    can't keep up") when a burst (a 200 KB line, a scripted conversation)
    does not fit the pipe while the head is loading or replying. What reaches
    mpiexec before any rank runs, beyond the pipe's 64 KiB, overruns it
    before any program could read it (``chat -i FILE`` then; see the README).

    Lines of up to :data:`LINE_MAX_BYTES` are queued as they are read; a
    longer one is queued as an :class:`OverlongLine`. At most
    :data:`QUEUE_MAX_BYTES` of lines wait for :meth:`readline`; beyond that
    the reader waits for it.

    It reads the file descriptor with ``os.read`` (no Python file object: a
    daemon thread blocked inside ``sys.stdin.buffer`` holds its lock, and the
    interpreter aborts at exit when it cannot take it).

    Args:
        fd: the file descriptor to read (0 for stdin).
        max_line_bytes: the longest line queued, in bytes.
        max_queued_bytes: the most bytes of lines queued at once.
    """

    def __init__(self, fd: int = 0, max_line_bytes: int = LINE_MAX_BYTES, max_queued_bytes: int = QUEUE_MAX_BYTES):
        self.interactive = os.isatty(fd)  # a terminal: show the prompt and the banner
        self.lines: queue.Queue[bytes | OverlongLine] = queue.Queue()
        self.max_line_bytes = max_line_bytes
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0
        self.room = threading.Condition()
        self.thread = threading.Thread(target=self._run, args=(fd,), name="ggpipe-stdin", daemon=True)
        self.thread.start()

    def _run(self, fd: int) -> None:
        splitter = LineSplitter(self.max_line_bytes)
        try:
            while True:
                data = os.read(fd, 1 << 20)  # up to a whole enlarged pipe at once
                if not data:
                    break
                for line in splitter.feed(data):
                    self._put(line)
        except OSError:
            pass
        for line in splitter.end():
            self._put(line)
        self._put(b"")  # end of input

    def _put(self, line: bytes | OverlongLine) -> None:
        size = len(line) if isinstance(line, bytes) else 0
        with self.room:
            while self.queued_bytes and self.queued_bytes + size > self.max_queued_bytes:
                self.room.wait()
            self.queued_bytes += size
        self.lines.put(line)

    def readline(self) -> bytes | OverlongLine:
        """The next line with its newline, or an :class:`OverlongLine`; b"" at end of input."""
        while True:
            try:
                line = self.lines.get(timeout=0.5)  # a timed wait: Ctrl-C still reaches the main thread
            except queue.Empty:
                continue
            if isinstance(line, bytes) and line:
                with self.room:
                    self.queued_bytes -= len(line)
                    self.room.notify()
            return line


class ChatLoop:
    """The conversation state and the read-reply loop (head rank).

    Args:
        engine: the head's engine.
        sampling: sampling settings of every reply.
        n_predict: most tokens per reply.
        system: optional system prompt.
        reader: where the turns come from (stdin, or a file with ``-i``).
        stdout: text stream for the replies.
    """

    def __init__(self, engine: Engine, sampling: SamplingParams, n_predict: int, system: str | None,
                 reader: StdinReader, stdout=None):
        self.engine = engine
        self.sampling = sampling
        self.n_predict = n_predict
        self.system = system
        self.reader = reader
        self.out = stdout or sys.stdout
        self.interactive = reader.interactive
        self.interrupted = False
        self.replying = False
        self.reset()

    def reset(self) -> None:
        """Start a new conversation: only the system prompt (if any) stays, and
        the engine's KV caches are cleared."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.engine.reset()

    def on_sigint(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        """SIGINT handler: while a reply is generated, stop it at the next
        accepted token; at the input prompt, raise KeyboardInterrupt (the chat
        ends)."""
        if self.replying:
            self.interrupted = True
        else:
            raise KeyboardInterrupt

    def say(self, text: str) -> None:
        """Write ``text`` to the output stream and flush it."""
        self.out.write(text)
        self.out.flush()

    def read(self) -> str | None:
        """The next line of stdin without its newline; None at end of input.
        A line that is not valid UTF-8, or longer than the reader's limit, is
        not sent: one note, and "" (skipped)."""
        if self.interactive:
            self.say("> ")
        raw = self.reader.readline()
        if isinstance(raw, OverlongLine):
            self.say(f"[that line is {raw.n_bytes:,} bytes long, over the {self.reader.max_line_bytes:,} bytes "
                     "a chat line may have; it was not sent]\n")
            return ""
        if raw == b"":
            return None
        try:
            return raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            self.say(f"[that line is not valid UTF-8 (byte {e.start + 1}); it was not sent]\n")
            return ""

    def run(self) -> int:
        """The read-reply loop until ``/quit``, ``/exit``, end of input or Ctrl-C
        at the prompt; answers ``/reset`` and ``/stats``, sends every other
        non-empty line as a user turn. Returns the exit code (0)."""
        if self.interactive:
            self.say(f"ggpipe chat ({self.engine.mode}); {HELP}\n")
        while True:
            try:
                line = self.read()
            except KeyboardInterrupt:
                self.say("\n")
                return 0
            if line is None:
                return 0
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                cmd = text.split()[0].lower()
                if cmd in ("/quit", "/exit"):
                    return 0
                if cmd == "/reset":
                    self.reset()
                    self.say("[conversation reset]\n")
                elif cmd == "/stats":
                    self.say(format_stats(self.engine) + "\n")
                else:
                    self.say(f"unknown command {cmd}; {HELP}\n")
                continue
            self.turn(line)

    def turn(self, text: str) -> None:
        """One user turn: render, decode what the KV cache lacks, stream the reply."""
        self.messages.append({"role": "user", "content": text})
        tokens = self.engine.tokenize(messages=self.messages)
        room = self.engine.n_ctx - int(tokens.shape[0])
        if room < 1:
            self.messages.pop()
            self.say(f"[the conversation ({tokens.shape[0]} tokens) no longer fits the context "
                     f"({self.engine.n_ctx} tokens): /reset to start a new one, or restart with a larger -c]\n")
            return
        self.interrupted = False
        self.replying = True
        try:
            done = self.engine.generate(tokens, min(self.n_predict, room), self.sampling, on_text=self.say,
                                        should_stop=lambda: self.interrupted)
        finally:
            self.replying = False
        if done.finish_reason == "interrupted":
            self.say(" [stopped]")
        self.say("\n")
        self.messages.append({"role": "assistant", "content": done.text})


def run_chat(job: JobSpec, sampling: SamplingParams, n_predict: int, system: str | None = None,
             input_path=None) -> int:
    """Entry point of every rank; returns the exit code. ``input_path``: read
    the turns from this file instead of stdin (a scripted conversation: under
    MPICH, stdin redirected from a file over 64 KiB can overrun hydra's
    forwarding before any rank runs; see the README).

    Raises:
        ConfigError: the model has no chat template; the input file cannot be read.
    """
    ignore_signals((signal.SIGINT,))  # workers: the head decides what Ctrl-C means
    reader = None
    if (launched_rank() or 0) == 0:  # the launcher gives stdin to rank 0 only: drain it from now on
        if input_path is not None:
            try:
                reader = StdinReader(os.open(input_path, os.O_RDONLY))
            except OSError as e:
                raise ConfigError(f"cannot read the chat input {input_path}: {e.strerror or e}") from None
        else:
            reader = StdinReader(sys.stdin.fileno())

    def head(engine: Engine) -> int:
        if not engine.vocab.chat_template():
            raise ConfigError("this model has no chat template (tokenizer.chat_template): ggpipe chat needs one")
        loop = ChatLoop(engine, sampling, n_predict, system, reader)
        with head_signals(loop.on_sigint, (signal.SIGINT,)):
            return loop.run()

    return run_job(job, head)
