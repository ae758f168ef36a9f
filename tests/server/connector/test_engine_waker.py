"""EngineWaker and Housekeeper: running retention service on vLLM's engine thread when idle.

The engine is a real ``EngineCore`` subclass instance made without its constructor, holding only
the two attributes the waker uses (``tests/server/test_vllm_contract.py`` pins that vLLM's busy
loop drains ``_idle_state_callbacks`` and answers ``WAKEUP``).
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core import EngineCore

from kvturn_server.connector._engine import EngineWaker, Housekeeper


class FakeEngine(EngineCore):  # type: ignore[misc]
    _idle_state_callbacks: list[Callable[[Any], None]]
    input_queue: queue.Queue[tuple[Any, Any]]

    def build_scheduler(self, work: Callable[[], None]) -> EngineWaker:
        # As in vLLM: the engine's constructor builds the scheduler, which builds the
        # connector, which looks for the engine on the stack several frames down.
        return _Scheduler().make_connector(work)

    def notify_idle(self) -> None:
        """What vLLM's idle loop does with the callbacks."""
        while self._idle_state_callbacks:
            self._idle_state_callbacks.pop()(self)


class _Scheduler:
    def make_connector(self, work: Callable[[], None]) -> EngineWaker:
        return EngineWaker.from_stack(work)  # `self` here is not the engine: keep looking


def make_engine() -> FakeEngine:
    engine: FakeEngine = object.__new__(FakeEngine)
    engine._idle_state_callbacks = []
    engine.input_queue = queue.Queue()
    return engine


def drain(q: queue.Queue[Any]) -> list[Any]:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


@pytest.fixture
def engine() -> FakeEngine:
    return make_engine()


def test_from_stack_finds_the_engine_under_construction(engine: FakeEngine) -> None:
    waker = engine.build_scheduler(lambda: None)
    assert waker.attached


def test_without_an_engine_on_the_stack_the_waker_is_detached(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvturn.connector"):
        waker = EngineWaker.from_stack(lambda: None)
    assert not waker.attached
    assert waker.wake() is False
    assert "engine not found" in caplog.text


def test_wake_appends_one_callback_and_posts_one_wakeup(engine: FakeEngine) -> None:
    waker = engine.build_scheduler(lambda: None)
    assert waker.wake() is True
    assert len(engine._idle_state_callbacks) == 1
    assert drain(engine.input_queue) == [(EngineCoreRequestType.WAKEUP, None)]


def test_a_second_wake_before_the_callback_ran_adds_nothing(engine: FakeEngine) -> None:
    waker = engine.build_scheduler(lambda: None)
    assert waker.wake() is True
    assert waker.wake() is True
    assert len(engine._idle_state_callbacks) == 1
    assert len(drain(engine.input_queue)) == 1


def test_running_the_callback_does_the_work_and_allows_the_next_wake(
        engine: FakeEngine) -> None:
    calls: list[str] = []
    waker = engine.build_scheduler(lambda: calls.append(threading.current_thread().name))
    waker.wake()
    assert calls == []  # nothing runs until the engine thread drains its callbacks
    engine.notify_idle()
    assert calls == [threading.current_thread().name]
    assert waker.wake() is True
    assert len(engine._idle_state_callbacks) == 1
    assert len(drain(engine.input_queue)) == 2


def test_a_failing_work_is_logged_and_not_raised_into_the_engine(
        engine: FakeEngine, caplog: pytest.LogCaptureFixture) -> None:
    def work() -> None:
        raise RuntimeError("service broke")

    waker = engine.build_scheduler(work)
    waker.wake()
    with caplog.at_level(logging.ERROR, logger="kvturn.connector"):
        engine.notify_idle()
    assert "retention service on the engine thread failed" in caplog.text
    assert "service broke" in caplog.text
    assert waker.wake() is True  # not stuck pending
    assert len(engine._idle_state_callbacks) == 1


def test_an_engine_without_the_idle_seam_is_not_woken() -> None:
    bare: FakeEngine = object.__new__(FakeEngine)  # no callbacks list, no input queue
    waker = bare.build_scheduler(lambda: None)
    assert waker.attached
    assert waker.wake() is False


def test_the_waker_does_not_keep_a_dead_engine_alive() -> None:
    engine = make_engine()
    waker = engine.build_scheduler(lambda: None)
    del engine
    gc.collect()
    assert not waker.attached
    assert waker.wake() is False


# Housekeeper: wakes the idle engine when the keeper has something due.


class Due:
    """A ``due`` callable that counts its checks; ``checked`` fires after each one."""

    def __init__(self, answers: Callable[[int], bool]) -> None:
        self.answers = answers
        self.calls = 0
        self.checked = threading.Condition()

    def __call__(self) -> bool:
        with self.checked:
            self.calls += 1
            self.checked.notify_all()
            n = self.calls
        return self.answers(n)

    def wait_for_calls(self, n: int, timeout: float = 10.0) -> bool:
        with self.checked:
            return self.checked.wait_for(lambda: self.calls >= n, timeout)


def test_the_housekeeper_wakes_the_engine_only_once_something_is_due(
        engine: FakeEngine) -> None:
    flag = threading.Event()
    due = Due(lambda n: flag.is_set())
    waker = engine.build_scheduler(lambda: None)
    keeper = Housekeeper(due, waker, interval=0.005).start()
    try:
        assert due.wait_for_calls(3)
        assert engine.input_queue.empty()  # checked three times, nothing due, no wake-up
        flag.set()
        assert engine.input_queue.get(timeout=10) == (EngineCoreRequestType.WAKEUP, None)
        assert len(engine._idle_state_callbacks) == 1
    finally:
        keeper.stop()
        keeper._thread.join(timeout=10)
    assert not keeper._thread.is_alive()


def test_the_housekeeper_survives_a_failing_check(engine: FakeEngine,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    def answers(n: int) -> bool:
        if n == 1:
            raise RuntimeError("check broke")
        return True

    waker = engine.build_scheduler(lambda: None)
    with caplog.at_level(logging.ERROR, logger="kvturn.connector"):
        keeper = Housekeeper(Due(answers), waker, interval=0.005).start()
        try:
            assert engine.input_queue.get(timeout=10) == (EngineCoreRequestType.WAKEUP, None)
        finally:
            keeper.stop()
            keeper._thread.join(timeout=10)
    assert "housekeeping check failed" in caplog.text


def test_stop_ends_the_housekeeper_thread() -> None:
    due = Due(lambda n: False)
    keeper = Housekeeper(due, EngineWaker(None, lambda: None), interval=0.005).start()
    assert due.wait_for_calls(1)
    keeper.stop()
    keeper._thread.join(timeout=10)
    assert not keeper._thread.is_alive()  # so no check can come after stop()
