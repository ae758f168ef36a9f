"""Graceful drain: what the router process does between SIGTERM and its exit.

A load balancer (a Kubernetes Service, an ingress) keeps sending requests to a router for a
few seconds after it was told to stop: the readiness probe has to fail, and the change has to
reach every proxy. So on SIGTERM the router

1. answers ``/ready`` with 503 at once (``Router.begin_drain``);
2. keeps serving new requests for ``drain_grace`` seconds;
3. then stops accepting connections and gives in-flight requests and streams up to
   ``drain_timeout`` seconds (uvicorn's graceful shutdown), then runs its own shutdown
   (background unpins and releases, also bounded by ``drain_timeout``) and exits.

A second signal, or SIGINT (Ctrl-C: someone at a terminal, no load balancer to wait for),
skips the grace.
"""

from __future__ import annotations

import signal
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from kvturn_server.router._wiring import Router


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the grace period above in front of its shutdown."""

    def __init__(self, config: uvicorn.Config, router: Router, *, grace: float) -> None:
        super().__init__(config)
        self.router = router
        self.grace = grace
        self.drain_since: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.router.draining
        self.router.begin_drain(signal.Signals(sig).name)
        if first and sig == signal.SIGTERM and self.grace > 0 and not self.should_exit:
            self.drain_since = time.monotonic()  # on_tick ends the grace
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_since is not None and time.monotonic() - self.drain_since >= self.grace:
            self.should_exit = True
        return await super().on_tick(counter)
