"""Resource bounds: 2,000 tokens of pipeinfer do not grow any rank's memory.

Buffered sends are bounded by the transport (max_pending), partitions by
n_seq_max, in-flight runs by --max-inflight, and llama.cpp allocates the KV
cache for the whole context when it is created. So per-rank peak RSS after
2,000 tokens may exceed that after 200 only by page-level noise, and never by
more than the KV cells the extra tokens fill."""

from __future__ import annotations

import pytest

from tests.conftest import generate_json

pytestmark = [pytest.mark.mpi, pytest.mark.full]

MiB = 1 << 20


# stochastic only (each draft node carries a 393 KB distribution: the larger footprint); greedy dropped to keep CI
# under its 40 minutes
@pytest.mark.parametrize("temp", ["0.8"])
def test_pipeinfer_2000_tokens_rss_does_not_grow(smollm2, temp):
    from ggpipe.models.gguf_info import read_model_info

    args = ["-md", str(smollm2), "--mode", "pipeinfer", "--ignore-eos", "-c", "4096", "--temp", temp, "--seed", "3"]
    short = generate_json(smollm2, "Once upon a time", 200, 2, args)
    long = generate_json(smollm2, "Once upon a time", 2000, 2, args)
    assert len(long["tokens"]) == 2000
    from ggpipe.models.kv_size import kv_bytes_per_cell

    info = read_model_info(smollm2)
    kv_per_token = kv_bytes_per_cell(info.kv_layout, 0, info.n_layer)  # K and V, f16
    for a, b in zip(short["ranks"], long["ranks"]):
        growth = b["peak_rss_bytes"] - a["peak_rss_bytes"]
        assert growth <= min(16 * MiB, kv_per_token * 1800), (a["rank"], growth / MiB)


@pytest.mark.parametrize("extra", [[], ["--branches", "3", "--draft", "8"]])
def test_speculation_fills_the_context_to_its_last_cell(smollm2, goliath, extra):
    """Prompt + -n = -c exactly: the speculative modes draft no further than
    the tokens left (SpecRequest.draft_room), so their KV cells never exceed
    the context (no "KV cache is full" here)."""
    args = ["-md", str(smollm2), "--mode", "pipeinfer", "--ignore-eos", "-c", "256", *extra]
    prompt = "Write a Python function that returns the n-th Fibonacci number."  # 14 tokens

    out = generate_json(goliath, prompt, 242, 2, args)
    assert out["n_prompt"] + len(out["tokens"]) == 256


# -- requests beyond the machine (ggpipe.cluster.resources) -------------------------------------------------------

def test_kv_bytes_and_caps_pure():
    from types import SimpleNamespace

    from ggpipe.cluster.resources import cap_threads, check_kv_memory, context_warning, kv_bytes_per_cell
    from ggpipe.errors import ConfigError

    from ggpipe.models.kv_size import KVLayout

    info = SimpleNamespace(kv_layout=KVLayout(((192, 192),) * 30))  # smollm2-135m: K and V rows of 192 float16
    assert kv_bytes_per_cell(info, 30) == kv_bytes_per_cell(info, (0, 30)) == 30 * 2 * 192 * 2
    # llama.cpp allocates -c rounded up to 256 cells
    check_kv_memory(1024, [("target layers 0-29", 23040)], "rank 0 (h)", available=23040 * 1024)
    with pytest.raises(ConfigError, match=r"-c 1025 needs .* on rank 0 \(h\) .* lower -c"):
        check_kv_memory(1025, [("target layers 0-29", 23040)], "rank 0 (h)", available=23040 * 1024)
    assert cap_threads(2, "rank 1 (h)", cpus=2) == (2, None)
    n, w = cap_threads(1000, "rank 1 (h)", cpus=2)
    assert n == 2 and "rank 1 (h): -t 1000 is more than the 2 CPUs" in w
    assert context_warning(8192, 8192, "m") is None and "8192" in context_warning(8193, 8192, "m")


@pytest.mark.parametrize("ranks", [None, 2])
def test_context_beyond_memory_is_one_line_at_once(smollm2, ranks):
    import time

    from tests.conftest import run_ggpipe, stderr_lines

    t0 = time.monotonic()
    p = run_ggpipe(["generate", "-m", str(smollm2), "-c", "100000000000", "-p", "hi", "-n", "4"], ranks, timeout=120)
    assert p.returncode != 0
    lines = stderr_lines(p.stderr)
    assert len(lines) == 1 and "-c 100000000000 needs" in lines[0] and "lower -c" in lines[0], p.stderr[-2000:]
    assert time.monotonic() - t0 < 60


def test_threads_above_cpus_are_capped(smollm2, reference):
    import json
    import os

    from tests.conftest import run_ggpipe

    cpus = len(os.sched_getaffinity(0))
    p = run_ggpipe(["generate", "-m", str(smollm2), "-t", "1000", "-p", "Hello", "-n", "8", "--json"], 2,
                   timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stderr.count(f"-t 1000 is more than the {cpus} CPUs") == 2  # one line per rank
    assert json.loads(p.stdout)["tokens"] == reference(smollm2, "Hello", 8)
