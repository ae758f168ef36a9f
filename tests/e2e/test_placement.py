"""Turns the decode continues itself, through the real stack (router/_placement.py).

A second router over the session's prefill and decode runs with the defaults a user gets
(kv-aware placement, decode continuation of turns up to 2,048 new tokens). Every answer is
held to the plain reference run, text and logprobs.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import pytest
from openai import OpenAI

import kvturn
from kvturn_server.local import Stack
from kvturn_server.local._direct import control, retention_path
from kvturn_server.local._process import stop_group
from kvturn_server.router._identity import conversation_key

from ._helpers import (
    Delta,
    metric,
    plain_chat,
    post,
    retention_stats,
    start_router,
    wait_until,
)
from ._settings import DECODE_BLOCKS, RETENTION_TTL
from ._turns import Answer, answer_fields, answer_of, assert_same_answer, chat_turn

MAX_TOKENS = 64
SYSTEM = "You are a careful tool agent. " + " ".join(
    f"Tool {i} reads file {i} and reports line {i}." for i in range(40))
STEPS = ["Read the first file.", "Now read the second file.", "Compare the two reports.",
         "Write the summary of both files."]


@pytest.fixture(scope="module")
def router_url(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("placement-router")
    url, proc = start_router(stack.config, "placement-router", logs)
    try:
        yield url
    finally:
        stop_group(proc.pid)


@pytest.fixture(scope="module")
def router_at_512(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The same at a continuation threshold of 512 (the default until session 16): the memory
    pressure test's histories (about 600 tokens) are sized for it."""
    logs = tmp_path_factory.mktemp("placement-router-512")
    url, proc = start_router(stack.config, "placement-router-512", logs,
                             "--decode-continue-tokens", "512", "--decode-continue-budget", "1024")
    try:
        yield url
    finally:
        stop_group(proc.pid)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_short_turns_run_on_the_decode_alone_and_long_ones_read_what_the_prefill_lacks(
        stack: Stack, router_url: str, stream: bool) -> None:
    cfg = stack.config
    client = OpenAI(base_url=f"{router_url}/v1", api_key="tenant-p", max_retries=0)
    conversation = f"placement-{uuid.uuid4().hex}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"{conversation}. {SYSTEM}"}]
    for number, step in enumerate(STEPS, start=1):
        messages.append({"role": "user", "content": step})
        reference = plain_chat(cfg.reference_url, cfg.served_model_name, messages, MAX_TOKENS)
        with Delta(cfg.prefill_url) as p, Delta(cfg.decode_url) as d:
            turn = chat_turn(client, cfg.served_model_name, conversation, messages, stream,
                             max_tokens=MAX_TOKENS)
        text, headers = turn.text, turn.headers
        assert_same_answer(turn, reference)
        assert p.value is not None and d.value is not None
        if number == 1:
            assert headers["x-kvturn-route"] == "prefill", headers
        else:
            # No prefill leg: the prefill saw nothing; the decode computed only the new part
            # (its partial last block and the new message), the rest from its own cache.
            assert headers["x-kvturn-route"] == "decode", (number, headers)
            assert p.value.computed == 0 and p.value.transferred == 0, p.value
            assert 0 < d.value.computed < 256, d.value
            assert d.value.local_cache > 0 and d.value.transferred == 0, d.value
            if stream:
                # Sent before the decode ran: what its cache supplied is not known yet.
                assert (turn.reuse, turn.reused) == ("pending", 0), headers
            else:
                # The decode's prefix cache supplied the history: exactly what it reports.
                assert turn.reuse in ("hit", "partial"), headers
                assert turn.reused == d.value.local_cache, (headers, d.value)
        messages.append({"role": "assistant", "content": text})
    # A long tool result: past the continuation bound, so a prefill leg computes it, reading
    # from the decode the blocks its own cache lacks (the turns it never saw).
    messages.append({"role": "user", "content": " ".join(["file"] * 3000)})
    reference = plain_chat(cfg.reference_url, cfg.served_model_name, messages, MAX_TOKENS)
    with Delta(cfg.prefill_url) as p:
        turn = chat_turn(client, cfg.served_model_name, conversation, messages, stream,
                         max_tokens=MAX_TOKENS)
    headers = turn.headers
    assert_same_answer(turn, reference)
    assert headers["x-kvturn-route"] == "prefill", headers
    assert headers["x-kvturn-prefill-choice"] == "holder", headers
    assert headers["x-kvturn-reuse"] in ("hit", "partial"), headers
    reused = int(headers["x-kvturn-reused-tokens"])
    assert p.value is not None and reused > 0 and reused == p.value.transferred, (reused, p.value)
    # The prefill's own cache supplied the first turn's prompt; the decode what came after.
    assert p.value.local_cache > 0, p.value
    # Done, as an agent's SDK says at the end: its 30-odd blocks leave the decode's retention
    # (the memory-pressure test below sizes its fillers to what the decode holds).
    done = httpx2.delete(f"{router_url}/kvturn/v1/conversations/{conversation}",
                         headers={"Authorization": "Bearer tenant-p"}, timeout=10)
    assert done.status_code == 200, done.text


# Memory pressure: a continued turn whose retention was evicted.

BLOCK = 128  # vLLM's CPU KV block size
FILLER_TOKENS = 7040  # 55 blocks; the tiny model's limit is 8,192 tokens


def _sdk_turn(conversation: Any, model: str, messages: list[dict[str, Any]],
              stream: bool) -> tuple[Answer, dict[str, str], Any]:
    """A greedy turn through the kvturn SDK: the answer, the router's headers, the usage (a
    stream asks for it, so that the SDK settles a pending report from it)."""
    kwargs: dict[str, Any] = {"model": model, "messages": messages, "temperature": 0,
                              "max_tokens": MAX_TOKENS, **answer_fields()}
    if stream:
        result = conversation.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs)
        headers = dict(result.response.headers)
        chunks = list(result)
        return answer_of(chunks, stream=True), headers, chunks[-1].usage
    raw = conversation.chat.completions.with_raw_response.create(**kwargs)
    reply = raw.parse()
    return answer_of(reply, stream=False), dict(raw.headers), reply.usage


def _push_out(stack: Stack, renew: Callable[[], None]) -> tuple[list[str], float]:
    """Evict every retention on the decode and overwrite its blocks, so that nothing of an
    evicted conversation stays in the decode's prefix cache either, in the few seconds the
    stack's 12 s lease leaves after ``renew`` (the leases and the router's records renewed).

    vLLM keeps freed blocks in a queue, least recently freed first: a new block is taken from
    its head (its cached content dropped), a block freed (a finished request's, an evicted
    retention's) goes to its end, and a request whose prompt is cached takes those blocks out
    of the queue without computing them, and frees them again at its end. So, before
    ``renew``, fillers whose prompts take all but less than one filler of the free blocks
    make the queue theirs but for that rest. Then, each costing next to nothing as their
    prompts are cached: two of them retained again fill the retention budget, which evicts
    every other retention (a renewal counts as use, so the renewed ones are older than the
    fillers); the others asked again move their blocks behind the evicted ones; and new
    prompts take the rest and the evicted blocks from the head of the queue. The fillers'
    retention keys, and the seconds from ``renew`` to the end."""
    cfg = stack.config
    rng = random.Random(uuid.uuid4().hex)

    def fresh() -> list[int]:
        return [rng.randrange(10, 1600) for _ in range(FILLER_TOKENS)]

    def complete(prompt: list[int], key: str | None = None) -> None:
        body: dict[str, Any] = {"model": cfg.served_model_name, "prompt": prompt,
                                "max_tokens": 1}
        if key is not None:  # retained, as a turn the decode continues alone is
            body["kv_transfer_params"] = {"do_remote_prefill": False,
                                          "kvturn": {"conversation": key}}
        post(f"{cfg.decode_url}/v1/completions", body)

    per = FILLER_TOKENS // BLOCK
    stats = retention_stats(cfg.decode_control_url)
    assert 2 * per > stats["budget_blocks"] >= per, (per, stats)
    free = DECODE_BLOCKS - 1 - stats["held_blocks"]  # vLLM keeps block 0 for itself
    fillers = [fresh() for _ in range(free // per)]
    for prompt in fillers:
        complete(prompt)
    renew()
    started = time.monotonic()
    keys = [f"filler/{uuid.uuid4().hex}" for _ in range(2)]
    for prompt, key in zip(fillers[-2:], keys, strict=True):
        complete(prompt, key)
    for prompt in fillers[:-2]:
        complete(prompt)
    # Ahead of the evicted conversations' blocks: the rest (< one filler) and the retentions
    # evicted before them (with them, < the budget less a filler's).
    for _ in range(2):
        complete(fresh())
    return keys, time.monotonic() - started


def test_a_continued_turn_whose_retention_was_evicted_reports_what_the_decode_reused(
        stack: Stack, router_at_512: str, say: Any) -> None:
    """Under memory pressure the router's record outlives the decode's KV: the turn still
    continues on the decode (the record says it holds the conversation), finds nothing,
    computes the whole prompt, and says so (``miss``, 0 tokens: what the decode's own
    metrics say its cache supplied), streamed or not; the record is then the new turn's
    retention. A keepalive the decode answers ``evicted`` marks the record lost: the router asks
    the decode what its prefix cache kept of the history (nothing: the fillers took its blocks),
    and the next turn takes a prefill leg instead of having the decode recompute the history
    (more than the router's threshold, 512 here)."""
    router_url = router_at_512
    cfg = stack.config
    model = cfg.served_model_name
    client = kvturn.OpenAI(base_url=f"{router_url}/v1", api_key="tenant-e", max_retries=0)
    streamed, plain, kept = (client.conversation(f"evicted-{uuid.uuid4().hex}")
                             for _ in range(3))
    histories: dict[str, list[dict[str, Any]]] = {}
    for conversation in (streamed, plain, kept):
        messages = [{"role": "system", "content": f"{conversation.id}. {SYSTEM}"},
                    {"role": "user", "content": STEPS[0]}]
        answer, headers, _ = _sdk_turn(conversation, model, messages, stream=False)
        assert headers["x-kvturn-route"] == "prefill", headers
        histories[conversation.id] = [*messages, {"role": "assistant", "content": answer.text},
                                      {"role": "user", "content": STEPS[1]}]
    references = {cid: plain_chat(cfg.reference_url, model, messages, MAX_TOKENS)
                  for cid, messages in histories.items()}

    # The pressure, with the records and the leases renewed first (the stack's lease is 12 s).
    def renew() -> None:
        for conversation in (streamed, plain, kept):
            conversation.keepalive()

    fillers, took = _push_out(stack, renew)
    renewed = time.monotonic() - took
    say(f"memory pressure on the decode: {took:.1f} s")
    for conversation in (streamed, plain, kept):
        status, body = control(cfg.decode_control_url, "GET",
                               retention_path(conversation_key(conversation.id,
                                                               "Bearer tenant-e")))
        assert (status, body.get("error", {}).get("code")) == (404, "evicted"), \
            (status, body, took)
        assert body["cached_tokens"] == 0, body  # the fillers took every block
    short_before = metric(router_url, "kvturn_router_continued_short_total")

    for conversation, stream in ((streamed, True), (plain, False)):
        # Still inside the lease the router recorded: it sends the turn to the decode alone.
        assert time.monotonic() - renewed < RETENTION_TTL - 1, (
            f"the pressure took {took:.1f} s: the router's record expired before the turn")
        messages = histories[conversation.id]
        with Delta(cfg.prefill_url) as p, Delta(cfg.decode_url) as d:
            answer, headers, usage = _sdk_turn(conversation, model, messages, stream)
        assert_same_answer(answer, references[conversation.id])
        assert p.value is not None and d.value is not None
        assert headers["x-kvturn-route"] == "decode", headers
        assert p.value.computed == 0 and p.value.transferred == 0, p.value
        # The decode found nothing of the conversation and computed the whole prompt.
        assert d.value.local_cache == 0 and d.value.computed == usage.prompt_tokens, \
            (d.value, usage)
        assert usage.prompt_tokens_details.cached_tokens == 0, usage
        if stream:
            # The headers went out before the decode computed anything; the usage settled it.
            assert (headers["x-kvturn-reuse"], headers["x-kvturn-reused-tokens"],
                    headers["x-kvturn-block-size"]) == ("pending", "0", str(BLOCK)), headers
        else:
            assert (headers["x-kvturn-reuse"], headers["x-kvturn-reused-tokens"]) == \
                ("miss", "0"), headers
        turn = conversation.last_turn
        assert turn is not None and (turn.reuse, turn.reused_tokens) == ("miss", 0), turn
        histories[conversation.id] = [*messages, {"role": "assistant", "content": answer.text},
                                      {"role": "user", "content": STEPS[2]}]
    assert metric(router_url, "kvturn_router_continued_short_total") == short_before + 2

    # The capture recorded what the decode retained of that turn: the next one reuses it, and
    # says exactly what the decode's cache supplied.
    messages = histories[streamed.id]
    reference = plain_chat(cfg.reference_url, model, messages, MAX_TOKENS)
    with Delta(cfg.decode_url) as d:
        answer, headers, usage = _sdk_turn(streamed, model, messages, stream=True)
    assert_same_answer(answer, reference)
    assert d.value is not None and headers["x-kvturn-route"] == "decode", headers
    turn = streamed.last_turn
    assert turn is not None and turn.reuse in ("hit", "partial"), turn
    assert turn.reused_tokens == d.value.local_cache == \
        usage.prompt_tokens_details.cached_tokens > 0, (turn, d.value)

    # A keepalive the decode answers "evicted": the router marks the record lost, asks the
    # decode what its cache kept of the history (nothing), and the next turn takes a prefill
    # leg instead of continuing on a decode that holds nothing.
    with pytest.raises(kvturn.ConversationNotFoundError):
        kept.keepalive()
    messages = histories[kept.id]
    probes = metric(router_url, "kvturn_router_leg_seconds_count", leg="probe")
    answer, headers, _ = _sdk_turn(kept, model, messages, stream=False)
    assert metric(router_url, "kvturn_router_leg_seconds_count", leg="probe") == probes + 1
    assert_same_answer(answer, references[kept.id])
    # Its report says why, as a pin that found the retention gone would.
    assert (headers["x-kvturn-route"], headers["x-kvturn-reuse"]) == ("prefill", "stale"), \
        headers
    for conversation in (streamed, plain, kept):
        conversation.close()
    client.close()
    for key in fillers:
        control(cfg.decode_control_url, "DELETE", retention_path(key))



def test_a_turn_whose_lease_ran_out_continues_on_what_the_decode_still_caches(
        stack: Stack, router_url: str) -> None:
    """A retention whose lease ran out was only freed: with nothing else on the decode its
    blocks stay in the prefix cache. The router, knowing the lease gone (a keepalive answered
    ``expired``), asks the decode what it kept (``cached_tokens`` of a describe's ``404``) and
    continues the turn there, which computes only the new part, as a stock router's decode
    would."""
    cfg = stack.config
    model = cfg.served_model_name
    client = OpenAI(base_url=f"{router_url}/v1", api_key="tenant-l", max_retries=0)
    conversation = f"lapsed-{uuid.uuid4().hex}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"{conversation}. {SYSTEM}"},
                                      {"role": "user", "content": STEPS[0]}]
    first = chat_turn(client, model, conversation, messages, False, max_tokens=MAX_TOKENS)
    assert first.headers["x-kvturn-route"] == "prefill", first.headers
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": STEPS[1]}]
    key = conversation_key(conversation, "Bearer tenant-l")
    wait_until(lambda: control(cfg.decode_control_url, "GET", retention_path(key))[0] == 404,
               RETENTION_TTL + 10, "the lease to run out")
    status, body = control(cfg.decode_control_url, "GET", retention_path(key))
    assert (status, body["error"]["code"]) == (404, "expired"), body
    assert body["cached_tokens"] > 0, body
    # The router learns it from a keepalive: the record is marked lost.
    gone = httpx2.post(f"{router_url}/kvturn/v1/conversations/{conversation}/keepalive",
                       headers={"Authorization": "Bearer tenant-l"}, timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "expired", gone.text
    reference = plain_chat(cfg.reference_url, model, messages, MAX_TOKENS)
    probes = metric(router_url, "kvturn_router_leg_seconds_count", leg="probe")
    with Delta(cfg.prefill_url) as p, Delta(cfg.decode_url) as d:
        turn = chat_turn(client, model, conversation, messages, False, max_tokens=MAX_TOKENS)
    assert_same_answer(turn, reference)
    assert metric(router_url, "kvturn_router_leg_seconds_count", leg="probe") == probes + 1
    assert p.value is not None and d.value is not None
    assert turn.headers["x-kvturn-route"] == "decode", turn.headers
    assert p.value.computed == 0 and p.value.transferred == 0, p.value
    # The decode's own cache supplied the history the describe said it kept, and the turn
    # reports exactly that.
    assert 0 < d.value.local_cache <= body["cached_tokens"], (d.value, body)
    assert turn.reuse in ("hit", "partial") and turn.reused == d.value.local_cache, turn.headers
