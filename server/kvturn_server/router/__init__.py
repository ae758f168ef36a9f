"""The kvturn router: OpenAI-compatible front door over pools of prefill and decode vLLM
instances, with multi-turn KV reuse (docs/http-api.md).

Names are imported on first use, so that ``kvturn``'s argument parser can take
``add_router_args`` without loading the HTTP stack.

Besides the server, the face exports the router's pure decisions (where a turn runs:
``choose_prefill``, ``choose_decode``, ``continuation``, ``conditional_decode``, the read gain and
floor; how it is reported: ``coverage``, ``gone_reason``) and the state they read (``Pool``,
``Backend``, ``Placement``, ``Transcript``): the simulator (``kvturn_server.sim``) runs them as
they are.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvturn_server.router._app import RouterApp, create_app, serve
    from kvturn_server.router._config import DecodeSpec, RouterConfig, RouterConfigError
    from kvturn_server.router._flags import (
        add_router_args,
        router_config_from_args,
        settings_table,
    )
    from kvturn_server.router._history import Transcript
    from kvturn_server.router._legs import coverage
    from kvturn_server.router._pin import gone_reason
    from kvturn_server.router._placement import (
        choose_decode,
        choose_prefill,
        conditional_decode,
        continuation,
        learn_read_floor,
        read_floor,
        read_gain,
    )
    from kvturn_server.router._pool import Backend, Pool
    from kvturn_server.router._state import MemoryStore, Placement, StoreError
    from kvturn_server.router._transport import PooledTransport
    from kvturn_server.router._wiring import Router

_WHERE = {
    "Router": "_wiring", "RouterApp": "_app", "create_app": "_app", "serve": "_app",
    "DecodeSpec": "_config", "RouterConfig": "_config", "RouterConfigError": "_config",
    "add_router_args": "_flags", "router_config_from_args": "_flags",
    "settings_table": "_flags",
    "MemoryStore": "_state", "Placement": "_state", "StoreError": "_state",
    "PooledTransport": "_transport",
    "Transcript": "_history", "coverage": "_legs", "gone_reason": "_pin",
    "choose_decode": "_placement", "choose_prefill": "_placement",
    "conditional_decode": "_placement", "continuation": "_placement",
    "learn_read_floor": "_placement", "read_floor": "_placement", "read_gain": "_placement",
    "Backend": "_pool", "Pool": "_pool",
}

__all__ = [
    "Backend",
    "DecodeSpec",
    "MemoryStore",
    "Placement",
    "Pool",
    "PooledTransport",
    "Router",
    "RouterApp",
    "RouterConfig",
    "RouterConfigError",
    "StoreError",
    "Transcript",
    "add_router_args",
    "choose_decode",
    "choose_prefill",
    "conditional_decode",
    "continuation",
    "coverage",
    "create_app",
    "gone_reason",
    "learn_read_floor",
    "read_floor",
    "read_gain",
    "router_config_from_args",
    "serve",
    "settings_table",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
