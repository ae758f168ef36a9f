"""The host fixes the connector applies in vLLM's worker process."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from kvturn_server.connector import _host


def test_affinity_changed_inside_the_block_is_restored() -> None:
    before = os.sched_getaffinity(0)
    with _host.keep_thread_affinity():
        os.sched_setaffinity(0, {min(before)})
    assert os.sched_getaffinity(0) == before


def test_affinity_is_left_alone_when_disabled() -> None:
    before = os.sched_getaffinity(0)
    try:
        with _host.keep_thread_affinity(enabled=False):
            os.sched_setaffinity(0, {min(before)})
        assert os.sched_getaffinity(0) == {min(before)}
    finally:
        os.sched_setaffinity(0, before)


def test_nixl_agents_get_the_configured_progress_thread_default() -> None:
    import nixl._api as nixl_api

    _host.configure_nixl_agents(False)
    assert nixl_api.nixl_agent_config(num_threads=4).enable_pthread is False
    assert nixl_api.nixl_agent_config(enable_prog_thread=True).enable_pthread is True
    _host.configure_nixl_agents(True)
    try:
        assert nixl_api.nixl_agent_config().enable_pthread is True
    finally:
        _host.configure_nixl_agents(False)


class _Recorder:
    """The binding module's one call the stand-in changes, recorded; the rest forwarded."""

    constant = "binding attribute"

    def __init__(self) -> None:
        self.agents: list[tuple[str, int]] = []

    def nixlAgent(self, name: str, config: Any) -> str:  # nixl's spelling
        self.agents.append((name, config.pthrDelay))
        return f"agent {name}"


def test_a_progress_thread_waits_for_events_instead_of_spinning() -> None:
    # nixl's Python API sets pthrDelay = 0 (poll() with no timeout: a busy loop); an agent
    # with a progress thread gets the configured delay, one without keeps what it had.
    binding = _host.NixlBindings(_Recorder(), delay_us=10_000)
    threaded = SimpleNamespace(useProgThread=True, pthrDelay=0)
    plain = SimpleNamespace(useProgThread=False, pthrDelay=0)
    assert binding.nixlAgent("decode", threaded) == "agent decode"
    assert binding.nixlAgent("prefill", plain) == "agent prefill"
    assert binding.real.agents == [("decode", 10_000), ("prefill", 0)]
    assert binding.constant == "binding attribute"


def test_the_real_nixl_api_creates_agents_through_the_stand_in() -> None:
    import nixl._api as nixl_api

    _host.configure_nixl_agents(False, delay_ms=2.5)
    try:
        assert isinstance(nixl_api.nixlBind, _host.NixlBindings)
        assert nixl_api.nixlBind.delay_us == 2500
        assert callable(nixl_api.nixlBind.nixlAgentConfig)  # the binding's own, forwarded
    finally:
        _host.configure_nixl_agents(False)


def test_amx_permission_is_granted_where_amx_exists() -> None:
    # On hosts without AMX there is nothing to ask for and the call reports success.
    assert _host.request_amx_permission() is True
