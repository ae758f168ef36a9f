"""What differs between the APIs a turn can speak: Chat and Completions (OpenAI), Messages
(Anthropic), Responses (OpenAI). The turn itself (``_turn.py``) is the same for all four.

Per API: how the prefill leg asks for one non-streaming token (vLLM 0.32 spells the limit
``max_tokens`` in Chat, Completions and Messages, ``max_output_tokens`` in Responses), which
fields are checked before any leg, how many prompt tokens a reply reports, which messages the
decode-continuation estimate reads (``_history.py``), how a stream ends (the event held back
until the capture ran: ``data: [DONE]``, Messages' ``message_stop``, Responses'
``response.completed``/``incomplete``/``failed``) and what an error looks like (OpenAI's
``{"error": {...}}`` everywhere except Messages, which answers Anthropic's
``{"type": "error", "error": {"type", "message"}}``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from kvturn_server.router import _json
from kvturn_server.router._errors import ApiError
from kvturn_server.router._history import Transcript
from kvturn_server.router._legs import DecodeUsage, prefill_body, retention_leg_params
from kvturn_server.router._stream import split_done
from kvturn_server.router._validate import strict_bool, strict_int, validate_request


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_parameter")


# Prefill legs.

def _messages_prefill(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    leg = dict(body)
    leg["stream"] = False
    leg["max_tokens"] = 1
    leg["kv_transfer_params"] = retention_leg_params(params)
    return leg


def _responses_prefill(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    leg = dict(body)
    leg["stream"] = False
    leg["store"] = False
    leg["max_output_tokens"] = 1
    leg.pop("stream_options", None)
    leg["kv_transfer_params"] = retention_leg_params(params)
    return leg


# Checks before any leg (what the prefill leg's rewrite would hide from the decode).

def _validate_messages(body: dict[str, Any]) -> None:
    strict_bool(body, "stream")
    limit = strict_int(body, "max_tokens", nullable=False)
    if limit is None:
        raise _bad("max_tokens", "max_tokens is required")
    if limit < 1:
        raise _bad("max_tokens", f"max_tokens must be at least 1, got {limit}")


def _validate_responses(body: dict[str, Any]) -> None:
    stream = strict_bool(body, "stream") is True
    strict_bool(body, "store")
    if strict_bool(body, "background"):
        # A background response is polled from the instance that stored it; behind a router
        # of stateless instances there is none.
        raise _bad("background", "background responses are not supported through kvturn")
    limit = strict_int(body, "max_output_tokens")
    if limit is not None and limit < 1:
        raise _bad("max_output_tokens", f"max_output_tokens must be at least 1, got {limit}")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "stream_options must be an object or null")
    if options and not stream:
        raise _bad("stream_options", "stream_options can only be set when stream is true")


# What a reply (or a stream's event) reports of its tokens.

def _tokens(usage: Any, name: str) -> int | None:
    value = usage.get(name) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def _usage_of(payload: Any) -> Any:
    """The ``usage`` object of a reply, of a stream's usage event, or of the response a
    Responses stream's final event carries."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if usage is None and isinstance(payload.get("response"), dict):
        usage = payload["response"].get("usage")
    return usage if isinstance(usage, dict) else None


def _usage_reader(prompt: str, completion: str,
                  details: str) -> Callable[[Any], DecodeUsage | None]:
    """OpenAI's usage shapes (Chat and Completions, Responses): the two counts' names and the
    object whose ``cached_tokens`` is the prompt's cached part."""

    def read(payload: Any) -> DecodeUsage | None:
        usage = _usage_of(payload)
        tokens = _tokens(usage, prompt)
        if tokens is None:
            return None
        return DecodeUsage(tokens, _tokens(usage, completion) or 0,
                           _tokens(usage.get(details), "cached_tokens"))

    return read


_chat_usage = _usage_reader("prompt_tokens", "completion_tokens", "prompt_tokens_details")
_responses_usage = _usage_reader("input_tokens", "output_tokens", "input_tokens_details")


def _messages_usage(payload: Any) -> DecodeUsage | None:
    # vLLM's Anthropic usage splits the prompt: input = prompt - cache_read - cache_creation;
    # cache_read is its cached_tokens, present only with --enable-prompt-tokens-details.
    usage = _usage_of(payload)
    read = _tokens(usage, "cache_read_input_tokens")
    parts = [_tokens(usage, name) for name in ("input_tokens", "cache_creation_input_tokens")]
    if parts[0] is None:
        return None
    return DecodeUsage(sum(n or 0 for n in parts) + (read or 0),
                       _tokens(usage, "output_tokens") or 0, read)


# Asking a streamed decode leg for its usage.

def _ask_usage(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Chat and Completions streams carry usage only when asked (``stream_options``): ask for
    it, and say whether the client did not (its event is then cut out of the client's stream,
    ``_stream.UsageTap``). Continuous usage stays off unless the client asked for usage: vLLM
    would otherwise put usage in every chunk."""
    if body.get("stream") is not True:
        return body, False
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return body, False
    asked = dict(options) if isinstance(options, dict) else {}
    asked.update(include_usage=True, continuous_usage_stats=False)
    return {**body, "stream_options": asked}, True


def _usage_sent(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Messages and Responses streams always carry usage (``message_delta``,
    ``response.completed``)."""
    return body, False


# What the decode-continuation estimate reads: the prompt's parts in order.

def _chat_transcript(body: dict[str, Any]) -> Transcript | None:
    return Transcript.of(body)


def _messages_transcript(body: dict[str, Any]) -> Transcript | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    system = body.get("system")
    head: list[Any] = [] if system is None else [{"role": "system", "content": system}]
    return Transcript([*head, *messages])


def _responses_transcript(body: dict[str, Any]) -> Transcript | None:
    items = body.get("input")
    if isinstance(items, str):
        # The router expands a string into this item when the chain goes on (_responses.py).
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        return None
    instructions = body.get("instructions")
    head: list[Any] = [] if instructions is None else [{"role": "system",
                                                        "content": instructions}]
    return Transcript([*head, *(_prompt_item(item) for item in items)])


def _prompt_item(item: Any) -> Any:
    """A Responses item as the estimate should size it: output text's ``logprobs`` (fed back
    with the reply when a client asked for them) are no part of the prompt and would dwarf
    it; output items fed back (function calls, reasoning) are the model's reply coming back."""
    if not isinstance(item, dict):
        return item
    content = item.get("content")
    if isinstance(content, list) and any(isinstance(p, dict) and "logprobs" in p
                                         for p in content):
        item = {**item, "content": [{k: v for k, v in p.items() if k != "logprobs"}
                                    if isinstance(p, dict) else p for p in content]}
    if "role" not in item and item.get("type") in ("function_call", "reasoning",
                                                   "custom_tool_call"):
        item = {**item, "role": "assistant"}
    return item


# How a stream ends.

_MESSAGES_FINAL = (b"event: message_stop",)
_RESPONSES_FINAL = (b"event: response.completed", b"event: response.incomplete",
                    b"event: response.failed")


def split_final_event(markers: tuple[bytes, ...]) -> Callable[[bytes], tuple[bytes, bytes]]:
    """A splitter like ``split_done`` for streams whose last event is named (``event: x``):
    ``data`` (complete events) split into what precedes a final event and that event."""

    def split(data: bytes) -> tuple[bytes, bytes]:
        body = data.rstrip(b"\r\n")
        lf, crlf = body.rfind(b"\n\n"), body.rfind(b"\r\n\r\n")
        start = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        last = body[start:]
        if any(last.startswith(m) and last[len(m):len(m) + 1] in (b"\n", b"\r")
               for m in markers):
            return data[:start], data[start:]
        return data, b""

    return split


# Errors.

def openai_error_event(message: str, code: str) -> bytes:
    payload = _json.dumps({"error": {"message": message, "type": "server_error",
                                     "param": None, "code": code}})
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"


def anthropic_error_event(message: str, code: str) -> bytes:
    del code  # Anthropic's stream errors carry a type and a message only
    payload = _json.dumps({"type": "error", "error": {"type": "api_error",
                                                      "message": message}})
    return b"event: error\ndata: " + payload + b"\n\n"


def responses_error_event(message: str, code: str) -> bytes:
    payload = _json.dumps({"type": "error", "code": code, "message": message, "param": None,
                           "sequence_number": 0})
    return b"event: error\ndata: " + payload + b"\n\n"


# Anthropic error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                    413: "request_too_large", 415: "invalid_request_error",
                    429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_errors(response: Response) -> Response:
    """``response`` with an OpenAI-shaped error body (the router's own) rewritten in the
    Messages API's shape; anything else (a success, vLLM's own Anthropic-shaped error)
    unchanged. Headers, including ``x-should-retry`` and ``Retry-After``, stay."""
    if response.status_code < 400 or not isinstance(response.body, bytes | bytearray | memoryview):
        return response
    try:
        payload = _json.loads(bytes(response.body))
    except ValueError:
        return response
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or payload.get("type") == "error":
        return response
    status = response.status_code
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else
                                "invalid_request_error")
    body = _json.dumps({"type": "error", "error": {"type": kind,
                                                  "message": str(error.get("message", ""))}})
    headers = {k: v for k, v in response.headers.items()
               if k.lower() not in ("content-length", "content-type")}
    return Response(body, status_code=status, headers=headers, media_type="application/json")


@dataclass(frozen=True, slots=True)
class Api:
    """One API's differences (see the module docstring).

    Attributes:
        name: the endpoint label in metrics and logs.
        prefill_body: the prefill leg's body from the client's and the pinned params.
        validate: raises ApiError(400) for what only the decode would refuse.
        usage: the tokens a reply (or a stream's usage event) reports; None when it has
            no usage.
        ask_usage: a streamed decode leg's body asking for usage, and whether the client
            did not (the usage event is then the router's alone).
        transcript: the prompt's messages for the continuation estimate (None: none).
        split_final: splits the stream's final event off (held until the capture ran).
        error_event: the event a broken stream ends with.
        stop_field: the request field of stop strings (a stop-string end trails the reply).
    """

    name: str
    prefill_body: Callable[[dict[str, Any], dict[str, Any] | None], dict[str, Any]]
    validate: Callable[[dict[str, Any]], None]
    usage: Callable[[Any], DecodeUsage | None]
    transcript: Callable[[dict[str, Any]], Transcript | None]
    split_final: Callable[[bytes], tuple[bytes, bytes]]
    error_event: Callable[[str, str], bytes]
    ask_usage: Callable[[dict[str, Any]], tuple[dict[str, Any], bool]] = _usage_sent
    stop_field: str = "stop"

    def prompt_tokens(self, payload: Any) -> int:
        """Prompt tokens a (prefill) reply reports; 0 when it does not say."""
        usage = self.usage(payload)
        return 0 if usage is None else usage.prompt_tokens


CHAT = Api("chat", prefill_body, lambda body: validate_request(body, "chat"), _chat_usage,
           _chat_transcript, split_done, openai_error_event, _ask_usage)
COMPLETIONS = Api("completions", prefill_body, lambda body: validate_request(body, "completions"),
                  _chat_usage, lambda body: None, split_done, openai_error_event, _ask_usage)
MESSAGES = Api("messages", _messages_prefill, _validate_messages, _messages_usage,
               _messages_transcript, split_final_event(_MESSAGES_FINAL), anthropic_error_event,
               stop_field="stop_sequences")
RESPONSES = Api("responses", _responses_prefill, _validate_responses, _responses_usage,
                _responses_transcript, split_final_event(_RESPONSES_FINAL),
                responses_error_event)

API_BY_PATH = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS,
               "/v1/messages": MESSAGES, "/v1/responses": RESPONSES}
