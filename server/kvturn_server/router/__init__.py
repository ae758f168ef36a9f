"""The kvturn router: OpenAI-compatible front door over pools of prefill and decode vLLM
instances, with multi-turn KV reuse (docs/http-api.md).

Names are imported on first use, so that ``kvturn``'s argument parser can take
``add_router_args`` without loading the HTTP stack.

Besides the server, the face exports the turn planner (``_plan.py``: ``plan_probe``,
``plan_route``, ``plan_pin``, ``refuse_pin``, ``pin_gone``, ``plan_host_route``,
``settle_prefill``,
``settle_continued``, ``recorded_prefill``, ``moved_from``, ``lost_record``, ``marked_lost``
and their typed inputs and decisions),
the backend choices (``choose_prefill``, ``choose_decode``, ``served_tokens``) and the state
they read (``Pool``, ``Backend``, ``Placement``, ``Transcript``, ``DecodeUsage``,
``ReuseReport``; a backend's state changes only through its ``Pool``'s event methods): the
simulator (``kvturn_server.sim``) decides its turns with them, as the router's ``Turn`` does.
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
    from kvturn_server.router._legs import DecodeUsage, ReuseReport, coverage
    from kvturn_server.router._placement import (
        choose_decode,
        choose_prefill,
        conditional_decode,
        continuation,
        read_floor,
        read_gain,
        served_tokens,
    )
    from kvturn_server.router._plan import (
        NO_PIN,
        PinPlan,
        Refusal,
        RoutePlan,
        Settled,
        TurnPath,
        TurnPolicy,
        gone_reuse,
        lost_record,
        marked_lost,
        moved_from,
        pin_gone,
        plan_host_route,
        plan_pin,
        plan_probe,
        plan_route,
        recorded_prefill,
        refuse_pin,
        settle_continued,
        settle_prefill,
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
    "Transcript": "_history", "coverage": "_legs", "DecodeUsage": "_legs",
    "ReuseReport": "_legs",
    "choose_decode": "_placement", "choose_prefill": "_placement",
    "conditional_decode": "_placement", "continuation": "_placement",
    "read_floor": "_placement", "read_gain": "_placement",
    "served_tokens": "_placement",
    **dict.fromkeys(("NO_PIN", "PinPlan", "Refusal", "RoutePlan", "Settled", "TurnPolicy",
                     "TurnPath", "gone_reuse", "lost_record", "marked_lost", "moved_from",
                     "pin_gone", "plan_host_route", "plan_pin", "plan_probe", "plan_route",
                     "recorded_prefill",
                     "refuse_pin",
                     "settle_continued", "settle_prefill"),
                    "_plan"),
    "Backend": "_pool", "Pool": "_pool",
}

__all__ = [
    "NO_PIN",
    "Backend",
    "DecodeSpec",
    "DecodeUsage",
    "MemoryStore",
    "PinPlan",
    "Placement",
    "Pool",
    "PooledTransport",
    "Refusal",
    "ReuseReport",
    "RoutePlan",
    "Router",
    "RouterApp",
    "RouterConfig",
    "RouterConfigError",
    "Settled",
    "StoreError",
    "Transcript",
    "TurnPath",
    "TurnPolicy",
    "add_router_args",
    "choose_decode",
    "choose_prefill",
    "conditional_decode",
    "continuation",
    "coverage",
    "create_app",
    "gone_reuse",
    "lost_record",
    "marked_lost",
    "moved_from",
    "pin_gone",
    "plan_host_route",
    "plan_pin",
    "plan_probe",
    "plan_route",
    "read_floor",
    "read_gain",
    "recorded_prefill",
    "refuse_pin",
    "router_config_from_args",
    "serve",
    "served_tokens",
    "settings_table",
    "settle_continued",
    "settle_prefill",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
