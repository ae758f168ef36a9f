"""The kvturn router: OpenAI-compatible front door over pools of prefill and decode vLLM
instances, with multi-turn KV reuse (docs/http-api.md).

Names are imported on first use, so that ``kvturn``'s argument parser can take
``add_router_args`` without loading the HTTP stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvturn_server.router._app import RouterApp, create_app, serve
    from kvturn_server.router._config import DecodeSpec, RouterConfig, RouterConfigError
    from kvturn_server.router._flags import add_router_args, router_config_from_args
    from kvturn_server.router._state import MemoryStore, Placement, StoreError
    from kvturn_server.router._transport import PooledTransport
    from kvturn_server.router._wiring import Router

_WHERE = {
    "Router": "_wiring", "RouterApp": "_app", "create_app": "_app", "serve": "_app",
    "DecodeSpec": "_config", "RouterConfig": "_config", "RouterConfigError": "_config",
    "add_router_args": "_flags", "router_config_from_args": "_flags",
    "MemoryStore": "_state", "Placement": "_state", "StoreError": "_state",
    "PooledTransport": "_transport",
}

__all__ = [
    "DecodeSpec",
    "MemoryStore",
    "Placement",
    "PooledTransport",
    "Router",
    "RouterApp",
    "RouterConfig",
    "RouterConfigError",
    "StoreError",
    "add_router_args",
    "create_app",
    "router_config_from_args",
    "serve",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
