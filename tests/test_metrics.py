import json
import os

import pytest

from ggpipe.metrics import GenerationClock, MemorySampler, rank_info, summarize_itl


class FakeClock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


def _run(now, count_prompt_token=True):
    """start=100; prompt 2 s; prompt token at +0.5; acceptances of 1, 3, 1 tokens
    at +1, +2, +0.5 after it."""
    c = GenerationClock(now=now, count_prompt_token=count_prompt_token)
    now.advance(2.0)
    c.prompt_done()
    now.advance(0.5)
    c.token()          # prompt token (or first acceptance when not counted)
    now.advance(1.0)
    c.token()
    now.advance(2.0)
    c.token(3)
    now.advance(0.5)
    c.token()
    now.advance(0.25)
    c.finish()
    return c


def test_clock_paper_definitions():
    c = _run(FakeClock())
    assert c.n_tokens == 6 and c.n_gen_tokens == 5 and c.n_acceptances == 3
    assert c.prompt_s == 2.0
    assert c.ttft_wall_s == 2.5          # start -> prompt token printed
    assert c.ttft_s == 1.5               # prompt_done -> first acceptance after prompt token
    assert c.acceptance_gaps_s == [1.5, 2.0, 0.5]
    assert c.gen_s == 4.0                # prompt_done -> last acceptance
    assert c.tokens_per_s == 5 / 4.0
    assert c.itl_s == pytest.approx([1.5, 2 / 3, 2 / 3, 2 / 3, 0.5])
    assert c.itl_mean_s == pytest.approx(4.0 / 5)
    assert c.total_s == 6.25
    d = c.as_dict()
    json.dumps(d)
    assert d["itl_p50_s"] == 1.5
    assert d["itl_p90_s"] == pytest.approx(1.9)
    assert d["itl_accept_mean_s"] == pytest.approx(4.0 / 3)
    assert d["ttft_s"] == 1.5 and d["tokens_per_s"] == 1.25


def test_clock_without_prompt_token():
    c = _run(FakeClock(), count_prompt_token=False)
    assert c.n_tokens == c.n_gen_tokens == 6
    assert c.ttft_s == 0.5 and c.ttft_wall_s == 2.5
    assert c.acceptance_gaps_s == [0.5, 1.0, 2.0, 0.5]
    assert c.tokens_per_s == 6 / 4.0


def test_clock_empty_figures_are_none():
    now = FakeClock()
    c = GenerationClock(now=now)
    d = c.as_dict()
    assert d["n_tokens"] == 0 and d["ttft_s"] is None and d["tokens_per_s"] is None
    assert d["prompt_s"] is None and d["itl_p50_s"] is None
    now.advance(1)
    c.prompt_done()
    now.advance(1)
    c.token()  # only the prompt token
    assert c.n_tokens == 1 and c.n_gen_tokens == 0
    assert c.ttft_s is None and c.tokens_per_s is None and c.itl_mean_s is None
    assert c.ttft_wall_s == 2.0 and c.itl_s == []


def test_clock_misuse():
    c = GenerationClock(now=FakeClock())
    with pytest.raises(RuntimeError):
        c.token()
    c.prompt_done()
    with pytest.raises(RuntimeError):
        c.prompt_done()
    with pytest.raises(ValueError):
        c.token(2)  # the prompt token is a single token
    with pytest.raises(ValueError):
        c.token(0)
    c.token()
    c.finish()
    with pytest.raises(RuntimeError):
        c.token()


def test_clock_restart():
    now = FakeClock()
    c = _run(now)
    c.start()
    assert c.n_tokens == 0 and c.t_start == now.t


def test_default_clock_is_real_time():
    c = GenerationClock()
    c.prompt_done()
    c.token()
    c.token()
    c.finish()
    assert c.ttft_s >= 0 and c.total_s >= c.gen_s >= 0


def test_summarize_itl():
    assert summarize_itl([]) == {"mean": None, "p50": None, "p90": None}
    s = summarize_itl([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == 2.5 and s["p50"] == 2.5 and s["p90"] == pytest.approx(3.7)
    assert all(isinstance(v, float) for v in s.values())


def test_memory_sampler_sees_allocation():
    """Run in a fresh interpreter: inside a long test session freed memory is
    reused and a new array may not raise RSS."""
    import json
    import subprocess
    import sys

    code = """
import json, numpy as np
from ggpipe.metrics import MemorySampler
m = MemorySampler(interval_s=0.01)
m.start()
daemon = m._thread.daemon
rss0, _ = m.sample()
a = np.ones(50 * 1024 * 1024 // 8)  # 50 MiB, pages touched
rss1, pss1 = m.sample()
res = m.stop()
print(json.dumps(dict(daemon=daemon, rss0=rss0, rss1=rss1, pss1=pss1, res=res, alive=m._thread.is_alive())))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout)
    res, rss0, rss1, pss1 = out["res"], out["rss0"], out["rss1"], out["pss1"]
    assert out["daemon"]
    assert set(res) == {"peak_rss_bytes", "peak_pss_bytes", "rss_bytes", "pss_bytes"}
    assert rss1 - rss0 > 40 * 1024 * 1024
    assert res["peak_rss_bytes"] >= rss1 >= res["rss_bytes"] - 10 * 1024 * 1024
    assert res["peak_rss_bytes"] >= res["rss_bytes"]
    if pss1 is not None:
        assert res["peak_pss_bytes"] >= pss1
        assert res["peak_pss_bytes"] >= res["pss_bytes"]
    assert not out["alive"]


def test_memory_sampler_context_manager_and_thread_samples():
    import time
    with MemorySampler(interval_s=0.005) as m:
        time.sleep(0.05)
    assert m.result["peak_rss_bytes"] > 0
    assert m.result["peak_rss_bytes"] >= m.result["rss_bytes"]


def test_memory_sampler_reads_pss_only_every_pss_interval(monkeypatch):
    """A PSS reading walks every mapped page (10-20 ms for a rank holding the F32 target):
    the thread reads RSS every interval, PSS at start, report and every
    pss_interval_s only."""
    import time
    m = MemorySampler(interval_s=0.002, pss_interval_s=10.0)
    full = m._proc.memory_full_info
    calls = []
    monkeypatch.setattr(m._proc, "memory_full_info", lambda: calls.append(1) or full())
    m.start()
    time.sleep(0.1)
    res = m.stop()
    assert len(calls) == 2  # start() and report()
    assert res["peak_rss_bytes"] >= res["rss_bytes"] > 0
    if res["pss_bytes"] is not None:
        assert res["peak_pss_bytes"] >= res["pss_bytes"] > 0
    m2 = MemorySampler(interval_s=0.002, pss_interval_s=0.01)
    calls2 = []
    full2 = m2._proc.memory_full_info
    monkeypatch.setattr(m2._proc, "memory_full_info", lambda: calls2.append(1) or full2())
    m2.start()
    time.sleep(0.1)
    m2.stop()
    assert 4 <= len(calls2) < 40


def test_memory_sampler_without_pss(monkeypatch):
    m = MemorySampler()

    def boom():
        raise NotImplementedError
    monkeypatch.setattr(m._proc, "memory_full_info", boom)
    res = m.start().stop()
    assert res["pss_bytes"] is None and res["peak_pss_bytes"] is None
    assert res["peak_rss_bytes"] > 0


def test_rank_info():
    info = rank_info(3)
    assert info["rank"] == 3 and info["pid"] == os.getpid()
    assert isinstance(info["host"], str) and info["host"]
    assert info["cpu_count"] == os.cpu_count()
    if info["cpu_affinity"] is not None:
        assert all(isinstance(c, int) for c in info["cpu_affinity"])
    json.dumps(info)


def test_memory_sampler_skips_a_reading_when_no_descriptor_is_left(monkeypatch):
    """Under a connection flood every descriptor can be taken: the sampler
    skips that reading (was: its thread died with a traceback) and keeps PSS."""
    import errno
    import time

    from ggpipe.metrics import MemorySampler

    m = MemorySampler(interval_s=0.01)
    m.start()
    real = m._proc.memory_info
    calls = {"n": 0}

    def emfile():
        calls["n"] += 1
        if calls["n"] <= 3:
            raise OSError(errno.EMFILE, "Too many open files")
        return real()

    monkeypatch.setattr(m._proc, "memory_info", emfile)
    monkeypatch.setattr(m._proc, "memory_full_info", lambda: (_ for _ in ()).throw(OSError(errno.EMFILE, "x")))
    deadline = time.monotonic() + 5
    while calls["n"] < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m._thread.is_alive() and calls["n"] >= 5
    m.stop()
