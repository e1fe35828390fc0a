import numpy as np
import pytest

from ggpipe.errors import GGPipeError, SplitError
from ggpipe.cluster.loading import layer_ranges
from ggpipe.cluster.split import PROMPT_SHARE, SplitSpec, describe_plan, parse_split, plan_layers, prompts_dominate


# ---- parse_split ---------------------------------------------------------

@pytest.mark.parametrize("text", [None, "", "   "])
def test_parse_empty_is_even(text):
    assert parse_split(text) == SplitSpec(None, None)


def test_parse_target_only():
    assert parse_split("0.3,0.7") == SplitSpec((0.3, 0.7), None)


def test_parse_target_and_draft_with_spaces():
    assert parse_split(" 0.5, 0.5 / 1.0 ") == SplitSpec((0.5, 0.5), (1.0,))


def test_parse_single_and_integer_weights():
    assert parse_split("1") == SplitSpec((1.0,), None)
    assert parse_split("1,3/2,2") == SplitSpec((1.0, 3.0), (2.0, 2.0))


def test_parse_several_draft_models():
    s = parse_split("1,1/1/2,1")
    assert s == SplitSpec((1.0, 1.0), (1.0,), ((2.0, 1.0),))
    assert s.drafts == [(1.0,), (2.0, 1.0)]
    assert parse_split("1").drafts == []


@pytest.mark.parametrize("text, needle", [
    ("0.3,abc", '"abc" is not a number'),
    ("0.3,,0.7", "the weight of target stage 1 is empty"),  # stages count from 0, as everywhere else
    ("1,,1", "the weight of target stage 1 is empty"),      # stage 1, not "weight 2"
    ("0.3,0.7,", "the weight of target stage 2 is empty"),
    ("1,1/1,", "the weight of draft stage 1 is empty"),
    ("0.3,abc", 'target stage 1: "abc" is not a number'),
    ("0.5,0", 'target stage 1: weight "0"'),
    ("/1.0", "target weights are empty"),
    ("0.5,0.5/", "draft weights are empty"),
    ("0.5,0.5/1/", "draft 2 weights are empty"),
    ("0.5,0", 'weight "0"'),
    ("0.5,-1", 'weight "-1"'),
    ("nan,1", 'weight "nan"'),
    ("1/inf", 'weight "inf"'),
])
def test_parse_errors(text, needle):
    with pytest.raises(SplitError) as e:
        parse_split(text)
    msg = str(e.value)
    assert needle in msg
    assert "\n" not in msg
    assert isinstance(e.value, GGPipeError)


# ---- plan_layers ---------------------------------------------------------

def _check_cover(ranges, n_layer):
    assert ranges[0][0] == 0 and ranges[-1][1] == n_layer
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        assert b == c
    assert all(b > a for a, b in ranges)


def test_even_split_extra_layers_go_first():
    r = plan_layers(30, 4, None)
    assert [b - a for a, b in r] == [8, 8, 7, 7]
    assert r == [(0, 8), (8, 16), (16, 23), (23, 30)]


@pytest.mark.parametrize("n_layer", range(1, 40))
@pytest.mark.parametrize("n_stages", [1, 2, 3, 5, 8])
def test_even_split_cover(n_layer, n_stages):
    if n_stages > n_layer:
        return
    r = plan_layers(n_layer, n_stages, None)
    assert len(r) == n_stages
    _check_cover(r, n_layer)
    sizes = [b - a for a, b in r]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_single_stage():
    assert plan_layers(32, 1, None) == [(0, 32)]
    assert plan_layers(32, 1, [5.0]) == [(0, 32)]


def test_weighted_split_normalised():
    assert plan_layers(10, 2, [0.3, 0.7]) == [(0, 3), (3, 10)]
    assert plan_layers(10, 2, [3, 7]) == [(0, 3), (3, 10)]
    assert plan_layers(32, 2, [1, 3]) == [(0, 8), (8, 32)]


def test_weighted_rounding_is_half_up_on_cumsum():
    # boundaries 7.5, 15, 22.5 -> 8, 15, 23
    assert plan_layers(30, 4, [1, 1, 1, 1]) == [(0, 8), (8, 15), (15, 23), (23, 30)]
    # cumulative fraction 0.1+0.2 = 0.30000000000000004 -> 3 (not 2 via float error)
    r = plan_layers(10, 3, [0.1, 0.2, 0.7])
    assert r == [(0, 1), (1, 3), (3, 10)]
    # 0.25 * 10 = 2.5 rounds up to 3
    assert plan_layers(10, 2, [0.25, 0.75]) == [(0, 3), (3, 10)]


def test_weighted_cover_many():
    import random
    rnd = random.Random(0)
    for _ in range(300):
        n_stages = rnd.randint(1, 6)
        n_layer = rnd.randint(n_stages * 4, 80)
        w = [rnd.uniform(0.5, 2.0) for _ in range(n_stages)]
        r = plan_layers(n_layer, n_stages, w)
        _check_cover(r, n_layer)
        for (a, b), wi in zip(r, w):  # each stage within a layer of its share
            assert abs((b - a) - wi / sum(w) * n_layer) <= 1.0 + 1e-9


def test_wrong_weight_count():
    with pytest.raises(SplitError, match="--split has 3 weights but 2 ranks run the target model"):
        plan_layers(32, 2, [1, 1, 1])
    with pytest.raises(SplitError, match="1 rank runs the draft model"):
        plan_layers(32, 1, [1, 1], model="draft")


def test_more_stages_than_layers():
    with pytest.raises(SplitError, match="4 stages but the target model has only 3 layers"):
        plan_layers(3, 4, None)


def test_zero_stages():
    with pytest.raises(SplitError):
        plan_layers(3, 0, None)


def test_stage_with_zero_layers_is_named():
    with pytest.raises(SplitError) as e:
        plan_layers(10, 3, [1, 0.01, 1])
    msg = str(e.value)
    assert "stage 1" in msg and "weight 0.01" in msg and "fewer ranks" in msg


@pytest.mark.parametrize("w", [[1, 0], [1, -2], [1, float("nan")], [1, float("inf")]])
def test_bad_weights_in_plan(w):
    with pytest.raises(SplitError):
        plan_layers(10, 2, w)


# ---- describe_plan -------------------------------------------------------

def test_describe_plan():
    text = describe_plan([(0, 8), (8, 16), (16, 17)])
    lines = text.splitlines()
    assert lines[0].split() == ["stage", "layers", "count"]
    assert lines[1].split() == ["0", "0-7", "8"]
    assert lines[3].split() == ["2", "16", "1"]
    text = describe_plan([(0, 4), (4, 8)], labels=["rank 1", "rank 0"])
    assert text.splitlines()[2].split() == ["rank", "0", "4-7", "4"]


def test_huge_weights_are_ratios_not_an_overflow():
    # --split 1e308,1e308 raised OverflowError from the weights' sum
    assert plan_layers(40, 2, [1e308, 1e308]) == [(0, 20), (20, 40)]
    assert plan_layers(40, 2, [1e308, 3e307]) == plan_layers(40, 2, [10, 3])


# ---- roles (ggpipe.cluster.roles) ------------------------------------------------

def test_roles_of_several_draft_models():
    from ggpipe.cluster.roles import Roles

    r = Roles.plan(4, parse_split(None), True, n_draft_models=2)     # one rank each, the target gets the rest
    assert (r.n_target, r.n_draft, r.drafts) == (2, 2, (1, 1))
    assert [r.model_of(k) for k in range(4)] == ["target", "target", "draft", "draft2"]
    assert r.draft_ranks_of(1) == [3] and r.stage_of(3) == (0, 1)
    assert r.links(2)["prev"] == 0 and r.links(2)["next"] is None and r.links(3)["prev"] == 0
    r = Roles.plan(5, parse_split("1,1/1/1,1"), True, n_draft_models=2)
    assert r.drafts == (1, 2) and r.draft_ranks_of(1) == [3, 4]
    assert r.links(3) == {"prev": 0, "next": 4, "head": 0, "cancel_src": None, "cancel_fwd": None}
    assert r.links(4)["prev"] == 3 and r.links(4)["next"] is None and r.stage_of(4) == (1, 2)
    # one draft model: unchanged
    r = Roles.plan(3, parse_split("0.5,0.5/1.0"), True)
    assert (r.n_target, r.drafts, r.model_of(2), r.links(2)["prev"]) == (2, (1,), "draft", 0)
    assert Roles.plan(1, parse_split(None), True).drafts == (0,)


@pytest.mark.parametrize("size,split,k,needle", [
    (2, None, 2, "each draft model needs a rank of its own"),
    (4, "1,1/1", 2, "--split names 1 draft models"),
    (3, "1/1/1", 1, "but -md gives 1"),
    (5, "1,1/1/1", 2, "the job has 5"),
])
def test_roles_refuse_impossible_draft_layouts(size, split, k, needle):
    from ggpipe.cluster.roles import Roles

    with pytest.raises(GGPipeError) as e:
        Roles.plan(size, parse_split(split), True, n_draft_models=k)
    assert needle in str(e.value)


def test_concurrent_stages_counts_cpus_per_host():
    """How many micro-batches the scheduler keeps in flight: stages that can
    compute at once (3 ranks of 1 thread sharing a 2-CPU host: 2)."""
    from ggpipe.cluster.plan import concurrent_stages

    two_cpus = [0, 1]
    assert concurrent_stages(["a", "a", "a"], [two_cpus] * 3, [1, 1, 1]) == 2
    assert concurrent_stages(["a", "b", "c"], [two_cpus] * 3, [1, 1, 1]) == 3
    assert concurrent_stages(["a", "a"], [None, None], [1, 1]) == 2          # affinity unknown: every stage
    assert concurrent_stages(["a", "a"], [[0, 1, 2, 3]] * 2, [4, 4]) == 1    # each stage takes the whole host
    assert concurrent_stages(["a", "a", "b"], [[0, 1], [2, 3], [0]], [1, 1, 1]) == 3


def test_micro_batches_in_flight_fill_a_full_host():
    """The scheduler's default (--micro-batches auto): one per stage that can
    compute at once, also on a host whose CPUs the stages' threads fill
    (4 ranks x 4 threads on 16 CPUs: 4; docs/benchmarks/batching.md measured 4 beat 2 there,
    pinned or not); fewer where the CPUs hold fewer stages' threads."""
    from ggpipe.cluster.plan import concurrent_stages

    cpus16 = list(range(16))
    assert concurrent_stages(["a"] * 4, [cpus16] * 4, [4] * 4) == 4
    assert concurrent_stages(["a"] * 4, [[4 * r + c for c in range(4)] for r in range(4)], [4] * 4) == 4  # pinned
    assert concurrent_stages(["a"] * 4, [cpus16] * 4, [3] * 4) == 4
    assert concurrent_stages(["a"] * 4, [cpus16] * 4, [8] * 4) == 2
    assert concurrent_stages(["a"] * 3, [[0, 1]] * 3, [1] * 3) == 2
    assert concurrent_stages(["a", "a", "b", "b"], [cpus16] * 4, [4] * 4) == 4
    assert concurrent_stages(["a"] * 4, [None] * 4, [1] * 4) == 4
    assert concurrent_stages(["a", "a"], [[0, 1], [0, 1]], [2, 2]) == 1    # two stages taking turns with both CPUs


def test_waits_sleep_longer_where_the_ranks_oversubscribe_their_host():
    """Ranks sharing CPUs that their threads oversubscribe probe up to every
    POLL_OVERSUBSCRIBED_S (a wake-up there takes a computing stage's core);
    with threads = CPUs, ranks pinned to CPUs of their own, one rank per
    host, or spare CPUs, a waiting rank's own cores are idle and the
    transport's 100 us stays."""
    from ggpipe.cluster.resources import POLL_OVERSUBSCRIBED_S, host_is_oversubscribed as over

    assert POLL_OVERSUBSCRIBED_S == 1e-3
    two, four = [0, 1], [0, 1, 2, 3]
    assert over(["a"] * 3, 2, [1, 1, 1], [two] * 3)
    assert over(["a", "a"], 1, [2, 2], [two] * 2)
    assert over(["a", "a"], 1, [1000, 1], [two] * 2)                        # -t counted at most the CPUs
    assert not over(["a", "a"], 0, [1, 1], [two] * 2)                      # a stage per core
    assert not over(["a", "a"], 0, [1, 1], [four] * 2)
    assert not over(["a", "b"], 0, [16, 16], [list(range(16))] * 2)        # one rank per host
    assert not over(["a", "b", "b"], 0, [8, 8, 8], [list(range(8))] * 3)   # its host holds only it
    assert over(["a", "b", "b"], 2, [8, 8, 8], [list(range(8))] * 3)
    assert not over(["a", "a"], 0, [1, 1], [[0], [1]])                     # pinned: -bind-to core
    assert not over(["a", "a"], 1, [8, 8], [list(range(8)), list(range(8, 16))])   # a NUMA domain each
    assert not over(["a"] * 3, 0, [1, 1, 1], [two, two, [2, 3]])           # shares {0, 1} with one rank
    assert over(["a"] * 3, 0, [2, 1, 1], [two, two, [2, 3]])
    assert over(["a"] * 3, 0, [1, 1, 1], [None] * 3, own_cpus=2)           # affinity unknown
    assert not over(["a"] * 3, 0, [1, 1, 1], [None] * 3, own_cpus=4)


def test_plan_layers_names_a_bad_weight_by_its_stage():
    """Stages count from 0 in every --split message (never 'weight 2')."""
    with pytest.raises(SplitError, match=r"draft stage 1's weight \(0.0\) must be a positive finite number"):
        plan_layers(30, 2, [1.0, 0.0], model="draft")


# -- the default split of models whose blocks differ in size --------------------


def _max_stage(layer_bytes, ranges):
    return max(sum(layer_bytes[a:b]) for a, b in ranges)


def test_uniform_blocks_keep_the_even_split():
    assert plan_layers(30, 4, None, layer_bytes=[100] * 30) == plan_layers(30, 4, None)
    assert plan_layers(30, 4, None, layer_bytes=[100, 101] * 15) == plan_layers(30, 4, None)  # within 2%


def test_moe_with_a_leading_dense_block_balances_bytes():
    """DeepSeek/GLM: a small dense block before the expert blocks; the even
    split would leave the first rank lighter by most of a block."""
    sizes = [10] + [80] * 7
    ranges = plan_layers(8, 2, None, layer_bytes=sizes)
    assert ranges == [(0, 4), (4, 8)] and _max_stage(sizes, ranges) == 320
    sizes = [10, 10, 10] + [90] * 9
    ranges = plan_layers(12, 3, None, layer_bytes=sizes)
    assert _max_stage(sizes, ranges) < _max_stage(sizes, plan_layers(12, 3, None))


@pytest.mark.parametrize("with_head", [False, True])
def test_balance_bytes_is_optimal_and_covers_every_block(with_head):
    """Against every contiguous partition (brute force, small cases); with a
    head, its bytes added to the last stage."""
    from itertools import combinations

    from ggpipe.cluster.split import balance_bytes

    rng = np.random.default_rng(2 if with_head else 1)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        k = int(rng.integers(1, n + 1))
        sizes = [int(x) for x in rng.integers(1, 50, n)]
        head = int(rng.integers(0, 120)) if with_head else 0
        ranges = balance_bytes(sizes, k, head)
        assert len(ranges) == k and ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(k - 1))
        glued = sizes[:-1] + [sizes[-1] + head]
        best = min(_max_stage(glued, list(zip((0, *cut), (*cut, n)))) for cut in combinations(range(1, n), k - 1))
        assert _max_stage(glued, ranges) == best


def test_repair_ranges_moves_boundaries_off_refused_stages():
    """The default split of a hybrid model (A attention, R recurrent blocks):
    every stage needs both; the nearest split that has them, else unchanged."""
    from ggpipe.cluster.split import repair_ranges

    def valid(kinds):
        return lambda a, b: {"A", "R"} <= set(kinds[a:b])

    assert repair_ranges([(0, 1), (1, 8)], valid("ARARARAR")) == [(0, 2), (2, 8)]
    assert repair_ranges([(0, 3), (3, 6), (6, 8)], valid("ARARARAR")) == [(0, 3), (3, 6), (6, 8)]
    assert repair_ranges([(0, 5), (5, 6), (6, 8)], valid("ARARARAR")) == [(0, 4), (4, 6), (6, 8)]
    every4 = "RRRA" * 4
    assert repair_ranges([(0, 3), (3, 10), (10, 16)], valid(every4)) == [(0, 4), (4, 10), (10, 16)]
    impossible = [(2 * i, 2 * i + 2) for i in range(8)]  # 8 stages, 4 attention blocks
    assert repair_ranges(impossible, valid(every4)) == impossible


def test_split_prompts_balances_the_blocks_without_the_head():
    """``--split prompts``: the default split without the LM head (a prompt's
    tokens go through every block, only its last through the head), with
    draft weights after ``/`` as usual."""
    assert parse_split("prompts") == SplitSpec(None, None, head=False)
    assert parse_split(" prompts /1") == SplitSpec(None, (1.0,), head=False)
    assert parse_split("1,1").head and parse_split(None).head
    uniform = type("S", (), {"layer_bytes": [2_216_448] * 30, "head_bytes": 30_083_328, "path": "/nonexistent"})()
    assert layer_ranges(uniform, 30, 2, None) == [(0, 22), (22, 30)]
    assert layer_ranges(uniform, 30, 2, None, head=False) == [(0, 15), (15, 30)]
    moe = type("S", (), {"layer_bytes": [10] + [40] * 7, "head_bytes": 100, "path": "/nonexistent"})()
    assert layer_ranges(moe, 8, 2, None) == [(0, 6), (6, 8)]
    assert layer_ranges(moe, 8, 2, None, head=False) == [(0, 4), (4, 8)]   # still byte-balanced blocks


def test_the_lm_head_counts_on_the_last_stage():
    """The default split counts the output head's bytes on the last stage
    (docs/clusters/planning.md, The default split): the F32 goliath (40 blocks of 14.16 MB, a
    113.2 MB tied head) splits 24/16 on 2 stages, SmolLM2-135M Q4_1 (2.2 MB
    blocks, a 30 MB Q8_0 head) 22/8; a head under half a block leaves the
    even split."""
    assert plan_layers(40, 2, None, layer_bytes=[14_160_384] * 40, head_bytes=113_248_512) == [(0, 24), (24, 40)]
    assert plan_layers(30, 2, None, layer_bytes=[2_216_448] * 30, head_bytes=30_083_328) == [(0, 22), (22, 30)]
    assert plan_layers(30, 4, None, layer_bytes=[100] * 30, head_bytes=49) == plan_layers(30, 4, None)
    assert plan_layers(30, 2, (1, 1), layer_bytes=[100] * 30, head_bytes=10_000) == [(0, 15), (15, 30)]  # given: kept


def test_a_workload_is_mostly_prompts_from_its_share_of_tokens_on():
    assert prompts_dominate(8000, 512)            # 8 long prompts, 64 tokens each: 94%
    assert not prompts_dominate(13 * 8, 128 * 8)  # short prompts, long answers
    assert prompts_dominate(900, 100) and PROMPT_SHARE == 0.9
    assert not prompts_dominate(899, 101)
    assert not prompts_dominate(0, 0) and not prompts_dominate(0, 10) and prompts_dominate(10, 0)
