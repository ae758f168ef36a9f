"""The host fixes the connector applies in vLLM's worker process."""

from __future__ import annotations

import os

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


def test_nixl_agents_default_to_no_progress_thread() -> None:
    import nixl._api as nixl_api

    _host.default_nixl_progress_thread(False)
    assert nixl_api.nixl_agent_config(num_threads=4).enable_pthread is False
    assert nixl_api.nixl_agent_config(enable_prog_thread=True).enable_pthread is True
    _host.default_nixl_progress_thread(True)
    try:
        assert nixl_api.nixl_agent_config().enable_pthread is True
    finally:
        _host.default_nixl_progress_thread(False)


def test_amx_permission_is_granted_where_amx_exists() -> None:
    # On hosts without AMX there is nothing to ask for and the call reports success.
    assert _host.request_amx_permission() is True
