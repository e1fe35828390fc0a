"""How ``ggpipe chat`` reads its turns, without ranks: lines cut at ``\\n``,
a line over the limit counted and dropped (never held whole), the reader's
queue bounded in bytes, and the note a chat gives for a dropped line."""

from __future__ import annotations

import io
import os
import threading
import time

from ggpipe.frontends.chat import ChatLoop, LineSplitter, OverlongLine, StdinReader


def feed_all(splitter: LineSplitter, chunks) -> list:
    out = []
    for c in chunks:
        out += splitter.feed(c)
    return out + splitter.end()


def test_lines_are_cut_at_newlines_whatever_the_chunks():
    data = b"hello\nwor\rld\n\nlast"
    want = [b"hello\n", b"wor\rld\n", b"\n", b"last"]
    assert feed_all(LineSplitter(), [data]) == want
    assert feed_all(LineSplitter(), [data[i:i + 1] for i in range(len(data))]) == want


def test_a_line_over_the_limit_is_counted_not_kept():
    s = LineSplitter(max_bytes=10)
    assert s.feed(b"0123456789\n") == [b"0123456789\n"]  # exactly the limit: kept
    assert s.feed(b"01234567") == []
    assert s.feed(b"89A") == [] and len(s.pending) == 0 and s.dropped == 11  # over it: nothing held
    assert s.feed(b"x" * 1000) == [] and len(s.pending) == 0
    assert s.feed(b"yz\nok\n") == [OverlongLine(1013), b"ok\n"]
    assert feed_all(LineSplitter(max_bytes=3), [b"abcd"]) == [OverlongLine(4)]  # last line, no newline


def test_the_reader_queues_lines_and_ends_with_an_empty_line():
    r, w = os.pipe()
    reader = StdinReader(r, max_line_bytes=4)
    os.write(w, b"one\ntoolong\ntwo")
    os.close(w)
    assert [reader.readline() for _ in range(4)] == [b"one\n", OverlongLine(7), b"two", b""]
    os.close(r)


def test_the_reader_waits_when_its_queue_is_full():
    r, w = os.pipe()
    reader = StdinReader(r, max_queued_bytes=8)
    os.write(w, b"aaaa\nbbbb\ncccc\n")
    time.sleep(0.3)
    assert reader.queued_bytes == 5 and reader.lines.qsize() == 1  # the second line waits for room
    assert reader.readline() == b"aaaa\n"
    assert reader.readline() == b"bbbb\n"
    assert reader.readline() == b"cccc\n"
    done = threading.Event()
    threading.Thread(target=lambda: (reader.readline(), done.set()), daemon=True).start()
    os.close(w)
    assert done.wait(5)
    os.close(r)


class _Engine:
    mode = "iterative"

    def reset(self):
        pass


def test_the_chat_notes_a_dropped_line_and_goes_on():
    r, w = os.pipe()
    reader = StdinReader(r, max_line_bytes=4)
    out = io.StringIO()
    loop = ChatLoop(_Engine(), None, 4, None, reader, stdout=out)
    os.write(w, b"abcdef\n/x\n/quit\n")
    os.close(w)
    assert loop.run() == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == "[that line is 6 bytes long, over the 4 bytes a chat line may have; it was not sent]"
    assert lines[1].startswith("unknown command /x")  # the chat went on
    os.close(r)
