"""One chat turn of a conversation through a router, as the stock ``openai`` client sends it
(streamed or not): the text, the router's reuse report and headers, every token's logprob."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openai import OpenAI


@dataclass
class Turn:
    text: str
    reuse: str
    reused: int
    headers: dict[str, str]
    logprobs: list[tuple[str, float]]  # (token, logprob) of every generated token


def _pairs(logprobs: Any) -> list[tuple[str, float]]:
    return [(t.token, t.logprob) for t in (logprobs.content or [])] if logprobs else []


def chat_turn(client: OpenAI, model: str, conversation: str, messages: list[dict[str, Any]],
              stream: bool, *, max_tokens: int, **extra: Any) -> Turn:
    """A greedy turn of ``conversation`` (its id in the body) with the top-2 logprobs the
    comparison with the plain reference needs; ``extra``: more ``create`` arguments."""
    body = {"conversation_id": conversation, **extra.pop("extra_body", {})}
    kwargs: dict[str, Any] = {"model": model, "messages": messages, "temperature": 0,
                              "max_tokens": max_tokens, "logprobs": True, "top_logprobs": 2,
                              "extra_body": body, **extra}
    if stream:
        with client.chat.completions.with_streaming_response.create(
                stream=True, **kwargs) as response:
            headers = dict(response.headers)
            chunks = [chunk.choices[0] for chunk in response.parse() if chunk.choices]
        text = "".join(choice.delta.content or "" for choice in chunks)
        pairs = [pair for choice in chunks for pair in _pairs(choice.logprobs)]
    else:
        raw = client.chat.completions.with_raw_response.create(**kwargs)
        headers = dict(raw.headers)
        choice = raw.parse().choices[0]
        text, pairs = choice.message.content or "", _pairs(choice.logprobs)
    return Turn(text, headers["x-kvturn-reuse"], int(headers["x-kvturn-reused-tokens"]), headers,
                pairs)
