"""Recording a turn the router answered, whatever form openai returned it in.

The router's report (its headers) is recorded at once. A stream whose report is ``pending``
(the decode continued it alone) and that asked for usage is followed for its usage event
(``_streams``), including under ``with_raw_response`` (``LegacyAPIResponse``: parsed now;
openai caches the result, so the caller's ``parse()`` returns the same stream). Under
``with_streaming_response`` (``APIResponse``) the body is the caller's to read, and the turn
stays ``pending``.
"""

from __future__ import annotations

from typing import Any

import httpx2
from openai import AsyncStream, Stream

from kvturn._compat import LegacyAPIResponse
from kvturn._state import ConversationState, TurnPlan
from kvturn._streams import StreamFollower
from kvturn.wire import PENDING


def observe_turn(state: ConversationState, plan: TurnPlan, response: httpx2.Response,
                 result: Any, *, attempts: int, streamed: bool) -> None:
    """Record the turn the router answered with ``response``; ``result`` is openai's
    processed response."""
    report = state.started(plan, response, attempts=attempts, streamed=streamed)
    if not plan.usage or report.info().reuse != PENDING:
        return  # nothing will change the report
    if isinstance(result, LegacyAPIResponse):
        try:
            result = result.parse()
        except Exception:  # the caller's own parse() will raise the same error
            return
    if isinstance(result, Stream | AsyncStream):
        StreamFollower(state, plan, result)
