"""A multi-turn chat through the kvturn router with the stock OpenAI client.

Start the local stack first (`.venv/bin/kvturn up`), then run:

    .venv/bin/python examples/chat_through_router.py
"""

from __future__ import annotations

import time

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused-locally")
messages = [{"role": "system", "content": "You are a helpful assistant."}]
for question in ("What is KV cache reuse?", "Why does it help agents?", "Summarise in one line."):
    messages.append({"role": "user", "content": question})
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    for chunk in client.chat.completions.create(
            model="kvturn-tiny", messages=messages, max_tokens=32, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - started
            parts.append(chunk.choices[0].delta.content)
    answer = "".join(parts)
    messages.append({"role": "assistant", "content": answer})
    print(f"TTFT {1000 * (first or 0):.0f} ms | {question} -> {answer[:60]!r}")
