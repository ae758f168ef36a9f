"""Near-ties: what one is, and how many a test session may see.

A near-tie is a position where the reference's best token and the token an answer took are
within ``TIE`` of each other (``_greedy`` explains the margin). Each one is a place where a
comparison had to accept a different token, so a session counts them (``TALLY``) and
``tests/e2e/conftest.py`` fails the run when there are more than ``BUDGET``: rounding makes a
near-tie rare (the reference's top two fall within 1e-4 about once in 10,000 tokens,
docs/cpu-stack.md), and a run that sees many says that something moves logits more than
rounding does, however each answer looked on its own.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass

TIE = 1e-4  # six times the largest rounding difference measured between two paths
# Near-ties one e2e session may see. The whole suite compares some 40,000 answer tokens; at the
# measured rate that is a handful of reference near-ties, about half of which an answer takes.
BUDGET = 3


class NearTie(UserWarning):
    """An answer took a token at a near-tie of the reference (shown in pytest's summary)."""


@dataclass(frozen=True)
class Tie:
    where: str  # the test that saw it
    position: int  # of the answer token
    gap: float  # the reference's best logprob less that of the token the answer took
    best: str
    took: str

    def __str__(self) -> str:
        return (f"{self.where}: token {self.position}, {self.best} vs {self.took}, "
                f"{self.gap:.1e} apart")


class Tally:
    """The near-ties of one session (answers are compared from several threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ties: list[Tie] = []

    def record(self, position: int, gap: float, best: str, took: str) -> Tie:
        where = os.environ.get("PYTEST_CURRENT_TEST", "?").removesuffix(" (call)")
        tie = Tie(where, position, gap, best, took)
        with self._lock:
            self._ties.append(tie)
        warnings.warn(NearTie(f"took a near-tie: {tie}"), stacklevel=3)
        return tie

    @property
    def ties(self) -> list[Tie]:
        with self._lock:
            return list(self._ties)

    def verdict(self, budget: int = BUDGET) -> str | None:
        """Why the session fails (more near-ties than ``budget``), or None."""
        ties = self.ties
        if len(ties) <= budget:
            return None
        listed = "\n  ".join(str(tie) for tie in ties)
        return (f"{len(ties)} near-ties in this session, more than the budget of {budget} "
                f"(tests/e2e/_ties.py):\n  {listed}")


TALLY = Tally()
