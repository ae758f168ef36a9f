"""vLLM's CPU KV offloading beside kvturn's connector, on a real stack (docs/cpu-stack.md,
"vLLM's CPU offloading").

Starts a private stack (prefill, decode, a plain reference instance, kvturn's router) whose
prefill and decode run vLLM's ``OffloadingConnector`` beside kvturn's in a ``MultiConnector``
with ``--offload-gib`` of host memory each (0: no offloading, the baseline), on a decode of
``--decode-blocks`` blocks, plus a stock conditional-disaggregation router over the same instances
(``--no-kv-reuse --conditional-disagg 512``). Then, each answer compared with the reference's
token for token (greedy):

  A. a kvturn conversation: P -> D over NIXL; a turn whose prefill leg reads the decode's
     retention; a short turn;
  B. stock-cond: a conversation's first turn (P -> D), rounds of concurrent one-off requests
     that push it out of the decode's device KV, then its short follow-up, which the router
     sends to the decode alone;
  C. the same for a kvturn conversation (retained on the decode) whose follow-up the decode
     continues;
  D. a kvturn conversation whose retention a request too large for the rest of the decode's KV
     evicts, then its follow-up, which the decode continues.

Prints a JSON line per turn: latency, route, kvturn's reuse report, and the prompt tokens' sources
on both instances (computed; from the device prefix cache, the host tier, a NIXL transfer) with
the host tier's copy bytes and seconds; writes them all to ``--json``. Usage:

    .venv/bin/python scripts/measure_offload.py [--offload-gib 0.25] \
        [--offload-extra '{"offload_prompt_only": false}'] [--json offload.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvturn_server.local import Stack, StackConfig, free_port, scrape
from kvturn_server.local._metrics import total
from kvturn_server.local._process import ServerSpec, launch, stop_group, wait_healthy

PORTS = ("router_port", "prefill_port", "decode_port", "reference_port",
         "prefill_side_channel_port", "decode_side_channel_port", "prefill_control_port",
         "decode_control_port")
SOURCES = "vllm:prompt_tokens_by_source_total"
CACHED = "vllm:prompt_tokens_cached_by_source_total"


def counters(url: str) -> dict[str, float]:
    """What one instance has counted so far: prompt tokens by source, host-tier copies,
    retention events."""
    s = scrape(url)
    return {
        "computed": total(s, SOURCES, source="local_compute"),
        "device": total(s, CACHED, source="device"),
        "host": total(s, CACHED, source="host"),
        "transferred": total(s, SOURCES, source="external_kv_transfer"),
        "store_bytes": total(s, "vllm:kv_offload_store_bytes_total"),
        "store_s": total(s, "vllm:kv_offload_store_time_total"),
        "load_bytes": total(s, "vllm:kv_offload_load_bytes_total"),
        "load_s": total(s, "vllm:kv_offload_load_time_total"),
        "nixl_failed": total(s, "vllm:nixl_num_failed_transfers_total"),
        "preempted": total(s, "vllm:num_preemptions_total"),
        "retained": total(s, "kvturn:retention_events_total", event="created"),
        "evicted": total(s, "kvturn:retention_events_total", event="evicted"),
    }


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before[k], 4) for k in before if after[k] != before[k]}


class Probe:
    def __init__(self, cfg: StackConfig, seed: int, words: int) -> None:
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.vocabulary = [" " + "".join(self.rng.choice("abcdefghijklmnopqrstuvwxyz")
                                         for _ in range(self.rng.randint(2, 7)))
                           for _ in range(400)]
        self.words = words
        self.rows: list[dict[str, Any]] = []

    def text(self, words: int | None = None) -> str:
        return "".join(self.rng.choice(self.vocabulary)
                       for _ in range(words or self.words)).strip()

    def chat(self, url: str, messages: list[dict[str, str]], conversation: str | None,
             max_tokens: int) -> tuple[dict[str, Any], dict[str, str], float]:
        body = {"model": self.cfg.served_model_name, "messages": messages, "temperature": 0,
                "max_tokens": max_tokens, "logprobs": True, "return_token_ids": True}
        headers = {"Content-Type": "application/json"}
        if conversation is not None:
            headers["X-Conversation-ID"] = conversation
        req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                     headers)
        started = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as resp:
            reply = json.load(resp)
            head = {k.lower(): v for k, v in resp.headers.items()}
        return reply, head, time.perf_counter() - started

    def turn(self, tag: str, url: str, messages: list[dict[str, str]], conversation: str | None,
             max_tokens: int) -> str:
        cfg = self.cfg
        before = counters(cfg.decode_url), counters(cfg.prefill_url)
        reply, head, seconds = self.chat(url, messages, conversation, max_tokens)
        after = counters(cfg.decode_url), counters(cfg.prefill_url)
        plain, _, _ = self.chat(cfg.reference_url, messages, None, max_tokens)
        choice, ref = reply["choices"][0], plain["choices"][0]
        same = choice["token_ids"] == ref["token_ids"]
        row = {"turn": tag, "ms": round(seconds * 1000), "prompt": reply["usage"]["prompt_tokens"],
               "route": head.get("x-kvturn-route"), "reuse": head.get("x-kvturn-reuse"),
               "reused": head.get("x-kvturn-reused-tokens"), "same_as_reference": same,
               "max_logprob_difference": max(
                   abs(a["logprob"] - b["logprob"]) for a, b in
                   zip(choice["logprobs"]["content"], ref["logprobs"]["content"],
                       strict=True)) if same else None,
               "decode": delta(before[0], after[0]), "prefill": delta(before[1], after[1])}
        print(json.dumps(row), flush=True)  # noqa: T201
        self.rows.append(row)
        return str(choice["message"]["content"])

    def push_out(self, url: str, rounds: int, concurrent: int, words: int | None = None) -> None:
        """Concurrent one-off requests (no conversation id) until the decode's device KV has
        turned over: together they need more blocks than it has."""
        for i in range(rounds):
            before = counters(self.cfg.decode_url)
            batch = [[{"role": "user", "content": self.text(words)}] for _ in range(concurrent)]
            with ThreadPoolExecutor(concurrent) as pool:
                list(pool.map(lambda m: self.chat(url, m, None, 4), batch))
            row = {"turn": f"push-out round {i}", "requests": concurrent,
                   "decode": delta(before, counters(self.cfg.decode_url))}
            print(json.dumps(row), flush=True)  # noqa: T201
            self.rows.append(row)


def stock_cond_router(cfg: StackConfig, threshold: int) -> tuple[str, int]:
    port = free_port()
    spec = ServerSpec(
        name="router-stock-cond", port=port, health_url=f"http://127.0.0.1:{port}/health",
        log_path=cfg.state_dir / "logs" / "router-stock-cond.log", env={"PYTHONUNBUFFERED": "1"},
        argv=[sys.executable, "-m", "kvturn_server.cli", "router", "--port", str(port),
              "--prefill", cfg.prefill_url,
              "--decode", f"{cfg.decode_url},control={cfg.decode_control_url}",
              "--no-kv-reuse", "--conditional-disagg", str(threshold)])
    proc = launch(spec, die_with_parent=True)
    wait_healthy({spec.name: (spec, proc)}, timeout=60)
    return f"http://127.0.0.1:{port}", proc.pid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--offload-gib", type=float, default=0.25,
                        help="host tier per instance in GiB; 0: no offloading (the baseline)")
    parser.add_argument("--offload-extra", type=json.loads, default={},
                        help="JSON object merged into the offloading connector's extra config")
    parser.add_argument("--decode-blocks", type=int, default=80,
                        help="KV blocks of the decode (128 tokens each)")
    parser.add_argument("--words", type=int, default=900,
                        help="words of a first message (about 4 tokens each)")
    parser.add_argument("--push-out-rounds", type=int, default=3)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=Path("offload.json"))
    args = parser.parse_args()

    state = Path(tempfile.mkdtemp(prefix="kvturn-offload-"))
    cfg = StackConfig(
        state_dir=state, model_dir=args.model_dir or state / "model", with_reference=True,
        decode_num_blocks=args.decode_blocks, kv_offload_gib=args.offload_gib,
        kv_offload_extra=args.offload_extra, decoder_kv_blocks_ttl=120,
        # Every verified range is read, whatever the timings (as the e2e stack does).
        prefill_connector_extra={"compute_tokens_per_s": 1.0},
        **{name: free_port() for name in PORTS})
    probe = Probe(cfg, seed=7, words=args.words)
    started = time.monotonic()
    with Stack(cfg, die_with_parent=True) as stack:
        stack.start()
        stock, stock_pid = stock_cond_router(cfg, 512)
        print(json.dumps({"stack_healthy_s": round(time.monotonic() - started)}),  # noqa: T201
              flush=True)
        for url in (cfg.prefill_url, cfg.decode_url, cfg.reference_url):  # first forwards
            probe.chat(url, [{"role": "user", "content": probe.text(50)}], None, 2)
        kvturn = cfg.router_url

        history = [{"role": "user", "content": probe.text()}]
        reply = probe.turn("A1 kvturn P->D", kvturn, history, "A", 300)
        history += [{"role": "assistant", "content": reply},
                    {"role": "user", "content": probe.text(args.words // 2)}]
        reply = probe.turn("A2 kvturn, the prefill reads the retention", kvturn, history, "A", 24)
        history += [{"role": "assistant", "content": reply},
                    {"role": "user", "content": probe.text(40)}]
        probe.turn("A3 kvturn, short turn", kvturn, history, "A", 24)

        b = [{"role": "user", "content": probe.text()}]
        b_reply = probe.turn("B1 stock-cond P->D", stock, b, "B", 300)
        c = [{"role": "user", "content": probe.text()}]
        c_reply = probe.turn("C1 kvturn P->D, retained", kvturn, c, "C", 300)
        probe.push_out(stock, args.push_out_rounds, 3)
        b += [{"role": "assistant", "content": b_reply},
              {"role": "user", "content": probe.text(40)}]
        probe.turn("B2 stock-cond follow-up on the decode alone", stock, b, "B", 24)
        c += [{"role": "assistant", "content": c_reply},
              {"role": "user", "content": probe.text(40)}]
        probe.turn("C2 kvturn follow-up the decode continues", kvturn, c, "C", 24)

        d = [{"role": "user", "content": probe.text()}]
        d_reply = probe.turn("D1 kvturn P->D, retained", kvturn, d, "D", 300)
        # About 60 blocks: more than the decode has beside D's retention, which is evicted.
        probe.push_out(stock, 1, 1, words=args.words * 19 // 10)
        d += [{"role": "assistant", "content": d_reply},
              {"role": "user", "content": probe.text(40)}]
        probe.turn("D2 kvturn follow-up after its retention was evicted", kvturn, d, "D", 24)
        stop_group(stock_pid)
    args.json.write_text(json.dumps({"offload_gib": args.offload_gib,
                                     "offload_extra": args.offload_extra,
                                     "decode_blocks": args.decode_blocks,
                                     "turns": probe.rows}, indent=1))
    print(f"logs in {state / 'logs'}; results in {args.json}")  # noqa: T201


if __name__ == "__main__":
    main()
