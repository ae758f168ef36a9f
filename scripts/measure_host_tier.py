"""kvturn's host tier against vLLM's LRU and against none, on a real stack (docs/connector.md,
"The host tier").

For each ``--policies`` entry a small stack of its own (prefill, decode, plain reference,
kvturn's router; a decode of ``--decode-blocks`` blocks, ``--host-blocks`` of host tier on the
prefill and the decode), then the scenario of ``tests/e2e/test_host_tier.py``:

  1. conversations A, B and C, a first turn each (P -> D, retained);
  2. a keepalive of A (its agent runs a tool) and ``--one-offs`` requests of no conversation;
  3. another conversation D whose long turn needs nearly every block of the decode: every
     retention leaves its device KV (live requests first) and its blocks are reused, and in
     host memory D's blocks need room;
  4. A's short next turn, which the router continues on the decode.

``kvturn``: the host tier with kvturn's order (no one-offs stored on the decode; the least
recently used lease goes first: B); ``lru``: vLLM's own policy (``eviction_policy: "lru"``:
A, stored first, goes first); ``off``: no host tier. Prints a JSON line per step (latency, the
decode's prompt tokens by source, host-tier copies, the turn's reuse headers, whether the
answer equals the reference's) and writes them all to ``--json``. Usage:

    .venv/bin/python scripts/measure_host_tier.py [--policies kvturn,lru,off] [--json host.json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvturn_server.local import Stack, StackConfig, free_port, scrape
from kvturn_server.local._metrics import total

PORTS = ("router_port", "prefill_port", "decode_port", "reference_port",
         "prefill_side_channel_port", "decode_side_channel_port", "prefill_control_port",
         "decode_control_port")
BLOCK_BYTES = 256 * 1024  # one 128-token block of the tiny model


def counters(url: str) -> dict[str, float]:
    s = scrape(url)
    name = "vllm:prompt_tokens_by_source_total"
    return {"computed": total(s, name, source="local_compute"),
            "device": total(s, name, source="local_cache_hit"),
            "host": total(s, "vllm:prompt_tokens_cached_by_source_total", source="host"),
            "store_bytes": total(s, "vllm:kv_offload_store_bytes_total"),
            "store_s": total(s, "vllm:kv_offload_store_time_total"),
            "load_bytes": total(s, "vllm:kv_offload_load_bytes_total"),
            "load_s": total(s, "vllm:kv_offload_load_time_total"),
            **{f"evicted_{standing}": total(s, "kvturn:host_evictions_total", standing=standing)
               for standing in ("none", "gone", "leased")}}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before[k], 6) for k in before if after[k] != before[k]}


class Run:
    def __init__(self, cfg: StackConfig, policy: str, seed: int) -> None:
        self.cfg, self.policy = cfg, policy
        rng = random.Random(seed)
        self.rng = rng
        self.vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                                   for _ in range(rng.randint(3, 7))) for _ in range(300)]
        self.rows: list[dict[str, Any]] = []
        self.headers = {"Content-Type": "application/json", "Authorization": "Bearer measure"}

    def keepalive(self, conversation: str) -> None:
        req = urllib.request.Request(
            f"{self.cfg.router_url}/kvturn/v1/conversations/{conversation}/keepalive", b"{}",
            self.headers)
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()

    def text(self, tag: str, words: int) -> str:
        return tag + " " + " ".join(self.rng.choice(self.vocabulary) for _ in range(words))

    def chat(self, url: str, messages: list[dict[str, str]], conversation: str | None,
             max_tokens: int) -> tuple[dict[str, Any], dict[str, str], float]:
        body: dict[str, Any] = {"model": self.cfg.served_model_name, "messages": messages,
                                "temperature": 0, "max_tokens": max_tokens,
                                "return_token_ids": True}
        if conversation is not None:
            body["conversation_id"] = conversation
        req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                     self.headers)
        started = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as resp:
            reply = json.load(resp)
            head = {k.lower(): v for k, v in resp.headers.items()}
        return reply, head, time.perf_counter() - started

    def step(self, tag: str, messages: list[dict[str, str]], conversation: str | None,
             max_tokens: int = 24) -> str:
        cfg = self.cfg
        before = counters(cfg.decode_url), counters(cfg.prefill_url)
        reply, head, seconds = self.chat(cfg.router_url, messages, conversation, max_tokens)
        # A finished request's last blocks are stored at the engine's next step: give it one,
        # so that each step's copies are counted with it (a measurement, not a test).
        time.sleep(0.5)
        row: dict[str, Any] = {"policy": self.policy, "step": tag, "ms": round(seconds * 1000),
                               "prompt": reply["usage"]["prompt_tokens"],
                               "route": head.get("x-kvturn-route"),
                               "reuse": head.get("x-kvturn-reuse"),
                               "reused": head.get("x-kvturn-reused-tokens"),
                               "decode": delta(before[0], counters(cfg.decode_url)),
                               "prefill": delta(before[1], counters(cfg.prefill_url))}
        if conversation is not None:
            plain, _, _ = self.chat(cfg.reference_url, messages, None, max_tokens)
            row["same_as_reference"] = (reply["choices"][0]["token_ids"]
                                        == plain["choices"][0]["token_ids"])
        print(json.dumps(row), flush=True)  # noqa: T201
        self.rows.append(row)
        return str(reply["choices"][0]["message"]["content"])

    def scenario(self, one_offs: int, short: int, long: int) -> None:
        a = [{"role": "user", "content": self.text("conversation A", short)}]
        a.append({"role": "assistant", "content": self.step("A1 P->D, retained", a, "A")})
        for other in ("B", "C"):
            self.step(f"{other}1 P->D, retained",
                      [{"role": "user", "content": self.text(f"conversation {other}", short)}],
                      other)
        self.keepalive("A")
        for i in range(one_offs):
            self.step(f"one-off {i}", [{"role": "user", "content": self.text(f"one {i}", short)}],
                      None, max_tokens=4)
        d = [{"role": "user", "content": self.text("conversation D", long)}]
        self.step("D1 long: pushes A out of device KV", d, "D")
        a.append({"role": "user", "content": self.text("and then", 20)})
        self.step("A2 continued on the decode", a, "A")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="kvturn,lru,off")
    parser.add_argument("--decode-blocks", type=int, default=33)
    parser.add_argument("--host-blocks", type=int, default=40)
    parser.add_argument("--one-offs", type=int, default=3)
    parser.add_argument("--short-words", type=int, default=130)
    parser.add_argument("--long-words", type=int, default=780)
    parser.add_argument("--json", type=Path, default=Path("host-tier.json"))
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for policy in args.policies.split(","):
        state = Path(tempfile.mkdtemp(prefix=f"kvturn-host-{policy}-"))
        cfg = StackConfig(
            state_dir=state, model_dir=state / "model", with_reference=True,
            max_model_len=(args.decode_blocks - 1) * 128, decode_num_blocks=args.decode_blocks,
            retention_budget=0.5, decoder_kv_blocks_ttl=300, retention_max_hold=600,
            kv_offload_gib=0 if policy == "off" else args.host_blocks * BLOCK_BYTES / 2**30,
            kv_offload_extra={} if policy in ("off", "kvturn") else {"eviction_policy": policy},
            prefill_connector_extra={"compute_tokens_per_s": 1.0},
            **{name: free_port() for name in PORTS})
        with Stack(cfg, die_with_parent=True) as stack:
            stack.start()
            run = Run(cfg, policy, seed=26)
            for url in (cfg.prefill_url, cfg.decode_url, cfg.reference_url):  # first forwards
                run.chat(url, [{"role": "user", "content": run.text("warm", 20)}], None, 2)
            run.scenario(args.one_offs, args.short_words, args.long_words)
            rows += run.rows
        print(f"logs in {state / 'logs'}")  # noqa: T201
    args.json.write_text(json.dumps({"decode_blocks": args.decode_blocks,
                                     "host_blocks": args.host_blocks, "steps": rows}, indent=1))


if __name__ == "__main__":
    main()
