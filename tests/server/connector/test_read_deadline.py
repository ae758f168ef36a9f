"""KVTurnPullWorker abandons reads that stay in flight past kv_read_timeout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvturn_server.connector import ConnectorConfig, _worker
from kvturn_server.connector._worker import KVTurnPullWorker


@dataclass
class FakeNixl:
    """The slice of vLLM's NixlWrapper that polling uses."""

    states: dict[int, str]
    refuse_release: set[int] = field(default_factory=set)
    released: list[int] = field(default_factory=list)

    def check_xfer_state(self, handle: int) -> str:
        return self.states[handle]

    def get_xfer_telemetry(self, handle: int) -> None:
        return None

    def release_xfer_handle(self, handle: int) -> None:
        if handle in self.refuse_release:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        self.released.append(handle)


class FakeStats:
    def __init__(self) -> None:
        self.done = 0
        self.failed = 0
        self.recorded: list[str] = []

    def record(self, key: str, value: object) -> None:
        self.recorded.append(key)

    def record_transfer(self, res: Any) -> None:
        self.done += 1

    def record_failed_transfer(self) -> None:
        self.failed += 1


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(_worker.time, "monotonic", c)
    return c


def make_worker(nixl: FakeNixl, timeout: float = 5.0) -> KVTurnPullWorker:
    # Only the polling path is under test: skip vLLM's constructor (it registers KV caches
    # with a real NIXL agent) and give the object the state polling reads.
    worker = KVTurnPullWorker.__new__(KVTurnPullWorker)
    worker.kvturn_config = ConnectorConfig(kv_read_timeout=timeout)
    worker._read_deadlines = {}
    worker._abandoned = set()
    worker.nixl_wrapper = nixl
    worker.xfer_stats = FakeStats()
    worker.engine_id = "decode-engine"
    worker._recving_metadata = {}
    worker._failed_remote_engines = set()
    return worker


def test_reads_in_flight_before_the_deadline_are_kept(clock: Clock) -> None:
    worker = make_worker(FakeNixl({1: "PROC"}))
    transfers = {"r1": [1]}
    done, failed = worker._pop_done_transfers(transfers)
    clock.now += 4.9
    done2, failed2 = worker._pop_done_transfers(transfers)
    assert (done, failed, done2, failed2) == (set(), set(), set(), set())
    assert transfers == {"r1": [1]}


def test_a_read_past_the_deadline_fails_and_is_released(clock: Clock) -> None:
    nixl = FakeNixl({1: "PROC", 2: "PROC"})
    worker = make_worker(nixl)
    transfers = {"r1": [1, 2]}
    worker._pop_done_transfers(transfers)
    clock.now += 5.0
    done, failed = worker._pop_done_transfers(transfers)
    assert done == set()
    assert failed == {"r1"}
    assert transfers == {}
    assert nixl.released == [1, 2]
    assert worker.xfer_stats.failed == 2
    assert worker._read_deadlines == {}


def test_completed_reads_are_done_and_forget_their_deadline(clock: Clock) -> None:
    nixl = FakeNixl({1: "PROC"})
    worker = make_worker(nixl)
    transfers = {"r1": [1]}
    worker._pop_done_transfers(transfers)
    nixl.states[1] = "DONE"
    clock.now += 1
    done, failed = worker._pop_done_transfers(transfers)
    assert (done, failed) == ({"r1"}, set())
    assert worker.xfer_stats.done == 1
    assert worker._read_deadlines == {}


def test_each_request_has_its_own_deadline(clock: Clock) -> None:
    worker = make_worker(FakeNixl({1: "PROC", 2: "PROC"}))
    transfers = {"old": [1]}
    worker._pop_done_transfers(transfers)
    clock.now += 3
    transfers["new"] = [2]
    worker._pop_done_transfers(transfers)
    clock.now += 2.5
    _, failed = worker._pop_done_transfers(transfers)
    assert failed == {"old"}
    assert transfers == {"new": [2]}


def test_a_handle_nixl_will_not_release_is_kept_but_the_request_is_failed(
        clock: Clock) -> None:
    nixl = FakeNixl({1: "PROC"}, refuse_release={1})
    worker = make_worker(nixl)
    transfers = {"r1": [1]}
    worker._pop_done_transfers(transfers)
    clock.now += 6
    _, failed = worker._pop_done_transfers(transfers)
    # The blocks may still be written by the transport: the handle stays until released.
    assert failed == {"r1"}
    assert transfers == {"r1": [1]}
    nixl.refuse_release.clear()
    clock.now += 1
    _, failed = worker._pop_done_transfers(transfers)
    assert failed == {"r1"}
    assert transfers == {}
    assert worker._abandoned == set()
