"""The prompt's chunks down the pipeline (ggpipe.pipeline.prefill)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ggpipe.pipeline.prefill import CHUNKS_PER_STAGE, MIN_CHUNK, prefill_chunks


def test_one_stage_decodes_as_llama_cpp_does():
    assert prefill_chunks(1200, 512, 1) == [512, 512, 176]
    assert prefill_chunks(5, 512, 1) == [5]


def test_a_long_prompt_on_two_stages_goes_in_even_chunks_that_keep_both_busy():
    chunks = prefill_chunks(1700, 512, 2)
    assert len(chunks) == min(1700 // MIN_CHUNK, CHUNKS_PER_STAGE * 2) > 4
    assert max(chunks) - min(chunks) <= 1 and sum(chunks) == 1700
    assert len(prefill_chunks(10_000, 512, 2)) == CHUNKS_PER_STAGE * 2


def test_a_short_prompt_is_not_cut_below_the_smallest_chunk():
    assert prefill_chunks(100, 512, 4) == [100]
    assert prefill_chunks(130, 512, 4) == [65, 65]


@given(st.integers(0, 20_000), st.integers(1, 2048), st.integers(1, 16))
def test_chunks_cover_the_prompt_within_the_ubatch_and_evenly(n, n_ubatch, n_stages):
    chunks = prefill_chunks(n, n_ubatch, n_stages)
    assert sum(chunks) == n and all(0 < c <= n_ubatch for c in chunks)
    if n_stages > 1 and chunks:
        assert max(chunks) - min(chunks) <= 1
        assert len(chunks) == 1 or min(chunks) >= min(MIN_CHUNK, -(-n // len(chunks)) - 1)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        prefill_chunks(10, 0, 2)
