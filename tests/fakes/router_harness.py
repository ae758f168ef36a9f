"""The router tests' harness: a real router over a fake cluster (``backends.Cluster``), with an
HTTP client that talks to it in-process. ``tests/server/conftest.py``'s ``make_harness`` fixture
builds them; tests take the types from here."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx2

from kvturn_server.router import Router
from tests.fakes.backends import Cluster, ManualClock

TEST_SETTINGS: dict[str, Any] = {
    "prefill_timeout": 0.2, "decode_timeout": 0.2, "control_timeout": 0.2,
    "connect_timeout": 0.2, "health_timeout": 0.2, "health_interval": 3600.0,
    "capture_retry_delay": 0.0, "eject_after": 2, "readmit_after": 2,
    # Most router tests are about the prefill path (pin, prefill leg, decode leg); turns the
    # decode continues itself are tested where they ask for it (test_router_placement.py).
    "decode_continue_tokens": 0,
}


@dataclass
class Harness:
    """A router over a fake cluster, with an HTTP client that talks to it in-process."""

    cluster: Cluster
    router: Router
    app: Any
    client: httpx2.AsyncClient
    clock: ManualClock

    async def chat(self, conversation: str | None = None, *, stream: bool = False,
                   headers: dict[str, str] | None = None, **body: Any) -> httpx2.Response:
        payload: dict[str, Any] = {"model": "m", "messages": [{"role": "user",
                                                              "content": "hi"}],
                                   "stream": stream, **body}
        if conversation is not None:
            payload["conversation_id"] = conversation
        resp = await self.client.post("/v1/chat/completions", json=payload,
                                      headers=headers or {})
        await self.router.wait_idle()
        return resp


MakeHarness = Callable[..., Awaitable[Harness]]
