"""Measure how far two vLLM paths of one greedy turn round apart (docs/cpu-stack.md).

Starts a private local stack with a reference instance, runs conversations through the router,
asks both for logprobs, and prints per turn: the reuse outcome, the largest and mean difference
of the chosen tokens' logprobs, where the answers part (if they do) and the reference's smallest
top-two gap. As a control, what a wrong block does: the reference on the same history with one
word of the system prompt changed (``wrong_block_*``). Writes all rows as JSON. Usage:

    .venv/bin/python scripts/measure_rounding.py [--conversations 10] [--json rounding.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx2

from kvturn_server.local import Stack, StackConfig, free_port

SYSTEM = "You are a planning agent. " + " ".join(f"Rule {i}: write step {i}." for i in range(60))
QUESTIONS = ["Plan the move of the archive to the new building.",
             "What should happen first, and who does it?", "List the risks of the second step.",
             "Summarise the plan in three lines.", "Which step needs the most people?"]
PORTS = ("router_port", "prefill_port", "decode_port", "reference_port",
         "prefill_side_channel_port", "decode_side_channel_port", "prefill_control_port",
         "decode_control_port")


def _chat(url: str, messages: list[dict[str, Any]], conversation: str | None,
          ) -> tuple[dict[str, Any], httpx2.Headers]:
    body: dict[str, Any] = {"model": "kvturn-tiny", "messages": messages, "temperature": 0,
                            "max_tokens": 140, "logprobs": True, "top_logprobs": 2}
    if conversation:
        body["conversation_id"] = conversation
    reply = httpx2.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    reply.raise_for_status()
    return reply.json(), reply.headers


def _compare(reference: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    ref = reference["choices"][0]["logprobs"]["content"]
    out = got["choices"][0]["logprobs"]["content"]
    differences, parted = [], None
    for i, (a, b) in enumerate(zip(ref, out, strict=False)):
        if a["token"] != b["token"]:
            parted = i
            break
        differences.append(abs(a["logprob"] - b["logprob"]))
    gaps = [t["top_logprobs"][0]["logprob"] - t["top_logprobs"][1]["logprob"] for t in ref]
    # The first token's distribution, compared even where the chosen tokens differ.
    first = {t["token"]: t["logprob"] for t in ref[0]["top_logprobs"]}
    shared = [abs(first[t["token"]] - t["logprob"]) for t in out[0]["top_logprobs"]
              if t["token"] in first]
    return {"max_difference": max(differences, default=0.0),
            "first_token_difference": max(shared) if shared else None,  # no shared top token
            "mean_difference": statistics.fmean(differences) if differences else 0.0,
            "tokens": len(differences), "parted_at": parted, "min_gap": min(gaps),
            "gap_at_parting": gaps[parted] if parted is not None else None}


def _one_word_changed(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # "step 3" -> "step 4" early in the system prompt: the KV of every later position changes,
    # as it would if one block read were wrong.
    system = messages[0]["content"].replace("write step 3.", "write step 4.", 1)
    return [{**messages[0], "content": system}, *messages[1:]]


def _largest(values: Iterable[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{max(known):.2e}" if known else "-"


def _smallest(values: Iterable[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{min(known):.2e}" if known else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--json", type=Path, default=Path("rounding.json"))
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="kvturn-rounding-"))
    cfg = StackConfig(state_dir=state, model_dir=state / "model", with_reference=True,
                      **{name: free_port() for name in PORTS})
    rows = []
    with Stack(cfg, die_with_parent=True) as stack:
        stack.start()
        for _ in range(args.conversations):
            conversation = f"rounding-{uuid.uuid4().hex[:8]}"
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": f"{conversation}. {SYSTEM}"}]
            for question in QUESTIONS:
                messages.append({"role": "user", "content": question})
                reference, _ = _chat(cfg.reference_url, messages, None)
                got, headers = _chat(cfg.router_url, messages, conversation)
                wrong, _ = _chat(cfg.reference_url, _one_word_changed(messages), None)
                control = _compare(reference, wrong)
                row = {"reuse": headers.get("x-kvturn-reuse"), **_compare(reference, got),
                       "wrong_block_first_token_difference":
                           control["first_token_difference"],
                       "wrong_block_parted_at": control["parted_at"]}
                print(json.dumps(row), flush=True)  # noqa: T201
                rows.append(row)
                messages.append({"role": "assistant",
                                 "content": reference["choices"][0]["message"]["content"]})
    args.json.write_text(json.dumps(rows, indent=1))
    for reuse in sorted({r["reuse"] for r in rows}):
        some = [r for r in rows if r["reuse"] == reuse]
        print(f"{reuse}: {len(some)} turns, max difference "  # noqa: T201
              f"{max(r['max_difference'] for r in some):.2e}, mean "
              f"{statistics.fmean(r['mean_difference'] for r in some):.2e}, parted "
              f"{sum(r['parted_at'] is not None for r in some)}; first-token difference "
              f"max {_largest(r['first_token_difference'] for r in some)}; one word changed: "
              f"first-token difference min "
              f"{_smallest(r['wrong_block_first_token_difference'] for r in some)}, parted "
              f"{sum(r['wrong_block_parted_at'] is not None for r in some)}")


if __name__ == "__main__":
    main()
