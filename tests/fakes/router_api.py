"""The router API as every fake router serves it: an ``httpx2.MockTransport`` handler base that
records each request, reports reuse like the kvturn router (``X-KVTurn-*`` headers) and answers
the conversation endpoints (keepalive, release). Subclasses answer the turns."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import httpx2

# Where the SDK's and the integrations' clients find the fake router (never resolved: the
# clients' transport is the fake's MockTransport).
BASE_URL = "http://router.test:8000/v1"
CONVERSATIONS = "/kvturn/v1/conversations/"
TURN_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass
class Recorded:
    method: str
    path: str
    raw_path: str  # keeps the percent-encoding of ids that contain "/"
    headers: httpx2.Headers
    body: Any

    @property
    def conversation_header(self) -> str | None:
        return self.headers.get("x-conversation-id")

    @property
    def conversation(self) -> str | None:
        """The id the router would use: body ``conversation_id``, else the header."""
        if isinstance(self.body, dict) and self.body.get("conversation_id") is not None:
            return str(self.body["conversation_id"])
        return self.conversation_header

    @property
    def no_reuse(self) -> str | None:
        return self.headers.get("x-kvturn-no-reuse")


def api_error(status: int, message: str, *, type_: str = "server_error",
              code: str | None = None) -> httpx2.Response:
    return httpx2.Response(status, json={"error": {"message": message, "type": type_,
                                                   "param": None, "code": code}})


class RouterAPI:
    """Requests, retentions and the conversation endpoints; ``handle_turn`` answers the rest.

    ``retained`` maps a conversation id to the tokens its retention holds; a turn with an id
    is retained (``retain``), a keepalive answers 404 ``no_retention`` for an id not in it,
    and ``keepalive_status`` forces another answer.
    """

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.retained: dict[str, int] = {}
        self.keepalive_status = 200
        self._changed = threading.Condition()

    # --- inspection -------------------------------------------------------------------------

    def turns(self) -> list[Recorded]:
        return [r for r in self.requests if r.path in TURN_PATHS]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    # --- the handler ------------------------------------------------------------------------

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        content = request.content
        try:
            body = json.loads(content) if content else None
        except ValueError:
            body = content  # e.g. a multipart upload
        recorded = Recorded(request.method, request.url.path, request.url.raw_path.decode(),
                            request.headers, body)
        with self._changed:
            self.requests.append(recorded)
            self._changed.notify_all()
        if recorded.raw_path.startswith(CONVERSATIONS):
            return self._conversation_endpoint(recorded)
        return self.handle_turn(recorded)

    def handle_turn(self, recorded: Recorded) -> httpx2.Response:
        raise NotImplementedError

    def reuse_headers(self, recorded: Recorded) -> dict[str, str]:
        """The router's reuse report for a turn: ``hit`` when the conversation's last turn is
        retained and the request did not say ``X-KVTurn-No-Reuse``."""
        conversation = recorded.conversation
        headers = {"x-request-id": f"req-{len(self.requests)}"}
        if conversation is None:
            return {**headers, "X-KVTurn-Reuse": "miss", "X-KVTurn-Reused-Tokens": "0"}
        headers["X-KVTurn-Conversation"] = conversation
        if recorded.no_reuse:
            outcome, tokens = "disabled", 0
        elif conversation in self.retained:
            outcome, tokens = "hit", self.retained[conversation]
        else:
            outcome, tokens = "miss", 0
        return {**headers, "X-KVTurn-Reuse": outcome, "X-KVTurn-Reused-Tokens": str(tokens)}

    def retain(self, recorded: Recorded, tokens: int) -> None:
        conversation = recorded.conversation
        if conversation is not None:
            with self._changed:
                self.retained[conversation] = tokens

    def _conversation_endpoint(self, recorded: Recorded) -> httpx2.Response:
        rest = recorded.raw_path[len(CONVERSATIONS):]
        if recorded.method == "POST" and rest.endswith("/keepalive"):
            conversation = unquote(rest[: -len("/keepalive")])
            if self.keepalive_status == 404 or conversation not in self.retained:
                return api_error(404, "no retention", type_="not_found", code="no_retention")
            if self.keepalive_status != 200:
                return api_error(self.keepalive_status, "backend trouble")
            return httpx2.Response(200, json={
                "conversation_id": conversation, "retained": True, "expires_in": 480.0,
                "hold_remaining": 3000.0, "num_tokens": self.retained[conversation]})
        if recorded.method == "DELETE":
            conversation = unquote(rest)
            with self._changed:
                released = self.retained.pop(conversation, None) is not None
            return httpx2.Response(200, json={"conversation_id": conversation,
                                              "released": released})
        return api_error(404, "unknown endpoint", type_="not_found")
