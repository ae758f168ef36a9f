"""Comparing a greedy answer with the plain reference run, token for token, to the last token.

Two vLLM execution paths of one prompt round differently in float32: measured on the tiny model,
a plain disaggregated turn without any reuse and the single reference instance give chosen-token
logprobs that differ by 2e-6 on average and up to 1.6e-5 (``docs/cpu-stack.md``). Where the
reference's best two tokens are closer than that, either path may pick either one, with or
without reuse. So an answer must equal the reference, except that it may part from it at a
*near-tie*: a position where the reference's top two logprobs are within ``TIE`` and the answer
took the reference's second choice. Everything before that position is equal. Everything after
it is certified too (``_forced``): the reference, teacher-forced on the answer's own tokens,
must find each of them its greedy choice within ``TIE``, and where the answer's logprobs are
given they must equal the teacher-forced ones within ``TIE``. A wrong KV (the bug these tests
look for) moves logits by far more than ``TIE`` (measured: one word changed 400 tokens back
moves the first token's logprob by 2e-3 to 0.27) and fails wherever it shows, before a near-tie
or after one. Each near-tie taken is counted for the session (``_ties``: at most ``BUDGET``).

Certifying what follows a parting needs token ids: references are asked for them
(``chat_logprobs`` / ``completion_logprobs``), and answers pass theirs as ``ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._forced import Scorer, certify_rest
from ._ties import BUDGET, TALLY, TIE, NearTie, Tally

__all__ = ["BUDGET", "TIE", "TOP", "NearTie", "assert_same_choice", "assert_same_ids",
           "assert_same_reply", "assert_same_text", "chat_logprobs", "completion_logprobs"]

TOP = 2  # the reference's alternatives asked for at each position


def chat_logprobs() -> dict[str, Any]:
    """Request fields that make a chat reply comparable with ``assert_same_text`` (as the
    reference, and as the answer: its ``token_ids`` are the ``ids`` to pass)."""
    return {"logprobs": True, "top_logprobs": TOP, "return_token_ids": True}


def completion_logprobs() -> dict[str, Any]:
    """Request fields that make a completion choice comparable with ``assert_same_ids`` and
    ``assert_same_choice`` (as the reference, and as the answer)."""
    return {"logprobs": TOP, "return_tokens_as_token_ids": True, "return_token_ids": True}


def _is_boundary(text: str, end: int, token: str) -> bool:
    # Words are whole tokens here: " Res" matching the start of " Response" is no match.
    return not (token[-1:].isalnum() and text[end:end + 1].isalnum())


def _certify(position: int, top: list[tuple[str, float]], took: str, tally: Tally) -> None:
    (best, best_lp), (second, second_lp) = top[0], top[1]
    gap = best_lp - second_lp
    if gap > TIE or took != second:
        raise AssertionError(
            f"the answer parts from the reference at token {position}: the reference chose "
            f"{best!r} ({best_lp:.6f}), its second choice {second!r} ({second_lp:.6f}) is "
            f"{gap:.2e} behind (a near-tie needs {TIE:g}); the answer went on with {took!r}")
    tally.record(position, gap, repr(best), repr(second))


def _rest(parted: int, ids: Sequence[int] | None, expected: Sequence[int] | None,
          prompt: Sequence[int] | None, score: Scorer | None, tally: Tally) -> list[float]:
    """The answer's tokens from its near-tie parting on, certified (``_forced``)."""
    if ids is None:
        raise AssertionError(f"the answer parted from the reference at a near-tie at token "
                             f"{parted}; certifying the rest needs the answer's token ids "
                             f"(ask for return_token_ids and pass them as ids)")
    if expected is None or prompt is None:
        raise AssertionError("certifying an answer past a near-tie needs the reference's "
                             "prompt and output token ids (ask for return_token_ids)")
    first = next((i for i, (a, b) in enumerate(zip(ids, expected, strict=False)) if a != b),
                 min(len(ids), len(expected)))
    if first != parted:
        raise AssertionError(f"the answer's text parts from the reference at token {parted}, "
                             f"its token ids at {first}")
    return certify_rest(list(prompt), list(ids), parted, score, tally)


def _text_parting(got: str, entries: list[dict[str, Any]]) -> tuple[int, list[Any], str]:
    """Where ``got`` leaves the reference's tokens: (position, its top two, what got took)."""
    offset = 0
    for position, entry in enumerate(entries):
        token: str = entry["token"]
        end = offset + len(token)
        if got.startswith(token, offset) and _is_boundary(got, end, token):
            offset = end
            continue
        top = [(t["token"], t["logprob"]) for t in entry["top_logprobs"][:TOP]]
        took = next((t for t, _ in top[1:] if got.startswith(t, offset)
                     and _is_boundary(got, offset + len(t), t)), got[offset:offset + 20])
        return position, top, took
    raise AssertionError("the answer goes on past the reference")


def assert_same_text(got: str, reference: dict[str, Any], ids: Sequence[int] | None = None,
                     logprobs: Sequence[tuple[str, float]] | None = None, *,
                     score: Scorer | None = None, tally: Tally = TALLY) -> None:
    """``got`` is the reference chat reply's content, or parts from it at a near-tie and is
    the reference's greedy choice, teacher-forced, at every token after it. ``reference`` is
    the whole reply of a request made with ``chat_logprobs()``; ``ids`` are the answer's
    token ids (needed only past a parting); ``logprobs``, the answer's (token, logprob)
    pairs, must equal the reference's within ``TIE`` (teacher-forced past a parting): a
    wrong block shows there even where no token changes."""
    choice = reference["choices"][0]
    expected = choice["message"]["content"] or ""
    entries = (choice.get("logprobs") or {}).get("content") or []
    parted: int | None = None
    forced: list[float] = []
    if got != expected:
        if not entries:
            raise AssertionError(f"answers differ and the reference has no logprobs:\n  got "
                                 f"{got!r}\n  reference {expected!r}")
        try:
            parted, top, took = _text_parting(got, entries)
            _certify(parted, top, took, tally)
            forced = _rest(parted, ids, choice.get("token_ids"),
                           reference.get("prompt_token_ids"), score, tally)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n  got       {got!r}\n  reference {expected!r}") \
                from None
    if logprobs is not None:
        _same_logprobs([lp for _, lp in logprobs], [e["logprob"] for e in entries], parted,
                       forced, [t for t, _ in logprobs], [e["token"] for e in entries])


def assert_same_reply(got: dict[str, Any], reference: dict[str, Any], *,
                      score: Scorer | None = None, tally: Tally = TALLY) -> None:
    """``assert_same_text`` on a whole chat reply of a request made with ``chat_logprobs()``:
    its text, token ids and logprobs."""
    choice = got["choices"][0]
    entries = (choice.get("logprobs") or {}).get("content")
    if not entries:
        raise AssertionError("the answer has no logprobs (ask with chat_logprobs())")
    assert_same_text(choice["message"]["content"] or "", reference, choice.get("token_ids"),
                     [(e["token"], e["logprob"]) for e in entries], score=score, tally=tally)


def _same_logprobs(got: Sequence[float], expected: Sequence[float], parted: int | None,
                   forced: Sequence[float], got_tokens: Sequence[str] | None = None,
                   expected_tokens: Sequence[str] | None = None) -> float:
    """Up to ``parted`` the answer's logprobs are the reference's, from there the
    teacher-forced ones (``forced``), each within ``TIE``; the largest difference."""
    equal = len(expected) if parted is None else parted
    want = [*expected[:equal], *forced]
    if len(got) != len(want):
        raise AssertionError(f"lengths differ: got {len(got)} tokens with logprobs, the "
                             f"reference {len(want)}")
    largest = 0.0
    for position, (logprob, reference) in enumerate(zip(got, want, strict=True)):
        if (position < equal and got_tokens is not None and expected_tokens is not None
                and got_tokens[position] != expected_tokens[position]):
            raise AssertionError(f"token {position} is {got_tokens[position]!r}, the "
                                 f"reference's {expected_tokens[position]!r}")
        difference = abs(logprob - reference)
        if difference > TIE:
            source = "the reference's" if position < equal else "teacher-forced, the reference's"
            raise AssertionError(f"token {position} has logprob {logprob:.6f}, {source} "
                                 f"{reference:.6f}: more than rounding apart")
        largest = max(largest, difference)
    return largest


def _same_ids(got: Sequence[int], reference: dict[str, Any], score: Scorer | None,
              tally: Tally) -> tuple[int | None, list[float]]:
    """(where ``got`` parted at a near-tie or None, the teacher-forced logprobs from there)."""
    expected: list[int] = reference["token_ids"]
    if list(got) == expected:
        return None, []
    logprobs = reference.get("logprobs") or {}
    if not logprobs.get("top_logprobs"):
        raise AssertionError(f"token ids differ and the reference has no logprobs:\n  got "
                             f"{got}\n  reference {expected}")
    position = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
                    None)
    if position is None:
        raise AssertionError(f"lengths differ: got {len(got)}, reference {len(expected)}")
    alternatives = logprobs["top_logprobs"][position]
    top = sorted(((t.removeprefix("token_id:"), lp) for t, lp in alternatives.items()),
                 key=lambda item: -item[1])[:TOP]
    if len(top) < TOP:
        raise AssertionError(f"token {position} differs and the reference lists only {top}")
    _certify(position, top, str(got[position]), tally)
    return position, _rest(position, got, expected, reference.get("prompt_token_ids"), score,
                           tally)


def assert_same_ids(got: Sequence[int], reference: dict[str, Any], *,
                    score: Scorer | None = None, tally: Tally = TALLY) -> None:
    """``got`` is the reference completion's token ids, or parts from them at a near-tie and
    is the reference's greedy choice, teacher-forced, at every token after it. ``reference``
    is the reply's first choice, of a request made with ``completion_logprobs()``."""
    _same_ids(got, reference, score, tally)


def assert_same_choice(got: dict[str, Any], reference: dict[str, Any], *,
                       score: Scorer | None = None, tally: Tally = TALLY) -> float:
    """Stricter than ``assert_same_ids``: ``got``, a completion choice of a request made with
    ``completion_logprobs()``, also has the reference's logprobs within ``TIE`` at every
    token (teacher-forced past a parting). Returns the largest difference seen."""
    ids: list[int] = got["token_ids"]
    parted, forced = _same_ids(ids, reference, score, tally)
    if not (got.get("logprobs") or {}).get("token_logprobs"):
        raise AssertionError("the answer has no logprobs (ask with completion_logprobs())")
    return _same_logprobs(got["logprobs"]["token_logprobs"],
                          reference["logprobs"]["token_logprobs"], parted, forced)
