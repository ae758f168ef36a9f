"""The rest of an answer after a near-tie, scored teacher-forced under the reference.

Once an answer took the reference's second choice at a near-tie, the two go on from different
histories and their tokens are no longer comparable position by position. What is still
comparable is each later token against the reference *given the answer's own history*: the
plain reference instance reads the prompt plus the whole answer as one prompt and reports, at
every position, the logprob of the answer's token and of its own best one (vLLM's
``prompt_logprobs``). An answer built from the right KV is the reference's greedy choice at
every one of them, within the same ``TIE``; a wrong block shows as a token the reference would
not have picked, or (``_greedy``, with the answer's logprobs) as a logprob that moved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvturn_server.local._http import post_json

from ._ties import TALLY, TIE, Tally

# (token ids, first position wanted) -> one row per position from there on: the logprobs of
# that position's token and of the reference's best ones, by token id.
Scorer = Callable[[list[int], int], list[dict[int, float]]]


class ReferenceScorer:
    """Teacher-forced logprobs from a plain vLLM instance's ``/v1/completions``."""

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url, self.model = base_url, model

    def __call__(self, ids: list[int], first: int) -> list[dict[int, float]]:
        # One token generated (the API needs one); prompt_logprobs=1 gives each position's
        # own token and the best one. vLLM skips its prefix cache for such requests, so every
        # row is computed afresh.
        reply: dict[str, Any] = post_json(f"{self.base_url}/v1/completions", {
            "model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": 1})
        rows = reply["choices"][0]["prompt_logprobs"]
        return [{int(token): entry["logprob"] for token, entry in row.items()}
                for row in rows[first:]]


_session: list[Scorer] = []


def use_reference(scorer: Scorer) -> None:
    """The scorer of this session's reference instance (set by the stack fixture)."""
    _session[:] = [scorer]


@contextmanager
def scoring_with(scorer: Scorer) -> Iterator[None]:
    """Score with ``scorer`` meanwhile (tests with a stack and reference of their own), then
    with the session's again."""
    previous = list(_session)
    _session[:] = [scorer]
    try:
        yield
    finally:
        _session[:] = previous


def session_scorer() -> Scorer:
    if not _session:
        raise AssertionError("an answer parted at a near-tie and no reference instance is set "
                             "to score the rest (tests/e2e/conftest.py: use_reference)")
    return _session[0]


def certify_rest(prompt: list[int], answer: list[int], parted: int,
                 score: Scorer | None = None, tally: Tally | None = None) -> list[float]:
    """Every token of ``answer`` from ``parted`` (the near-tie it parted at, already counted)
    on is the reference's greedy choice within ``TIE``, teacher-forced on the answer before
    it; a later token that is a near-tie itself is counted too. Returns the reference's
    logprobs of ``answer[parted:]``."""
    rows = (score or session_scorer())(prompt + answer, len(prompt) + parted)
    if len(rows) != len(answer) - parted:
        raise AssertionError(f"the reference scored {len(rows)} tokens of the answer's "
                             f"{len(answer) - parted} after its near-tie")
    logprobs = []
    for offset, row in enumerate(rows):
        position, token = parted + offset, answer[parted + offset]
        if token not in row:
            raise AssertionError(f"the reference's row for answer token {position} lacks the "
                                 f"token ({token}): {row}")
        best, best_lp = max(row.items(), key=lambda item: item[1])
        gap = best_lp - row[token]
        if gap > TIE:
            raise AssertionError(
                f"after the near-tie at token {parted}, answer token {position} ({token}) is not "
                f"the reference's greedy choice: teacher-forced on the answer so far, the "
                f"reference gives it {row[token]:.6f} and its best ({best}) {best_lp:.6f}, "
                f"{gap:.2e} behind (a near-tie needs {TIE:g})")
        if offset and best != token:
            (tally or TALLY).record(position, gap, str(best), str(token))
        logprobs.append(row[token])
    return logprobs
