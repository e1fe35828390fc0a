"""reusable_prefix: how much of a KV cache a new request (or the draft's next
context) can keep — shared by the engine's prefix reuse and the proposer."""

from ggpipe.kv_reuse import reusable_prefix


def test_common_prefix_and_the_last_token_is_decoded_again():
    assert reusable_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert reusable_prefix([1, 2, 3], [1, 2, 3]) == 2          # logits of 3 are needed: decode it again
    assert reusable_prefix([1, 2, 3], [1, 2, 3], need_logits=False) == 3
    assert reusable_prefix([1, 2], [1, 2, 3, 4]) == 2
    assert reusable_prefix([], [5]) == 0
    assert reusable_prefix([7], [5, 6]) == 0


def test_a_state_that_cannot_be_cut_is_kept_whole_or_not_at_all():
    """partial=False (recurrent and hybrid models): all of the cache where the
    tokens go on after it, else nothing."""
    assert reusable_prefix([1, 2], [1, 2, 3, 4], partial=False) == 2            # the next turn: keep it all
    assert reusable_prefix([1, 2, 3, 4], [1, 2, 9], partial=False) == 0         # a cut at 2: refused, start over
    assert reusable_prefix([1, 2, 3], [1, 2, 3], partial=False) == 0            # the last token's logits: a cut
    assert reusable_prefix([1, 2, 3], [1, 2, 3], need_logits=False, partial=False) == 3
    assert reusable_prefix([], [5], partial=False) == 0
