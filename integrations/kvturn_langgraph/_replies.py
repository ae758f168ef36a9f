"""The reply as received, through LangChain's round trip, and the turn's reuse report.

The decode retains the tokens it generated; the next turn reuses them only if it sends the
reply back exactly (the SDK checks this and says ``reply-changed`` otherwise). LangChain keeps
a tool call's arguments parsed (``AIMessage.tool_calls[i]["args"]``) and re-serialises them
with ``json.dumps`` when it sends the message back, so ``{"city":"Lisbon"}`` (compact, as
structured output and most servers write it) comes back as ``{"city": "Lisbon"}``. kvturn's
chat model therefore keeps each call's arguments text in
``response_metadata["kvturn"]["tool_arguments"]`` (``{tool_call_id: text}``, persisted with
the message by any checkpointer) and puts it back into the request, as long as the parsed
arguments still equal it (a call edited since keeps LangChain's serialisation).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult

import kvturn

KEY = "kvturn"
ARGUMENTS = "tool_arguments"


def report(info: kvturn.TurnInfo | None) -> dict[str, Any]:
    """A turn's reuse report as plain data (it travels in ``response_metadata``)."""
    if info is None:
        return {}
    return {"conversation_id": info.conversation_id, "reuse": info.reuse,
            "reused_tokens": info.reused_tokens, "no_reuse_reason": info.no_reuse_reason,
            "attempts": info.attempts}


def annotate(message: BaseMessage, values: Mapping[str, Any]) -> None:
    if values:
        message.response_metadata.setdefault(KEY, {}).update(values)


def _field(item: Any, name: str) -> Any:
    return item.get(name) if isinstance(item, Mapping) else getattr(item, name, None)


def keep_arguments(result: ChatResult, response: Any) -> None:
    """Copy each tool call's arguments text from ``response`` onto ``result``'s messages."""
    choices = _field(response, "choices") or ()
    for generation, choice in zip(result.generations, choices, strict=False):
        calls = _field(_field(choice, "message"), "tool_calls") or ()
        texts = {}
        for call in calls:
            call_id, function = _field(call, "id"), _field(call, "function")
            arguments = _field(function, "arguments")
            if isinstance(call_id, str) and isinstance(arguments, str):
                texts[call_id] = arguments
        if texts:
            annotate(generation.message, {ARGUMENTS: texts})


class StreamedArguments:
    """Collects a streamed reply's tool-call argument pieces, per call index, and puts the
    whole texts on the chunk that finishes the reply."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls: dict[int, list[Any]] = {}  # index -> [id, pieces]

    def see(self, chunk: ChatGenerationChunk) -> None:
        pieces = getattr(chunk.message, "tool_call_chunks", None)
        for piece in pieces or ():
            slot = self._calls.setdefault(piece.get("index") or 0, [None, []])
            if piece.get("id"):
                slot[0] = piece["id"]
            if piece.get("args"):
                slot[1].append(piece["args"])
        if self._calls and (chunk.generation_info or {}).get("finish_reason"):
            texts = {call_id: "".join(parts) for call_id, parts in self._calls.values()
                     if isinstance(call_id, str)}
            annotate(chunk.message, {ARGUMENTS: texts})
            self._calls = {}


def restore_arguments(messages: Sequence[BaseMessage], payload: Mapping[str, Any]) -> None:
    """Put kept argument texts back into the request ``payload`` built from ``messages``."""
    wire = payload.get("messages")
    if not isinstance(wire, list) or len(wire) != len(messages):
        return
    for message, sent in zip(messages, wire, strict=True):
        if not isinstance(message, AIMessage) or not message.tool_calls:
            continue
        kept = (message.response_metadata.get(KEY) or {}).get(ARGUMENTS)
        calls = sent.get("tool_calls") if isinstance(sent, dict) else None
        if not kept or not isinstance(calls, list):
            continue
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            text = kept.get(call.get("id"))
            sent = function.get("arguments")
            if isinstance(text, str) and text != sent and sent == _as_langchain_sends(text):
                function["arguments"] = text


@functools.lru_cache(maxsize=4096)
def _as_langchain_sends(text: str) -> str | None:
    """What ChatOpenAI sends for arguments parsed from ``text``: equal to what it is about to
    send exactly when the call's parsed arguments are unchanged (cached: the same history is
    resent every turn)."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return None
