"""The comparison every e2e answer goes through (``_greedy``), on made-up replies: no stack."""

from __future__ import annotations

from typing import Any

import pytest

from ._greedy import NearTie, assert_same_ids, assert_same_logprobs, assert_same_text


def _chat(tokens: list[tuple[str, float, str, float]]) -> dict[str, Any]:
    """A chat reply whose tokens are (token, logprob, second choice, its logprob)."""
    return {"choices": [{"message": {"content": "".join(t for t, _, _, _ in tokens)},
                         "logprobs": {"content": [
                             {"token": t, "logprob": lp,
                              "top_logprobs": [{"token": t, "logprob": lp},
                                               {"token": s, "logprob": slp}]}
                             for t, lp, s, slp in tokens]}}]}


REFERENCE = _chat([(" Make", -0.5, " Take", -1.5), (" Res", -0.2, " Response", -0.20004),
                   (" file", -0.1, " plan", -2.0), (" Res", -0.3, " way", -0.9)])


def test_an_equal_answer_passes() -> None:
    assert_same_text(" Make Res file Res", REFERENCE)


def test_an_answer_may_part_at_a_near_tie_and_says_so() -> None:
    with pytest.warns(NearTie, match="token 1"):
        assert_same_text(" Make Response anything after", REFERENCE)


def test_an_answer_parting_where_the_reference_was_sure_fails() -> None:
    with pytest.raises(AssertionError, match="token 0"):
        assert_same_text(" Take Res file Res", REFERENCE)
    with pytest.raises(AssertionError, match="token 2"):
        assert_same_text(" Make Res plan Res", REFERENCE)


def test_a_near_tie_counts_only_for_the_reference_s_second_choice() -> None:
    with pytest.raises(AssertionError, match="token 1"):
        assert_same_text(" Make Other file Res", REFERENCE)


def test_an_answer_longer_or_shorter_than_the_reference_fails() -> None:
    with pytest.raises(AssertionError):
        assert_same_text(" Make Res file Res way", REFERENCE)
    with pytest.raises(AssertionError):
        assert_same_text(" Make Res file", REFERENCE)


def test_a_reference_without_logprobs_must_be_equal() -> None:
    with pytest.raises(AssertionError, match="no logprobs"):
        assert_same_text(" Make Response", {"choices": [{"message": {"content": " Make Res"}}]})


def _completion(ids: list[int], tops: list[dict[int, float]]) -> dict[str, Any]:
    return {"token_ids": ids, "logprobs": {"top_logprobs": [
        {f"token_id:{t}": lp for t, lp in top.items()} for top in tops]}}


def test_token_ids_part_only_at_a_near_tie() -> None:
    reference = _completion([5, 7, 9], [{5: -0.1, 6: -3.0}, {7: -0.7, 8: -0.70001},
                                        {9: -0.2, 1: -2.0}])
    assert_same_ids([5, 7, 9], reference)
    with pytest.warns(NearTie):
        assert_same_ids([5, 8, 3], reference)
    with pytest.raises(AssertionError, match="token 0"):
        assert_same_ids([6, 7, 9], reference)
    with pytest.raises(AssertionError, match="lengths"):
        assert_same_ids([5, 7], reference)


def test_logprobs_must_agree_to_rounding() -> None:
    got = [(" Make", -0.50001), (" Res", -0.2), (" file", -0.1), (" Res", -0.3)]
    assert assert_same_logprobs(got, REFERENCE) == pytest.approx(1e-5)
    with pytest.raises(AssertionError, match="more than rounding"):
        assert_same_logprobs([(" Make", -0.51), *got[1:]], REFERENCE)
    with pytest.warns(NearTie):
        assert_same_logprobs([got[0], (" Response", -0.2)], REFERENCE)
