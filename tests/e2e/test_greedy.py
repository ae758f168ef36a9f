"""The comparison every e2e answer goes through (``_greedy``, ``_forced``, ``_ties``), on
made-up replies and a made-up teacher-forced reference: no stack. Each test counts its near-ties
in a tally of its own, so that the session's budget sees only real answers."""

from __future__ import annotations

from typing import Any

import pytest

from ._greedy import (
    TIE,
    NearTie,
    assert_same_choice,
    assert_same_ids,
    assert_same_text,
)
from ._ties import Tally

PROMPT = [100, 101, 102]
# Token ids of the made-up vocabulary.
IDS = {" Make": 1, " Res": 2, " file": 3, " way": 4, " Response": 5, " Take": 6, " plan": 7,
       " any": 8, "thing": 9, " Other": 10}


def _chat(tokens: list[tuple[str, float, str, float]]) -> dict[str, Any]:
    """A chat reply whose tokens are (token, logprob, second choice, its logprob), with the
    token ids that ``chat_logprobs()`` asks for."""
    return {"prompt_token_ids": PROMPT,
            "choices": [{"message": {"content": "".join(t for t, _, _, _ in tokens)},
                         "token_ids": [IDS[t] for t, _, _, _ in tokens],
                         "logprobs": {"content": [
                             {"token": t, "logprob": lp,
                              "top_logprobs": [{"token": t, "logprob": lp},
                                               {"token": s, "logprob": slp}]}
                             for t, lp, s, slp in tokens]}}]}


REFERENCE = _chat([(" Make", -0.5, " Take", -1.5), (" Res", -0.2, " Response", -0.20004),
                   (" file", -0.1, " plan", -2.0), (" Res", -0.3, " way", -0.9)])
PARTED = [IDS[t] for t in (" Make", " Response", " any", "thing")]  # parts at token 1


class Forced:
    """A made-up reference scored teacher-forced: one row per answer token from the parting
    on, {token id: logprob}; checks that it is asked about the prompt plus the answer."""

    def __init__(self, answer: list[int], parted: int, rows: list[dict[int, float]]) -> None:
        self.want = (PROMPT + answer, len(PROMPT) + parted)
        self.rows = rows
        self.calls = 0

    def __call__(self, ids: list[int], first: int) -> list[dict[int, float]]:
        assert (ids, first) == self.want
        self.calls += 1
        return self.rows


def _greedy_rest(lp: float = -0.3) -> Forced:
    """After the parting at token 1, every answer token is the reference's best."""
    return Forced(PARTED, 1, [{5: -0.20001, 2: -0.19999}, {8: lp, 3: -1.0},
                              {9: -0.1, 4: -2.0}])


def test_an_equal_answer_passes_and_needs_no_scoring() -> None:
    tally = Tally()
    assert_same_text(" Make Res file Res", REFERENCE, tally=tally)
    assert tally.ties == []


def test_a_parting_at_a_near_tie_followed_by_greedy_tokens_passes_and_counts_one() -> None:
    tally, forced = Tally(), _greedy_rest()
    with pytest.warns(NearTie, match="token 1"):
        assert_same_text(" Make Response anything", REFERENCE, PARTED, score=forced,
                         tally=tally)
    assert forced.calls == 1
    assert [(t.position, t.took) for t in tally.ties] == [(1, "' Response'")]


def test_a_parting_at_a_near_tie_followed_by_a_non_greedy_token_fails() -> None:
    # main's comparison stopped at the near-tie and passed this answer.
    forced = Forced(PARTED, 1, [{5: -0.20001, 2: -0.19999}, {8: -0.3, 3: -1.0},
                                {9: -0.9, 4: -0.2}])  # "thing" is 0.7 behind " way"
    with pytest.warns(NearTie), pytest.raises(AssertionError, match="answer token 3"):
        assert_same_text(" Make Response anything", REFERENCE, PARTED, score=forced,
                         tally=Tally())


def test_a_later_near_tie_after_the_parting_passes_and_counts_too() -> None:
    tally = Tally()
    forced = Forced(PARTED, 1, [{5: -0.20001, 2: -0.19999}, {8: -0.30003, 3: -0.3},
                                {9: -0.1, 4: -2.0}])
    with pytest.warns(NearTie):
        assert_same_text(" Make Response anything", REFERENCE, PARTED, score=forced,
                         tally=tally)
    assert [t.position for t in tally.ties] == [1, 2]


def test_a_parting_cannot_be_certified_without_the_answer_s_ids() -> None:
    with pytest.warns(NearTie), pytest.raises(AssertionError, match="needs the answer's token"):
        assert_same_text(" Make Response anything", REFERENCE, score=_greedy_rest(),
                         tally=Tally())


def test_text_and_ids_must_part_at_the_same_token() -> None:
    with pytest.warns(NearTie), pytest.raises(AssertionError, match="token ids at 0"):
        assert_same_text(" Make Response anything", REFERENCE, [6, *PARTED[1:]],
                         score=_greedy_rest(), tally=Tally())


def test_an_answer_parting_where_the_reference_was_sure_fails() -> None:
    with pytest.raises(AssertionError, match="token 0"):
        assert_same_text(" Take Res file Res", REFERENCE, tally=Tally())
    with pytest.raises(AssertionError, match="token 2"):
        assert_same_text(" Make Res plan Res", REFERENCE, tally=Tally())


def test_a_near_tie_counts_only_for_the_reference_s_second_choice() -> None:
    with pytest.raises(AssertionError, match="token 1"):
        assert_same_text(" Make Other file Res", REFERENCE, tally=Tally())


def test_an_answer_longer_or_shorter_than_the_reference_fails() -> None:
    with pytest.raises(AssertionError):
        assert_same_text(" Make Res file Res way", REFERENCE, tally=Tally())
    with pytest.raises(AssertionError):
        assert_same_text(" Make Res file", REFERENCE, tally=Tally())


def test_a_reference_without_logprobs_must_be_equal() -> None:
    with pytest.raises(AssertionError, match="no logprobs"):
        assert_same_text(" Make Response", {"choices": [{"message": {"content": " Make Res"}}]})


def test_logprobs_must_agree_to_rounding() -> None:
    got = [(" Make", -0.50001), (" Res", -0.2), (" file", -0.1), (" Res", -0.3)]
    assert_same_text(" Make Res file Res", REFERENCE, logprobs=got, tally=Tally())
    with pytest.raises(AssertionError, match="more than rounding"):
        assert_same_text(" Make Res file Res", REFERENCE, logprobs=[(" Make", -0.51), *got[1:]],
                         tally=Tally())
    with pytest.raises(AssertionError, match="lengths"):
        assert_same_text(" Make Res file Res", REFERENCE, logprobs=got[:3], tally=Tally())


def test_past_a_parting_logprobs_must_agree_with_the_teacher_forced_reference() -> None:
    parted = [(" Make", -0.5), (" Response", -0.20001), (" any", -0.3), ("thing", -0.1)]
    with pytest.warns(NearTie):
        assert_same_text(" Make Response anything", REFERENCE, PARTED, parted,
                         score=_greedy_rest(), tally=Tally())
    # Greedy tokens still, but the logprob of " any" moved: a wrong block looks like this.
    with pytest.warns(NearTie), pytest.raises(AssertionError, match="teacher-forced"):
        assert_same_text(" Make Response anything", REFERENCE, PARTED, parted,
                         score=_greedy_rest(lp=-0.3 + 10 * TIE), tally=Tally())


def _completion(ids: list[int], tops: list[dict[int, float]]) -> dict[str, Any]:
    return {"token_ids": ids, "prompt_token_ids": PROMPT, "logprobs": {
        "token_logprobs": [top[token] for token, top in zip(ids, tops, strict=True)],
        "top_logprobs": [{f"token_id:{t}": lp for t, lp in top.items()} for top in tops]}}


ID_REFERENCE = _completion([5, 7, 9], [{5: -0.1, 6: -3.0}, {7: -0.7, 8: -0.70001},
                                       {9: -0.2, 1: -2.0}])


def test_token_ids_part_only_at_a_near_tie() -> None:
    tally = Tally()
    assert_same_ids([5, 7, 9], ID_REFERENCE, tally=tally)
    with pytest.raises(AssertionError, match="token 0"):
        assert_same_ids([6, 7, 9], ID_REFERENCE, tally=tally)
    with pytest.raises(AssertionError, match="lengths"):
        assert_same_ids([5, 7], ID_REFERENCE, tally=tally)
    assert tally.ties == []


def test_token_ids_past_a_parting_are_certified_teacher_forced() -> None:
    tally = Tally()
    greedy = Forced([5, 8, 3], 1, [{8: -0.70002, 7: -0.69999}, {3: -0.4, 9: -1.0}])
    with pytest.warns(NearTie):
        assert_same_ids([5, 8, 3], ID_REFERENCE, score=greedy, tally=tally)
    assert len(tally.ties) == 1
    wrong = Forced([5, 8, 3], 1, [{8: -0.70002, 7: -0.69999}, {3: -1.0, 9: -0.4}])
    with pytest.warns(NearTie), pytest.raises(AssertionError, match="answer token 2"):
        assert_same_ids([5, 8, 3], ID_REFERENCE, score=wrong, tally=tally)


def test_a_completion_choice_compares_logprobs_too() -> None:
    same = {"token_ids": [5, 7, 9], "logprobs": {"token_logprobs": [-0.10001, -0.7, -0.2]}}
    assert assert_same_choice(same, ID_REFERENCE, tally=Tally()) == pytest.approx(1e-5)
    moved = {"token_ids": [5, 7, 9], "logprobs": {"token_logprobs": [-0.1, -0.71, -0.2]}}
    with pytest.raises(AssertionError, match="token 1 has logprob"):
        assert_same_choice(moved, ID_REFERENCE, tally=Tally())
    with pytest.raises(AssertionError, match="no logprobs"):
        assert_same_choice({"token_ids": [5, 7, 9]}, ID_REFERENCE, tally=Tally())
    parted = {"token_ids": [5, 8, 3], "logprobs": {"token_logprobs": [-0.1, -0.70001, -0.4]}}
    greedy = Forced([5, 8, 3], 1, [{8: -0.70002, 7: -0.69999}, {3: -0.4, 9: -1.0}])
    with pytest.warns(NearTie):
        assert_same_choice(parted, ID_REFERENCE, score=greedy, tally=Tally())


def test_the_session_fails_past_its_near_tie_budget() -> None:
    """An e2e session may take at most ``_ties.BUDGET`` (3) near-ties; conftest fails it with
    this verdict past that."""
    tally = Tally()
    with pytest.warns(NearTie):
        for position in range(3):
            tally.record(position, 1e-5, "a", "b")
    assert tally.verdict(budget=3) is None
    with pytest.warns(NearTie):
        tally.record(9, 2e-5, "a", "b")
    verdict = tally.verdict(budget=3)
    assert verdict is not None and "4 near-ties" in verdict and "token 9" in verdict
