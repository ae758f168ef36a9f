"""One chat turn, as the stock ``openai`` client (or the kvturn SDK wrapping it) sends it
(streamed or not): the text, every token's id and logprob, and through a router its reuse
report and headers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openai import OpenAI

from ._greedy import TOP, assert_same_text


def answer_fields(**extra_body: Any) -> dict[str, Any]:
    """``create`` arguments that give an answer what the comparison with the reference needs
    (top-2 logprobs, token ids); ``extra_body``: more fields of the request body."""
    return {"logprobs": True, "top_logprobs": TOP,
            "extra_body": {"return_token_ids": True, **extra_body}}


@dataclass
class Answer:
    text: str
    ids: list[int]  # every generated token's id
    logprobs: list[tuple[str, float]]  # (token, logprob) of every generated token


def _ids(choice: Any) -> list[int]:
    return list((choice.model_extra or {}).get("token_ids") or [])


def _pairs(logprobs: Any) -> list[tuple[str, float]]:
    return [(t.token, t.logprob) for t in (logprobs.content or [])] if logprobs else []


def answer_of(result: Any, stream: bool) -> Answer:
    """The answer in a ``create`` result (a completion, or the chunks of a stream) of a
    request made with ``answer_fields()``."""
    if stream:
        chunks = [chunk.choices[0] for chunk in result if chunk.choices]
        return Answer("".join(choice.delta.content or "" for choice in chunks),
                      [token for choice in chunks for token in _ids(choice)],
                      [pair for choice in chunks for pair in _pairs(choice.logprobs)])
    choice = result.choices[0]
    return Answer(choice.message.content or "", _ids(choice), _pairs(choice.logprobs))


@dataclass
class Turn(Answer):
    reuse: str
    reused: int
    headers: dict[str, str]


def assert_same_answer(answer: Answer, reference: dict[str, Any]) -> None:
    """The answer's text, token ids and logprobs are the reference's (``_greedy``)."""
    assert_same_text(answer.text, reference, answer.ids, answer.logprobs)



def chat_turn(client: OpenAI, model: str, conversation: str, messages: list[dict[str, Any]],
              stream: bool, *, max_tokens: int, **extra: Any) -> Turn:
    """A greedy turn of ``conversation`` (its id in the body) with what the comparison with
    the plain reference needs; ``extra``: more ``create`` arguments (``extra_body`` merged)."""
    kwargs: dict[str, Any] = {"model": model, "messages": messages, "temperature": 0,
                              "max_tokens": max_tokens,
                              **answer_fields(**{"conversation_id": conversation,
                                                 **extra.pop("extra_body", {})}), **extra}
    if stream:
        with client.chat.completions.with_streaming_response.create(
                stream=True, **kwargs) as response:
            headers = dict(response.headers)
            answer = answer_of(response.parse(), stream=True)
    else:
        raw = client.chat.completions.with_raw_response.create(**kwargs)
        headers = dict(raw.headers)
        answer = answer_of(raw.parse(), stream=False)
    return Turn(answer.text, answer.ids, answer.logprobs, headers["x-kvturn-reuse"],
                int(headers["x-kvturn-reused-tokens"]), headers)
