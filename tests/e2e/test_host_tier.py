"""The decode's host tier under kvturn's lease, on a real stack of its own.

The session stack has no host tier, so this module starts a small one, once: prefill, decode,
a plain reference and a router with the defaults a user gets (short turns continued on the
decode), with ``kv_offload_gib`` set (vLLM's offloading connector beside kvturn's, with
kvturn's spec: eviction in the lease's order, discards, host loads in the reuse report;
docs/connector.md, "The host tier"). The decode keeps ``DECODE_BLOCKS`` blocks of KV, half of
them for retentions, and ``HOST_BLOCKS`` in host memory: another conversation's long turn pushes
the others out of its device KV, and out of host memory the least recently used lease goes,
not the one an agent kept alive.

The decode serves host reads (``host_reads``): a turn the router does not continue on the decode
whose history the decode keeps in host memory alone is read by the prefill from there.

Every answer is held to the plain reference run (``_greedy``), text and logprobs.
"""

from __future__ import annotations

import hashlib
import random
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from kvturn_server.local import (
    INSTALL_HINT,
    Stack,
    StackConfig,
    free_port,
    scrape,
    vllm_is_installed,
)
from kvturn_server.local._direct import control, retention_path
from kvturn_server.local._http import post_json
from kvturn_server.local._metrics import total
from kvturn_server.local._process import stop_group

from ._forced import ReferenceScorer, scoring_with
from ._helpers import Delta, plain_chat, retention_stats, start_router, wait_until
from ._turns import Turn, assert_same_answer, chat_turn

BLOCK = 128  # tokens of a KV block on the CPU platform
BLOCK_BYTES = 256 * 1024  # one block of the tiny model (2 layers, K and V, 2 x 64, float32)
MAX_MODEL_LEN = 4096
DECODE_BLOCKS = MAX_MODEL_LEN // BLOCK + 1  # one longest request (and vLLM's null block)
RETENTION_BUDGET = 0.5  # 16 blocks
HOST_BLOCKS = 40  # A, B, C (5 blocks each) fit; D (30) only if one of them goes: vLLM's LRU
# would evict A, stored first; kvturn's order the least recently used lease, B
TTL = 300.0  # the leases outlive the module
API_KEY = "host-tier"
SHORT_WORDS = 130  # about 5 full blocks
LONG_WORDS = 780  # about 30 blocks: with its reply, nearly the whole decode
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def host_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not vllm_is_installed():
        pytest.fail(f"e2e tests need the vLLM CPU stack: {INSTALL_HINT}", pytrace=False)
    state = tmp_path_factory.mktemp("host-tier")
    ports = ("router_port", "prefill_port", "decode_port", "reference_port",
             "prefill_side_channel_port", "decode_side_channel_port", "prefill_control_port",
             "decode_control_port")
    cfg = StackConfig(state_dir=state, model_dir=Path(state) / "model", with_reference=True,
                      max_model_len=MAX_MODEL_LEN, decode_num_blocks=DECODE_BLOCKS,
                      retention_budget=RETENTION_BUDGET,
                      kv_offload_gib=HOST_BLOCKS * BLOCK_BYTES / 2**30,
                      decoder_kv_blocks_ttl=TTL, retention_max_hold=2 * TTL,
                      prefill_connector_extra={"compute_tokens_per_s": 1.0},
                      # Prefills read host-only retentions from the decode's host tier.
                      kv_offload_extra={"host_reads": True},
                      **{name: free_port() for name in ports})
    with Stack(cfg, die_with_parent=True) as running:
        running.start()
        with scoring_with(ReferenceScorer(cfg.reference_url, cfg.served_model_name)):
            yield running


class Words:
    """Seeded text of distinct words: a conversation's tag first, so that no two share a
    block."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.rng = rng
        self.vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                                   for _ in range(rng.randint(3, 7))) for _ in range(300)]

    def text(self, tag: str, words: int) -> str:
        return tag + " " + " ".join(self.rng.choice(self.vocabulary) for _ in range(words))


def tenant_key(conversation: str) -> str:
    """The decode's key of a conversation (the router scopes it by the API key's digest)."""
    return f"{hashlib.sha256(f'Bearer {API_KEY}'.encode()).hexdigest()[:16]}/{conversation}"


def decode_counters(cfg: StackConfig) -> dict[str, float]:
    s = scrape(cfg.decode_url)
    return {"host_cached": total(s, "vllm:prompt_tokens_cached_by_source_total", source="host"),
            "host_loaded": total(s, "kvturn:host_loaded_tokens_total"),
            "evicted_leased": total(s, "kvturn:host_evictions_total", standing="leased")}


def turn(cfg: StackConfig, client: OpenAI, conversation: str,
         messages: list[dict[str, Any]]) -> Turn:
    """One turn through the router, held to the reference; its answer joins the history."""
    reference = plain_chat(cfg.reference_url, cfg.served_model_name, messages, MAX_TOKENS)
    answer = chat_turn(client, cfg.served_model_name, conversation, messages, False,
                       max_tokens=MAX_TOKENS)
    assert_same_answer(answer, reference)
    messages.append({"role": "assistant", "content": answer.text})
    return answer


def host_only_history(cfg: StackConfig, client: OpenAI, router_url: str, words: Words,
                      name: str, next_words: int) -> tuple[str, list[dict[str, Any]], int,
                                                            dict[str, Any]]:
    """A conversation whose history the decode keeps in host memory alone: a first turn, a
    short one the decode continues (the prefill's own cache lacks it from then on, as in an
    agent loop where most turns never reach a prefill, so a pin is worth asking for), its
    whole turn copied to the host tier, then another conversation's long turn that pushes it
    out of the decode's device KV while a keepalive holds its lease. Its key, history, retained
    tokens and the decode's description of it."""
    key = f"host-{name}-{uuid.uuid4().hex[:8]}"
    history: list[dict[str, Any]] = [{"role": "user", "content": words.text(key, SHORT_WORDS)}]
    turn(cfg, client, key, history)
    history.append({"role": "user", "content": words.text("and", next_words)})
    assert turn(cfg, client, key, history).headers["x-kvturn-route"] == "decode"
    tokens = describe(cfg, key)[1]["num_tokens"]
    wait_until(lambda: describe(cfg, key)[1].get("host_tokens") == tokens, 10,
               f"{key}'s whole turn in host memory")
    conversation_call(cfg, key, "POST", "/keepalive", router_url)
    other = f"host-{name}-long-{uuid.uuid4().hex[:8]}"
    turn(cfg, client, other, [{"role": "user", "content": words.text(other, LONG_WORDS)}])
    status, spilled = describe(cfg, key)
    assert status == 200 and spilled["where"] == "host", spilled
    return key, history, tokens, spilled


def conversation_call(cfg: StackConfig, conversation: str, method: str, suffix: str = "",
                      router_url: str | None = None) -> None:
    """The router's conversation endpoint, as the SDK calls it (keepalive, release)."""
    request = urllib.request.Request(
        f"{router_url or cfg.router_url}/kvturn/v1/conversations/{conversation}{suffix}",
        method=method,
        data=b"{}" if method == "POST" else None,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200


def describe(cfg: StackConfig, conversation: str) -> tuple[int, dict[str, Any]]:
    return control(cfg.decode_control_url, "GET", retention_path(tenant_key(conversation)))


def direct_turn(cfg: StackConfig, prompt: list[int], key: str | None,
                timeout: float) -> dict[str, Any]:
    """A completion straight on the decode (no router, no prefill): the decode computes what
    its prefix cache lacks and, with ``key``, retains the turn under it."""
    body: dict[str, Any] = {"model": cfg.served_model_name, "prompt": prompt, "max_tokens": 2,
                            "temperature": 0, "ignore_eos": True}
    if key is not None:
        body["kv_transfer_params"] = {"kvturn": {"conversation": key}}
    return post_json(f"{cfg.decode_url}/v1/completions", body, timeout=timeout)


def test_a_request_whose_cached_history_vllm_must_also_take_is_not_left_waiting(
        host_stack: Stack) -> None:
    """Runs first in this module: the decode holds nothing yet.

    A released history is still in the decode's prefix cache, its blocks free. A request that
    hits it needs every one of its blocks from the free pool (vLLM takes the hit's free blocks
    out of it), more than the blocks beyond the hit that the connector made room for: vLLM
    refuses it, and asks again at every step while nothing runs. Each ask after the first
    takes one more retention while the pool could not hold the whole request, so it runs now,
    not when a lease expires (``TTL``, five minutes: the client gives up long before).
    """
    cfg = host_stack.config
    rng = random.Random(31)
    tag = uuid.uuid4().hex[:8]

    def tokens(n_blocks: int) -> list[int]:
        return [rng.randrange(10, 1600) for _ in range(n_blocks * BLOCK)]

    history = tokens(12)
    key = f"e2e/stall-{tag}/history"
    direct_turn(cfg, history, key, timeout=60)
    status, held = control(cfg.decode_control_url, "GET", retention_path(key))
    assert status == 200 and held["num_blocks"] == 12, held
    status, _ = control(cfg.decode_control_url, "DELETE", retention_path(key))
    assert status == 200
    others = [f"e2e/stall-{tag}/other-{i}" for i in range(4)]
    for other in others:  # the retention budget, 16 blocks, filled by four others
        direct_turn(cfg, tokens(4), other, timeout=60)
    before = retention_stats(cfg.decode_control_url)
    assert before["retained_blocks"] == 16, before

    # 12 blocks of history and 16 new ones, and one to grow into: 17 beyond the hit, 29 in all.
    answer = direct_turn(cfg, history + tokens(16), None, timeout=60)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 12 * BLOCK, answer
    after = retention_stats(cfg.decode_control_url)
    # Every other retention had to leave the device: to host memory, under its lease, unless
    # the long request's own blocks pushed it out of there too.
    assert after["retained_blocks"] == 0, after
    evicted = after["events"].get("evicted", 0) - before["events"].get("evicted", 0)
    assert evicted == len(others), (before, after)
    for other in others:
        status, where = control(cfg.decode_control_url, "GET", retention_path(other))
        assert (status == 200 and where["where"] == "host") or (
            status == 404 and where["error"]["code"] == "evicted"), where
        control(cfg.decode_control_url, "DELETE", retention_path(other))


def test_a_conversation_pushed_out_of_device_kv_continues_from_host_memory(
        host_stack: Stack) -> None:
    cfg = host_stack.config
    client = OpenAI(base_url=f"{cfg.router_url}/v1", api_key=API_KEY, max_retries=0)
    words = Words(seed=26)
    a = f"host-a-{uuid.uuid4().hex[:8]}"
    history: list[dict[str, Any]] = [{"role": "user", "content": words.text(a, SHORT_WORDS)}]
    first = turn(cfg, client, a, history)
    assert first.headers["x-kvturn-route"] == "prefill", first.headers
    status, retained = describe(cfg, a)
    assert status == 200, retained
    a_tokens = retained["num_tokens"]
    assert a_tokens >= 4 * BLOCK, retained
    # Its last blocks are copied at the engine step after the one that finished it.
    wait_until(lambda: describe(cfg, a)[1].get("host_tokens") == a_tokens, 10,
               "A's whole turn in host memory")
    assert describe(cfg, a)[1]["where"] == "both"

    # Two more conversations; A's agent keeps its lease alive (a tool is running); then
    # another conversation's long turn needs nearly every block of the decode: live requests
    # come first, so every retention leaves the device and their blocks are reused. In host
    # memory D's blocks need room too: the least recently used lease goes (B), not A.
    others = []
    for name in ("b", "c"):
        other = f"host-{name}-{uuid.uuid4().hex[:8]}"
        turn(cfg, client, other, [{"role": "user", "content": words.text(other, SHORT_WORDS)}])
        others.append(other)
    b_tokens = describe(cfg, others[0])[1]["num_tokens"]
    conversation_call(cfg, a, "POST", "/keepalive")
    before = decode_counters(cfg)
    d_id = f"host-d-{uuid.uuid4().hex[:8]}"
    turn(cfg, client, d_id, [{"role": "user", "content": words.text(d_id, LONG_WORDS)}])
    pressure = {k: v - before[k] for k, v in decode_counters(cfg).items()}
    assert pressure["evicted_leased"] > 0, pressure
    status, spilled = describe(cfg, a)
    assert status == 200 and spilled["where"] == "host", spilled
    assert spilled["num_blocks"] == 0 and spilled["host_tokens"] == a_tokens, spilled
    status, b = describe(cfg, others[0])  # B's host copy went: gone entirely, or its tail
    assert (status == 404 and b["error"]["code"] == "evicted") or b["host_tokens"] < b_tokens, b
    # D itself is larger than the retention budget: kept, in host memory only.
    status, long_one = describe(cfg, d_id)
    assert status == 200 and long_one["where"] == "host", long_one
    assert retention_stats(cfg.decode_control_url)["host_only"] >= 2

    # A's next turn is short: the router continues it on the decode, which loads A's history
    # from host memory and computes only the new part.
    history.append({"role": "user", "content": words.text("and then", 20)})
    before = decode_counters(cfg)
    with Delta(cfg.decode_url) as d, Delta(cfg.prefill_url) as p:
        second = turn(cfg, client, a, history)
    assert second.headers["x-kvturn-route"] == "decode", second.headers
    assert p.value is not None and p.value.computed == 0 and p.value.transferred == 0, p.value
    sources = d.value
    assert sources is not None
    # D reused the device blocks A's history was in; host memory had all of it.
    assert sources.local_cache < a_tokens // 2, sources
    assert sources.transferred > 0, sources
    assert sources.local_cache + sources.transferred >= a_tokens - BLOCK, sources
    assert 0 < sources.computed < 2 * BLOCK, sources
    assert second.reuse in ("hit", "partial"), second.headers
    assert second.reused == sources.local_cache + sources.transferred, (second.headers, sources)
    wait_until(lambda: decode_counters(cfg)["host_loaded"] - before["host_loaded"]
               == sources.transferred, 10, "kvturn's count of host-loaded tokens")
    assert decode_counters(cfg)["host_cached"] - before["host_cached"] == sources.transferred
    # Retained again, on the device (and in host memory).
    status, again = describe(cfg, a)
    assert status == 200 and again["where"] in ("device", "both"), again


def test_a_released_conversation_leaves_host_memory_too(host_stack: Stack) -> None:
    cfg = host_stack.config
    client = OpenAI(base_url=f"{cfg.router_url}/v1", api_key=API_KEY, max_retries=0)
    words = Words(seed=27)
    conversation = f"host-release-{uuid.uuid4().hex[:8]}"
    turn(cfg, client, conversation,
         [{"role": "user", "content": words.text(conversation, SHORT_WORDS)}])
    status, retained = describe(cfg, conversation)
    assert status == 200 and retained["host_tokens"] > 0, retained
    host = retention_stats(cfg.decode_control_url)["host"]
    conversation_call(cfg, conversation, "DELETE")
    # Freed on the engine thread, woken while idle: the control endpoint's stats are live.
    blocks = retained["host_tokens"] // BLOCK
    wait_until(lambda: retention_stats(cfg.decode_control_url)["host"]["discarded"]
               >= host["discarded"] + blocks, 10,
               "the released conversation's host blocks to be freed")
    assert retention_stats(cfg.decode_control_url)["host"]["blocks_used"] \
        <= host["blocks_used"] - blocks
    status, gone = describe(cfg, conversation)
    assert status == 404 and gone["error"]["code"] == "released", gone


@pytest.fixture
def router_at_512(host_stack: Stack, tmp_path: Path) -> Iterator[str]:
    """A router over the host stack continuing turns only up to 512 tokens on the decode (the
    default until session 16): a turn past that fits this stack's 4,096-token context."""
    url, proc = start_router(host_stack.config, "router-512", tmp_path,
                             "--decode-continue-tokens", "512",
                             "--decode-continue-budget", "1024")
    try:
        yield url
    finally:
        stop_group(proc.pid)


def test_a_long_turn_whose_history_only_host_memory_holds_continues_on_the_decode(
        host_stack: Stack, router_at_512: str) -> None:
    """A prefill could read nothing of a host-only retention (no device blocks to pin) and
    would recompute the whole history; the router continues the turn on the decode instead,
    though it is longer than the device's threshold (``decode_continue_host_tokens``)."""
    cfg = host_stack.config
    router_url = router_at_512
    client = OpenAI(base_url=f"{router_url}/v1", api_key=API_KEY, max_retries=0)
    words = Words(seed=28)
    e, history, e_tokens, spilled = host_only_history(cfg, client, router_url, words, "e", 20)
    assert spilled["host_tokens"] == e_tokens, spilled

    # Twice as long as E's history: well past this router's decode_continue_tokens (512).
    history.append({"role": "user", "content": words.text("then read", 2 * SHORT_WORDS)})
    router_before = scrape(router_url)
    before = decode_counters(cfg)
    with Delta(cfg.decode_url) as d, Delta(cfg.prefill_url) as p:
        second = turn(cfg, client, e, history)
    too_long = total(scrape(router_url), "kvturn_router_not_continued_total",
                     why="too_long") - total(router_before, "kvturn_router_not_continued_total",
                                             why="too_long")
    # Continued after all: not among the turns the decode did not continue.
    assert (too_long, second.headers["x-kvturn-route"]) == (0, "decode"), second.headers
    assert p.value is not None and p.value.computed == 0 and p.value.transferred == 0, p.value
    sources = d.value
    assert sources is not None
    # The decode loaded E's history from host memory and computed the new part itself: more
    # than this router continues on a device retention.
    assert sources.local_cache + sources.transferred >= e_tokens - BLOCK, sources
    assert sources.transferred > 0 and sources.computed > 512, sources
    assert second.reused == sources.local_cache + sources.transferred, (second.headers, sources)
    wait_until(lambda: decode_counters(cfg)["host_loaded"] - before["host_loaded"]
               == sources.transferred, 10, "kvturn's count of host-loaded tokens")


@pytest.fixture
def router_reading_host(host_stack: Stack, tmp_path: Path) -> Iterator[str]:
    """A router over the host stack that never continues a host-only history on the decode
    (``--decode-continue-host-tokens 0``): such a turn takes the prefill path, whose prefill
    reads the history from the decode's host tier."""
    url, proc = start_router(host_stack.config, "router-host-reads", tmp_path,
                             "--decode-continue-tokens", "512",
                             "--decode-continue-budget", "1024",
                             "--decode-continue-host-tokens", "0")
    try:
        yield url
    finally:
        stop_group(proc.pid)


def test_a_prefill_reads_a_history_only_host_memory_holds_from_the_decodes_host_tier(
        host_stack: Stack, router_reading_host: str,
        record_property: Callable[[str, object], None]) -> None:
    """A turn not continued on the decode whose history it keeps in host memory alone: the
    router pins the retention there (``host_reads``), and the prefill reads the verified blocks
    from the decode's host tier over NIXL instead of recomputing them."""
    cfg = host_stack.config
    router_url = router_reading_host
    client = OpenAI(base_url=f"{router_url}/v1", api_key=API_KEY, max_retries=0)
    words = Words(seed=29)
    g, history, g_tokens, _ = host_only_history(cfg, client, router_url, words, "g", 60)

    # Past the router's 512 tokens: the prefill path; the host-only history is not continued.
    history.append({"role": "user", "content": words.text("then read", 2 * SHORT_WORDS)})
    host_pins = retention_stats(cfg.decode_control_url)["events"]["host_pinned"]
    with Delta(cfg.prefill_url) as p:
        third = turn(cfg, client, g, history)
    assert third.headers["x-kvturn-route"] == "prefill", third.headers
    # The decode counts the pin it gave for a read of its host tier (and in its metrics).
    assert retention_stats(cfg.decode_control_url)["events"]["host_pinned"] == host_pins + 1
    wait_until(lambda: total(scrape(cfg.decode_url), "kvturn:retention_events_total",
                             event="host_pinned") >= 1, 10, "the host pin in the metrics")
    read = p.value
    assert read is not None
    # Over NIXL (the prefill's own host tier counts apart), whole blocks: from the decode's
    # host tier, as its device holds nothing of G.
    nixl = read.transferred - read.host
    assert nixl >= BLOCK and nixl % BLOCK == 0, (read, third.headers)
    # kvturn's reuse report: the prefill read them (its own cache may add the start).
    assert third.reuse in ("hit", "partial") and third.reused >= nixl, (read, third.headers)
    for name, value in (("history_tokens", g_tokens), ("read_over_nixl", nixl),
                        ("reused_reported", third.reused), ("prefill_computed", read.computed),
                        ("prefill_local_cache", read.local_cache),
                        ("prefill_own_host", read.host)):
        record_property(name, value)
    # The pin went with the turn, and the finished turn is G's retention now (kept in host
    # memory alone from the start when, as here, it is larger than the retention budget).
    wait_until(lambda: retention_stats(cfg.decode_control_url).get("pins", 0) == 0, 10,
               "the host pin released")
    status, again = describe(cfg, g)
    assert status == 200 and again["num_tokens"] > g_tokens, again
