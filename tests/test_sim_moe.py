"""Mixture-of-experts models in the simulator: shapes of
the MoE models CPU clusters run, the weights a token reads (its experts
only), and the default split balancing bytes when the first blocks are dense."""

from __future__ import annotations

import pytest

from ggpipe.cluster.split import plan_layers
from ggpipe.sim.model import ARCHITECTURES, described, resolve_desc
from ggpipe.sim.profile import LayerShape


def _params(name: str) -> tuple[float, float]:
    d = resolve_desc(f"{name}:Q8_0")
    embd = d.n_vocab * d.n_embd
    total = sum(s.params for s in d.layers) + d.head.params + embd
    active = sum(s.active_params() for s in d.layers) + d.head.params
    return total / 1e9, active / 1e9


@pytest.mark.parametrize("name, total, active", [
    ("qwen3-30b-a3b", 30.5, 3.3),      # Qwen3-30B-A3B: 30.5B, 3.3B activated (model card)
    ("qwen3-235b-a22b", 235, 22),      # 235B, 22B activated
    ("gpt-oss-20b", 21, 3.6),          # 21B, 3.6B active
    ("gpt-oss-120b", 117, 5.1),        # 117B, 5.1B active
    ("deepseek-v2-lite", 15.7, 2.4),   # 15.7B, 2.4B activated
])
def test_moe_shapes_match_the_published_sizes(name, total, active):
    t, a = _params(name)
    assert t == pytest.approx(total, rel=0.05)
    assert a == pytest.approx(active, rel=0.15)  # attention shapes (MLA, sinks) are approximated


def test_a_token_reads_its_experts_only():
    s = LayerShape(bytes=1000, params=1000, expert_bytes=800, expert_params=800, n_expert=8, n_expert_used=2)
    assert s.bytes_read(1) == pytest.approx(200 + 800 * 2 / 8)
    assert s.bytes_read(2) == pytest.approx(200 + 800 * (1 - (6 / 8) ** 2))
    assert s.bytes_read(10_000) == pytest.approx(1000)
    assert s.active_params() == pytest.approx(200 + 800 * 2 / 8)
    dense = LayerShape(1000, 1000)
    assert dense.bytes_read(1) == dense.bytes_read(64) == 1000 and dense.active_params() == 1000


def test_dense_lead_blocks_are_smaller_and_the_default_split_balances_bytes():
    d = described("deepseek-v2-lite", ARCHITECTURES["deepseek-v2-lite"], "Q4_K_M")
    sizes = [s.bytes for s in d.layers]
    assert sizes[0] < sizes[1] / 5 and len(set(sizes[1:])) == 1
    for k in (2, 3, 4, 5):
        ranges = plan_layers(len(sizes), k, None, layer_bytes=sizes)
        heaviest = max(sum(sizes[a:b]) for a, b in ranges)
        assert heaviest <= max(sum(sizes[a:b]) for a, b in plan_layers(27, k, None))
        assert min(sum(sizes[a:b]) for a, b in ranges) >= heaviest - 2 * max(sizes)  # no stage left light
    assert plan_layers(27, 4, None, layer_bytes=sizes) == [(0, 7), (7, 14), (14, 20), (20, 27)]
