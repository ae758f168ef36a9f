"""Retries of transient router errors, with tenacity.

The rule: **kvturn owns retries, openai's own loop is switched off for kvturn's requests.** The
client's ``max_retries`` (openai's knob: constructor, ``with_options``, per request) keeps its
meaning, ``max_retries + 1`` attempts, and ``RetryPolicy`` adds the timing; every attempt goes
through openai's request machinery with ``max_retries=0``. So the two loops never multiply, and
kvturn alone decides what is transient and how long to wait:

* connection errors and timeouts (only when the body can be sent again);
* ``429``, ``502``, ``503``, ``504``, and any status with ``x-should-retry: true``;
  ``x-should-retry: false`` vetoes; other statuses (``400``, ``404``, ``500``, ...) are final;
* a ``Retry-After`` / ``retry-after-ms`` longer than ``max_retry_after`` means "not soon": final.

The wait before attempt *n + 1* is the server's ``retry-after-ms`` / ``Retry-After`` when given,
else exponential backoff with jitter, ``min(initial_delay * 2**(n-1) + uniform(0, jitter),
max_delay)``. No attempt starts
after ``max_elapsed`` seconds: a wait that would cross it ends the loop with the last error. The
caller sees openai's own exception types (``RateLimitError``, ``APIConnectionError``, ...).

A stream is retried only until its response starts; once a ``Stream`` is returned, its chunks
are the caller's and an error while reading them is raised, never retried.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx2
import openai
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_any,
)
from tenacity.stop import stop_base

log = logging.getLogger("kvturn")

_T = TypeVar("_T")
_R = TypeVar("_R", Retrying, AsyncRetrying)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Timing of kvturn's retries; the number of attempts is the client's ``max_retries + 1``.

    >>> import kvturn
    >>> client = kvturn.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-",
    ...                        max_retries=4, retry_policy=kvturn.RetryPolicy(max_elapsed=20))

    ``sleep``, ``async_sleep`` and ``clock`` exist so tests and simulations can run retries
    without waiting.
    """

    max_elapsed: float = 60.0
    """Seconds from the first attempt after which no further attempt starts."""
    initial_delay: float = 0.5
    max_delay: float = 8.0
    jitter: float = 0.5
    """Up to this many seconds of uniform random jitter are added to each backoff."""
    max_retry_after: float = 120.0
    """A server-requested delay longer than this is not waited for (openai's limit too)."""
    retry_statuses: frozenset[int] = frozenset({429, 502, 503, 504})
    sleep: Callable[[float], None] = time.sleep
    async_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    clock: Callable[[], float] = time.monotonic


def retry_after(headers: httpx2.Headers) -> float | None:
    """The server's requested delay in seconds (``retry-after-ms``, then ``Retry-After`` as
    seconds or an HTTP date), or None."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            continue
        return seconds if math.isfinite(seconds) else math.inf
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def is_transient(error: BaseException, policy: RetryPolicy) -> bool:
    """Whether another attempt may succeed (the rules are in the module docstring)."""
    if isinstance(error, openai.APIConnectionError):  # includes APITimeoutError
        return True
    if not isinstance(error, openai.APIStatusError):
        return False
    headers = error.response.headers
    delay = retry_after(headers)
    if delay is not None and delay > policy.max_retry_after:
        return False
    verdict = headers.get("x-should-retry")
    if verdict == "true":
        return True
    if verdict == "false":
        return False
    return error.status_code in policy.retry_statuses


class _Wait:
    """Server-requested delay when there is one, else exponential backoff with jitter:
    ``min(initial_delay * 2**(n-1) + uniform(0, jitter), max_delay)`` before attempt n + 1.

    Computed here rather than with tenacity's ``wait_exponential_jitter``, whose parameter
    names changed within tenacity 9.x (``initial`` is deprecated for ``multiplier``).
    """

    def __init__(self, policy: RetryPolicy) -> None:
        self._policy = policy

    def __call__(self, state: RetryCallState) -> float:
        policy = self._policy
        error = state.outcome.exception() if state.outcome is not None else None
        if isinstance(error, openai.APIStatusError):
            delay = retry_after(error.response.headers)
            if delay is not None and 0 <= delay <= policy.max_retry_after:
                return delay
        exponent = min(state.attempt_number - 1, 64)  # 2**64 s is already "never"
        backoff = policy.initial_delay * 2.0 ** exponent + random.uniform(0, policy.jitter)
        return min(backoff, policy.max_delay)


class _Deadline(stop_base):
    """Stop when the coming wait would end past ``max_elapsed`` (measured on the policy's clock,
    so an injected clock drives it)."""

    def __init__(self, policy: RetryPolicy, start: float) -> None:
        self._policy = policy
        self._start = start

    def __call__(self, state: RetryCallState) -> bool:
        elapsed = self._policy.clock() - self._start
        return elapsed + state.upcoming_sleep >= self._policy.max_elapsed


OnRetry = Callable[[BaseException, int, float], None]
"""Called before each wait with the error, the attempt that failed, and the wait in seconds."""


def _controller(cls: type[_R], policy: RetryPolicy, attempts: int, start: float,
                on_retry: OnRetry | None, sleep: object) -> _R:
    def before_sleep(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        assert error is not None
        log.info("kvturn: attempt %d of %d failed (%s); retrying in %.2f s",
                 state.attempt_number, attempts, _describe(error), state.upcoming_sleep)
        if on_retry is not None:
            on_retry(error, state.attempt_number, state.upcoming_sleep)

    return cls(sleep=sleep,  # type: ignore[arg-type]
               stop=stop_any(stop_after_attempt(attempts), _Deadline(policy, start)),
               wait=_Wait(policy), retry=retry_if_exception(lambda e: is_transient(e, policy)),
               before_sleep=before_sleep, reraise=True)


def _describe(error: BaseException) -> str:
    if isinstance(error, openai.APIStatusError):
        return f"HTTP {error.status_code}"
    return type(error).__name__


def call_with_retries(attempt: Callable[[int], _T], *, attempts: int, policy: RetryPolicy,
                      replayable: bool = True, on_retry: OnRetry | None = None) -> _T:
    """Run ``attempt(n)`` (n = 1, 2, ...) until it succeeds or the policy gives up.

    The first attempt runs outside tenacity: building a tenacity controller costs about 30 us,
    more than everything else kvturn adds to a call, and most calls succeed at once. A transient
    failure hands over to tenacity, which sees that failure as its own first attempt.
    """
    start = policy.clock()
    try:
        return attempt(1)
    except Exception as error:
        if attempts <= 1 or not replayable or not is_transient(error, policy):
            raise
        pending: list[BaseException] = [error]
    number = 1

    def again() -> _T:
        nonlocal number
        if pending:
            raise pending.pop()
        number += 1
        return attempt(number)

    retrying = _controller(Retrying, policy, attempts, start, on_retry, policy.sleep)
    return retrying(again)


async def acall_with_retries(attempt: Callable[[int], Awaitable[_T]], *, attempts: int,
                             policy: RetryPolicy, replayable: bool = True,
                             on_retry: OnRetry | None = None) -> _T:
    """The async twin of ``call_with_retries``."""
    start = policy.clock()
    try:
        return await attempt(1)
    except Exception as error:
        if attempts <= 1 or not replayable or not is_transient(error, policy):
            raise
        pending: list[BaseException] = [error]
    number = 1

    async def again() -> _T:
        nonlocal number
        if pending:
            raise pending.pop()
        number += 1
        return await attempt(number)

    retrying = _controller(AsyncRetrying, policy, attempts, start, on_retry, policy.async_sleep)
    return await retrying(again)
