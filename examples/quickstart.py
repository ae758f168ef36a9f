"""Quickstart: a 5-turn conversation through the kvturn router with the kvturn SDK.

Each turn extends the previous one exactly (the reply is sent back as received), so from the
second turn on the router can reuse the KV the decode kept from the turn before. Per turn it
prints the router's reuse outcome, the reused prompt tokens and the time to the first token;
at the end it releases the conversation's retention.

Start the local stack first (``.venv/bin/kvturn up``), then::

    .venv/bin/python examples/quickstart.py
    .venv/bin/python examples/quickstart.py --base-url http://10.0.0.5:8000/v1 --model my-model

Environment: ``KVTURN_BASE_URL``, ``KVTURN_MODEL``, ``OPENAI_API_KEY`` (flags win).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import openai

import kvturn

QUESTIONS = (
    "In two sentences, what is a KV cache?",
    "Why does a multi-turn agent recompute it on every turn?",
    "How can the previous turn's cache be reused instead?",
    "What could make a reused cache wrong?",
    "Summarise our conversation in one line.",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=os.environ.get("KVTURN_BASE_URL",
                                                             "http://127.0.0.1:8000/v1"),
                        help="the router's OpenAI base URL (default: %(default)s)")
    parser.add_argument("--model", default=os.environ.get("KVTURN_MODEL", "kvturn-tiny"),
                        help="served model name (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused-locally"),
                        help="sent as the bearer token; the router scopes conversations by it")
    parser.add_argument("--turns", type=int, default=5, choices=range(1, len(QUESTIONS) + 1),
                        metavar=f"1-{len(QUESTIONS)}", help="number of turns (default: 5)")
    parser.add_argument("--max-tokens", type=int, default=140,
                        help="tokens per answer (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds per request (default: %(default)s)")
    return parser.parse_args(argv)


def run_turn(chat: kvturn.Conversation, model: str, messages: list[dict[str, Any]],
             max_tokens: int) -> tuple[kvturn.TurnInfo | None, float | None, str, str]:
    """Stream one turn; return the router's report, TTFT, and the reply's text and reasoning."""
    started = time.perf_counter()
    first: float | None = None
    content: list[str] = []
    reasoning: list[str] = []
    stream = chat.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                          max_tokens=max_tokens, temperature=0, stream=True)
    report = chat.last_turn  # the router's headers arrive before the first token
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        piece = (delta.model_extra or {}).get("reasoning") or ""
        if delta.content or piece:
            first = first if first is not None else time.perf_counter() - started
        content.append(delta.content or "")
        reasoning.append(piece)
    return report, first, "".join(content), "".join(reasoning)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    client = kvturn.OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=args.timeout,
                           max_retries=1)
    try:
        client.models.list()  # fail fast, with a clear message, when nothing is there
    except openai.APIConnectionError:
        print(f"error: nothing answers at {args.base_url}. Start the local stack with "
              "`.venv/bin/kvturn up`, or pass --base-url / set KVTURN_BASE_URL.",
              file=sys.stderr)
        return 2
    except openai.APIStatusError as error:
        print(f"error: {args.base_url} answered {error.status_code}: {error.message}",
              file=sys.stderr)
        return 2

    with client, client.conversation() as chat:
        print(f"conversation {chat.id} on {args.base_url} ({args.model})")
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
        for number, question in enumerate(QUESTIONS[: args.turns], start=1):
            messages.append({"role": "user", "content": question})
            try:
                report, ttft, answer, reasoning = run_turn(chat, args.model, messages,
                                                           args.max_tokens)
            except openai.OpenAIError as error:
                print(f"error: turn {number} failed: {error}", file=sys.stderr)
                return 1
            # Send the reply back exactly as generated (reasoning included): anything else is
            # not an extension of the decode's retained KV, and the SDK would say so.
            reply: dict[str, Any] = {"role": "assistant", "content": answer}
            if reasoning:
                reply["reasoning"] = reasoning
            messages.append(reply)
            outcome = (report.reuse or "unreported") if report else "unreported"
            tokens = report.reused_tokens if report else 0
            reason = report.no_reuse_reason if report else None
            hint = f" (sent no-reuse: {reason})" if reason else ""
            ttft_text = f"{ttft * 1000:7.1f} ms" if ttft is not None else "      - ms"
            print(f"turn {number}: reuse={outcome:<15} reused_tokens={tokens:>6}  "
                  f"TTFT {ttft_text}{hint}  | {answer.strip()[:60]!r}")
        stats = chat.stats
        print(f"{stats.turns} turns, {stats.hits} reused, {stats.reused_tokens} prompt tokens "
              f"reused; misses: {dict(stats.misses) or 'none'}")
    if chat.stats.release_failures:
        print(f"could not release conversation {chat.id}; its lease will expire on its own")
    else:
        print(f"released conversation {chat.id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
