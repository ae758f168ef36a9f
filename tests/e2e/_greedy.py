"""Comparing a greedy answer with the plain reference run, token for token.

Two vLLM execution paths of one prompt round differently in float32: measured on the tiny model,
a plain disaggregated turn without any reuse and the single reference instance give chosen-token
logprobs that differ by 2e-6 on average and up to 1.6e-5 (``docs/cpu-stack.md``). Where the
reference's best two tokens are closer than that, either path may pick either one, with or
without reuse. So an answer must equal the reference, except that it may part from it at a
*near-tie*: a position where the reference's top two logprobs are within ``TIE`` and the answer
took the reference's second choice. Everything before that position is equal; nothing after it
is comparable. A wrong KV (the bug these tests look for) moves logits by far more than ``TIE``
(measured: one word changed 400 tokens back moves the first token's logprob by 2e-3 to 0.27)
and parts the answers at an ordinary position, which still fails.
"""

from __future__ import annotations

import warnings
from typing import Any

TIE = 1e-4  # six times the largest rounding difference measured between two paths
TOP = 2  # the reference's alternatives asked for at each position


class NearTie(UserWarning):
    """An answer parted from the reference at a certified near-tie (shown in pytest's summary)."""


def chat_logprobs() -> dict[str, Any]:
    """Request fields that make a chat reference comparable with ``assert_same_text``."""
    return {"logprobs": True, "top_logprobs": TOP}


def completion_logprobs() -> dict[str, Any]:
    """Request fields that make a completions reference comparable with ``assert_same_ids``."""
    return {"logprobs": TOP, "return_tokens_as_token_ids": True}


def _is_boundary(text: str, end: int, token: str) -> bool:
    # Words are whole tokens here: " Res" matching the start of " Response" is no match.
    return not (token[-1:].isalnum() and text[end:end + 1].isalnum())


def _certify(position: int, top: list[tuple[str, float]], took: str) -> None:
    (best, best_lp), (second, second_lp) = top[0], top[1]
    gap = best_lp - second_lp
    if gap > TIE or took != second:
        raise AssertionError(
            f"the answer parts from the reference at token {position}: the reference chose "
            f"{best!r} ({best_lp:.6f}), its second choice {second!r} ({second_lp:.6f}) is "
            f"{gap:.2e} behind (a near-tie needs {TIE:g}); the answer went on with {took!r}")
    warnings.warn(NearTie(f"parted at a near-tie at token {position}: {best!r} vs "
                          f"{second!r}, {gap:.1e} apart"), stacklevel=3)


def assert_same_text(got: str, reference: dict[str, Any]) -> None:
    """``got`` is the reference chat reply's content, or parts from it at a near-tie.
    ``reference`` is the whole reply of a request made with ``chat_logprobs()``."""
    choice = reference["choices"][0]
    expected = choice["message"]["content"] or ""
    if got == expected:
        return
    entries = (choice.get("logprobs") or {}).get("content")
    if not entries:
        raise AssertionError(f"answers differ and the reference has no logprobs:\n  got "
                             f"{got!r}\n  reference {expected!r}")
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
        try:
            _certify(position, top, took)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n  got       {got!r}\n  reference {expected!r}") \
                from None
        return
    raise AssertionError(f"the answer goes on past the reference:\n  got {got!r}\n  reference "
                         f"{expected!r}")


def assert_same_ids(got: list[int], reference: dict[str, Any]) -> None:
    """``got`` is the reference completion's token ids, or parts from them at a near-tie.
    ``reference`` is the reply's first choice, of a request made with ``completion_logprobs()``
    and ``return_token_ids``."""
    expected: list[int] = reference["token_ids"]
    if got == expected:
        return
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
    _certify(position, top, str(got[position]))


def assert_same_logprobs(got: list[tuple[str, float]], reference: dict[str, Any]) -> float:
    """Stricter than equal text: ``got`` (token, logprob) pairs of an answer are the reference
    chat reply's tokens, each logprob within ``TIE`` of the reference's, up to a near-tie
    parting. Returns the largest logprob difference seen."""
    entries = reference["choices"][0]["logprobs"]["content"]
    largest = 0.0
    for position, ((token, logprob), entry) in enumerate(zip(got, entries, strict=False)):
        if token != entry["token"]:
            top = [(t["token"], t["logprob"]) for t in entry["top_logprobs"][:TOP]]
            _certify(position, top, token)
            return largest
        difference = abs(logprob - entry["logprob"])
        if difference > TIE:
            raise AssertionError(f"token {position} ({token!r}) has logprob {logprob:.6f}, the "
                                 f"reference {entry['logprob']:.6f}: more than rounding apart")
        largest = max(largest, difference)
    if len(got) != len(entries):
        raise AssertionError(f"lengths differ: got {len(got)} tokens, reference {len(entries)}")
    return largest
