"""pause(): one heartbeat per conversation renews the lease while a tool runs, and never raises.

Intervals are tiny and every wait is on an event or counter with a deadline; after a pause ends
the test joins the heartbeat, so "no more renewals" is a fact, not a hope.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import openai
import pytest

import kvturn
from tests.fakes.router import FakeRouter

INTERVAL = 0.005
MESSAGES = [{"role": "user", "content": "Find flights"}]


def keepalive_threads(conversation: kvturn.Conversation) -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t.name == f"kvturn-keepalive:{conversation.id}" and t.is_alive()]


def keepalives(router: FakeRouter) -> int:
    return len(router.to("/keepalive", method="POST"))


def heartbeat(conversation: kvturn.Conversation | kvturn.AsyncConversation) -> object:
    return conversation._kvturn_conversation.heartbeat


def joined(conversation: kvturn.Conversation) -> bool:
    beat = heartbeat(conversation)
    return beat is None or beat.join(5)  # type: ignore[attr-defined]


@pytest.fixture
def conversation(client: kvturn.OpenAI) -> kvturn.Conversation:
    conversation = client.conversation("trip/1", keepalive_interval=INTERVAL)
    conversation.chat.completions.create(model="kvturn-tiny", messages=MESSAGES)  # type: ignore[arg-type]
    return conversation


def test_a_pause_renews_the_lease_until_it_ends(conversation: kvturn.Conversation,
                                                router: FakeRouter) -> None:
    with conversation.pause("search_flights"):
        assert router.wait_for(lambda: keepalives(router) >= 3)
    assert joined(conversation)
    renewed = keepalives(router)
    assert router.to("/keepalive")[0].raw_path == "/kvturn/v1/conversations/trip%2F1/keepalive"
    assert conversation.stats.keepalives == renewed
    assert keepalives(router) == renewed  # the loop is gone: nothing more can arrive


def test_nested_and_concurrent_pauses_share_one_loop(conversation: kvturn.Conversation,
                                                     router: FakeRouter) -> None:
    inside = threading.Barrier(3, timeout=5)
    leave = threading.Event()

    def tool() -> None:
        with conversation.pause("browse"):
            inside.wait()
            leave.wait(5)

    workers = [threading.Thread(target=tool) for _ in range(2)]
    with conversation.pause("outer"), conversation.pause("inner"):
        for worker in workers:
            worker.start()
        inside.wait()
        assert len(keepalive_threads(conversation)) == 1
        leave.set()
        for worker in workers:
            worker.join(5)
        assert router.wait_for(lambda: keepalives(router) >= 2)
        assert len(keepalive_threads(conversation)) == 1
    assert joined(conversation)
    assert keepalive_threads(conversation) == []


def test_the_loop_stops_when_the_tool_raises(conversation: kvturn.Conversation,
                                             router: FakeRouter) -> None:
    with pytest.raises(RuntimeError, match="tool failed"), conversation.pause("flaky"):
        assert router.wait_for(lambda: keepalives(router) >= 1)
        raise RuntimeError("tool failed")
    assert joined(conversation)
    assert keepalive_threads(conversation) == []


def test_keepalive_failures_are_counted_never_raised(conversation: kvturn.Conversation,
                                                     router: FakeRouter) -> None:
    router.keepalive_status = 503
    with conversation.pause("search"):
        assert router.wait_for(lambda: conversation.stats.keepalive_failures >= 2)
    assert joined(conversation)
    failures = conversation.stats.keepalive_failures
    assert conversation.stats.keepalives == 0
    # best effort: one request per beat, no retries
    assert keepalives(router) == failures


def test_explicit_keepalive(conversation: kvturn.Conversation, router: FakeRouter) -> None:
    lease = conversation.keepalive()
    assert lease == kvturn.Lease(conversation_id="trip/1", retained=True, expires_in=480.0,
                                 hold_remaining=3000.0, num_tokens=router.retained["trip/1"])
    router.keepalive_status = 404
    with pytest.raises(kvturn.ConversationNotFoundError, match="no live retention") as caught:
        conversation.keepalive()
    assert caught.value.status_code == 404
    assert isinstance(caught.value, openai.NotFoundError)


def test_closing_stops_a_running_heartbeat(conversation: kvturn.Conversation,
                                           router: FakeRouter) -> None:
    with conversation.pause("long tool"):
        assert router.wait_for(lambda: keepalives(router) >= 1)
        conversation.close()
        assert joined(conversation)
    assert router.to("", method="DELETE")
    with conversation.pause("after close"):  # a no-op, not an error
        pass


def test_the_interval_must_be_positive(client: kvturn.OpenAI) -> None:
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="keepalive_interval"):
            client.conversation(keepalive_interval=bad)
        with pytest.raises(ValueError, match="keepalive_interval"):
            client.with_options(keepalive_interval=bad)


# --- async ----------------------------------------------------------------------------------

async def eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(INTERVAL / 2)
    return True


@pytest.fixture
async def aconversation(aclient: kvturn.AsyncOpenAI) -> kvturn.AsyncConversation:
    conversation = aclient.conversation("trip/2", keepalive_interval=INTERVAL)
    await conversation.chat.completions.create(model="kvturn-tiny", messages=MESSAGES)  # type: ignore[arg-type]
    return conversation


def heartbeat_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "kvturn-keepalive:trip/2"]


async def test_async_pause_renews_and_stops(aconversation: kvturn.AsyncConversation,
                                            arouter: FakeRouter) -> None:
    async with aconversation.pause("search"):
        assert await eventually(lambda: keepalives(arouter) >= 3)
        assert len(heartbeat_tasks()) == 1
    assert heartbeat_tasks() == []
    assert aconversation.stats.keepalives >= 2


async def test_async_overlapping_pauses_share_one_task(aconversation: kvturn.AsyncConversation,
                                                       arouter: FakeRouter) -> None:
    started = asyncio.Event()
    counts: list[int] = []

    async def tool(seen: int) -> None:
        async with aconversation.pause(f"tool-{seen}"):
            counts.append(len(heartbeat_tasks()))
            if len(counts) == 3:
                started.set()
            await started.wait()
            await eventually(lambda: keepalives(arouter) >= 2)

    async with aconversation.pause("outer"):
        await asyncio.gather(tool(1), tool(2), tool(3))
        assert len(heartbeat_tasks()) == 1
    assert counts == [1, 1, 1]
    assert heartbeat_tasks() == []


async def test_async_pause_stops_on_cancellation_and_errors(
        aconversation: kvturn.AsyncConversation, arouter: FakeRouter) -> None:
    entered = asyncio.Event()

    async def tool() -> None:
        async with aconversation.pause("slow"):
            entered.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(tool())
    await entered.wait()
    assert await eventually(lambda: keepalives(arouter) >= 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert heartbeat_tasks() == []

    with pytest.raises(KeyError):
        async with aconversation.pause("broken"):
            raise KeyError("boom")
    assert heartbeat_tasks() == []


async def test_async_keepalive_failures_never_raise(aconversation: kvturn.AsyncConversation,
                                                    arouter: FakeRouter) -> None:
    arouter.keepalive_status = 404
    async with aconversation.pause("search"):
        assert await eventually(lambda: aconversation.stats.keepalive_failures >= 2)
    with pytest.raises(kvturn.ConversationNotFoundError):
        await aconversation.keepalive()
    arouter.keepalive_status = 200
    lease = await aconversation.keepalive()
    assert lease.retained and lease.conversation_id == "trip/2"
