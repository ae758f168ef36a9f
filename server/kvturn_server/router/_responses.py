"""``POST /v1/responses``: the router is the Responses API's state holder.

A turn's prefill and decode are different vLLM instances, and any of them may serve the next
turn, so no instance can hold ``store``d responses. The router keeps, per stored response, the
full input it was given and its output items (``_state_responses.py``: bounded, TTL, memory or
Redis like the conversation store), and per request:

1. expands ``previous_response_id`` (or the ``conversation`` parameter) into the full input:
   the stored items, then the request's own input (OpenAI: "the previous response's input and
   output are used as context"; instructions do not carry over);
2. sends that full input to both legs with ``store: false`` and without
   ``previous_response_id``/``conversation``, and ``request_id`` set to the response's id, so
   the decode's answer carries the id the router stores it under;
3. takes the chain as the conversation: a response continues the conversation of the one it
   follows (a new chain's conversation is its first response's id; the ``conversation``
   parameter's id; kvturn's own conversation id when the request names one,
   ``_identity.py``), so every turn of a chain reuses the KV of the one before;
4. stores the response (unless ``store`` is false) before the client has it: an agent sends
   its next turn the moment it reads the answer (a stream's final event is held until then).

An unknown (or expired, or another tenant's) ``previous_response_id`` is ``404``
``previous_response_not_found``; records are tenant-scoped by the same ``Authorization`` hash
as conversations. docs/http-api.md, section A, "Responses".
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from kvturn.wire import HEADER_NO_REUSE, HEADER_REQUEST_ID
from kvturn_server.router import _json
from kvturn_server.router._apis import RESPONSES
from kvturn_server.router._body import BodyError, read_json_body
from kvturn_server.router._errors import ApiError
from kvturn_server.router._identity import (
    Identity,
    conversation_key,
    credential_of,
    resolve_identity,
    tenant_of,
    validate_id,
)
from kvturn_server.router._legs import client_body
from kvturn_server.router._log import event
from kvturn_server.router._state import StoreError
from kvturn_server.router._stream import RelayResponse
from kvturn_server.router._turn import Turn, request_id_of, traced

if TYPE_CHECKING:
    from kvturn_server.router._wiring import Router

log = logging.getLogger("kvturn.router")

# Final stream events whose response is stored (a failed one has nothing to continue from).
_STORED_STATUSES = frozenset({"completed", "incomplete"})


def response_key(tenant: str, response_id: str) -> str:
    return f"{tenant}/r/{response_id}"


def conversation_record_key(tenant: str, conversation: str) -> str:
    return f"{tenant}/c/{conversation}"


def _input_items(value: Any) -> list[Any]:
    """The request's ``input`` as items (a string is one user message, as OpenAI reads it)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    raise ApiError(400, "input must be a string or a list of items", param="input",
                   code="invalid_parameter")


def _conversation_param(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("id")
    return validate_id(value, "conversation")


class ResponsesTurn:
    """One ``/v1/responses`` request: its expansion, and the record it leaves (``ReplyHook``)."""

    def __init__(self, router: Router, *, tenant: str, response_id: str, store: bool,
                 items: list[Any], conversation: str | None, conversation_param: str | None,
                 previous_response_id: str | None) -> None:
        self.r = router
        self.tenant = tenant
        self.response_id = response_id
        self.store = store
        self.items = items
        self.conversation = conversation
        self.conversation_param = conversation_param
        self.previous_response_id = previous_response_id

    def restore(self, response: dict[str, Any]) -> None:
        """The legs saw none of these fields: the client gets back what it asked for."""
        response["previous_response_id"] = self.previous_response_id
        if "store" in response:
            response["store"] = self.store
        if self.conversation_param is not None:
            response["conversation"] = {"id": self.conversation_param}

    async def reply(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.restore(payload)
        await self._record(payload)
        return payload

    def restore_events(self, events: bytes) -> bytes:
        """A stream's events, each response object in them (``response.created``,
        ``in_progress``, ``completed``, ...) restored as ``reply`` restores a whole reply;
        the other events (deltas) pass as they are."""
        if b'"response"' not in events:
            return events
        out = []
        for block in events.split(b"\n\n"):
            if b'"response"' in block:
                block = self._restored_event(block)
            out.append(block)
        return b"\n\n".join(out)

    def _restored_event(self, block: bytes) -> bytes:
        lines = block.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            try:
                payload = _json.loads(line[5:])
            except ValueError:
                return block
            response = payload.get("response") if isinstance(payload, dict) else None
            if not isinstance(response, dict):
                return block
            self.restore(response)
            lines[i] = b"data: " + _json.dumps(payload)
        return b"\n".join(lines)

    async def final_event(self, event_bytes: bytes) -> None:
        data = b"\n".join(line[5:].removeprefix(b" ")
                          for line in event_bytes.replace(b"\r\n", b"\n").split(b"\n")
                          if line.startswith(b"data:"))
        try:
            payload = _json.loads(data)
        except ValueError:
            return
        response = payload.get("response") if isinstance(payload, dict) else None
        if isinstance(response, dict):
            await self._record(response)

    async def _record(self, response: dict[str, Any]) -> None:
        output = response.get("output")
        if not isinstance(output, list) or response.get("status") not in _STORED_STATUSES:
            return
        if not self.store and self.conversation_param is None:
            return
        cfg = self.r.config
        blob = _json.dumps({"conversation": self.conversation, "items": [*self.items,
                                                                          *output]})
        if len(blob) > cfg.max_body_bytes:
            # Its expansion would be a body larger than any the router accepts.
            event(log, logging.WARNING, "response_not_stored", response_id=self.response_id,
                  why=f"{len(blob)} bytes > max_body_bytes")
            return
        try:
            store = self.r.responses
            if self.store:
                await store.put(response_key(self.tenant, self.response_id), blob,
                                cfg.responses_ttl)
            if self.conversation_param is not None:
                await store.put(conversation_record_key(self.tenant, self.conversation_param),
                                blob, cfg.responses_ttl)
        except StoreError as exc:
            self.r.metrics.state_errors.inc()
            event(log, logging.WARNING, "state_store_failed", op="put_response",
                  response_id=self.response_id, error=str(exc))


async def _stored(router: Router, key: str) -> dict[str, Any] | None:
    try:
        raw = await router.responses.get(key)
    except StoreError as exc:
        router.metrics.state_errors.inc()
        raise ApiError(503, f"the router's response store failed: {exc}",
                       type_="server_error", code="state_unavailable",
                       retry_after=router.config.retry_after) from exc
    if raw is None:
        return None
    try:
        record = _json.loads(raw)
    except ValueError:
        return None
    items = record.get("items") if isinstance(record, dict) else None
    return record if isinstance(items, list) else None


async def _prepare(router: Router, body: dict[str, Any], headers: Any
                   ) -> tuple[dict[str, Any], Identity | None, ResponsesTurn]:
    RESPONSES.validate(body)
    explicit = resolve_identity(body, headers)
    authorization = credential_of(headers)
    tenant = tenant_of(authorization)
    previous = body.get("previous_response_id")
    if previous is not None:
        previous = validate_id(previous, "previous_response_id")
    conversation_param = _conversation_param(body.get("conversation"))
    if previous is not None and conversation_param is not None:
        raise ApiError(400, "previous_response_id and conversation cannot be used together",
                       param="conversation", code="invalid_parameter")
    given_id = body.get("request_id")
    response_id = given_id if isinstance(given_id, str) and given_id.startswith("resp_") \
        and len(given_id) <= 128 and given_id.isascii() and given_id.isprintable() \
        else f"resp_{uuid.uuid4().hex}"
    store = body.get("store") is not False
    history: list[Any] = []
    conversation: str | None = None
    source = "response"
    if previous is not None:
        record = await _stored(router, response_key(tenant, previous))
        if record is None:
            raise ApiError(404, f"Previous response with id '{previous}' not found.",
                           type_="invalid_request_error", param="previous_response_id",
                           code="previous_response_not_found")
        history = record["items"]
        stored_conversation = record.get("conversation")
        conversation = stored_conversation if isinstance(stored_conversation, str) else None
        source = "previous_response_id"
    elif conversation_param is not None:
        record = await _stored(router, conversation_record_key(tenant, conversation_param))
        history = record["items"] if record is not None else []
        conversation, source = conversation_param, "conversation"
    own = body.get("input")
    items = [*history, *_input_items(own)] if history else _input_items(own)
    leg = client_body(body)
    for name in ("previous_response_id", "conversation"):
        leg.pop(name, None)
    # Without history the input goes on as the client wrote it (a string stays a string).
    leg["input"] = items if history else own
    leg["store"] = False
    leg["request_id"] = response_id
    if explicit is not None:
        identity: Identity | None = explicit
        conversation = explicit.conversation_id
    else:
        if conversation is None and (store or conversation_param is not None):
            conversation = response_id  # a new chain: its first response names it
        identity = None if conversation is None else Identity(
            conversation, conversation_key(conversation, authorization), source)
    state = ResponsesTurn(router, tenant=tenant, response_id=response_id, store=store,
                          items=items, conversation=conversation,
                          conversation_param=conversation_param,
                          previous_response_id=previous)
    return leg, identity, state


async def responses_endpoint(router: Router, request: Request) -> Response:
    """``POST /v1/responses`` (streaming and not)."""
    started = time.perf_counter()
    headers = request.headers
    request_id = request_id_of(headers.get(HEADER_REQUEST_ID))
    try:
        body = await read_json_body(request, router.config.max_body_bytes,
                                    router.config.body_timeout)
        leg, identity, state = await _prepare(router, body, headers)
    except ApiError as exc:
        router.metrics.request(RESPONSES.name, "invalid")
        extra = {HEADER_REQUEST_ID: request_id}
        if isinstance(exc, BodyError) and exc.close:
            extra["connection"] = "close"
        return exc.response(extra)
    turn = Turn(router.services, request_id=request_id, path=request.scope["path"], body=leg,
                identity=identity, no_reuse=HEADER_NO_REUSE in headers, started=started,
                api=RESPONSES, hook=state)
    traced(turn, headers)
    response = await turn.run()
    if isinstance(response, RelayResponse):
        return _RestoredStream(response, state)
    return response


class _RestoredStream(Response):
    """A relayed Responses stream whose events carry the client's own fields (the legs saw
    the expanded request: ``previous_response_id: null``, ``store: false``). The relay sends
    whole events per body message (``_stream.py``), so each message is restored alone."""

    def __init__(self, relay: RelayResponse, state: ResponsesTurn) -> None:
        self.relay = relay
        self.state = state
        self.status_code = relay.status_code
        self.background = None
        self.raw_headers = relay.raw_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def restoring(message: Message) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                message = {**message, "body": self.state.restore_events(message["body"])}
            await send(message)

        await self.relay(scope, receive, restoring)
