"""Retries of transient router errors: kvturn's policy, run by openai's own request loop.

openai's ``request`` makes every attempt (``max_retries + 1`` of them: constructor,
``with_options``, per request, openai's own knob and meaning). kvturn does not wrap that loop, it
answers the loop's questions through openai's retry hooks (``kvturn._core``): *may this failure
be retried?* (``_should_retry``) and *how long to wait?* (``_sleep_for_retry``), with the rules
below. So there is one loop, never two multiplying, and kvturn alone decides what is transient
and how long to wait:

* connection errors and timeouts (only when the body can be sent again);
* ``429``, ``502``, ``503``, ``504``, and any status with ``x-should-retry: true``;
  ``x-should-retry: false`` vetoes; other statuses (``400``, ``404``, ``500``, ...) are final;
* a ``Retry-After`` / ``retry-after-ms`` longer than ``max_retry_after`` means "not soon": final.

The wait before attempt *n + 1* is the server's ``retry-after-ms`` / ``Retry-After`` when given,
else exponential backoff with jitter, ``min(initial_delay * 2**(n-1) + uniform(0, jitter),
max_delay)``. No attempt starts after ``max_elapsed`` seconds: a wait that would cross it ends
the loop with the last error. The caller sees openai's own exception types (``RateLimitError``,
``APIConnectionError``, ...), raised by openai's loop.

A stream is retried only until its response starts; once a ``Stream`` is returned, its chunks
are the caller's and an error while reading them is raised, never retried.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx2


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


def transient_status(status: int, headers: httpx2.Headers, policy: RetryPolicy) -> bool:
    """Whether a response with this status may succeed when sent again (rules in the module
    docstring)."""
    delay = retry_after(headers)
    if delay is not None and delay > policy.max_retry_after:
        return False
    verdict = headers.get("x-should-retry")
    if verdict == "true":
        return True
    if verdict == "false":
        return False
    return status in policy.retry_statuses


def retry_wait(policy: RetryPolicy, failed_attempt: int, headers: httpx2.Headers | None) -> float:
    """Seconds to wait after attempt ``failed_attempt`` (1, 2, ...) failed: the server's
    requested delay when there is a usable one, else exponential backoff with jitter."""
    if headers is not None:
        delay = retry_after(headers)
        if delay is not None and 0 <= delay <= policy.max_retry_after:
            return delay
    exponent = min(failed_attempt - 1, 64)  # 2**64 s is already "never"
    backoff = policy.initial_delay * 2.0 ** exponent + random.uniform(0, policy.jitter)
    return min(backoff, policy.max_delay)


def past_deadline(policy: RetryPolicy, start: float, wait: float) -> bool:
    """Whether the next attempt, after ``wait``, would start ``max_elapsed`` or more after
    ``start`` (measured on the policy's clock, so an injected clock drives it)."""
    return policy.clock() - start + wait >= policy.max_elapsed
