"""Host fixes that make NIXL usable on small CPU hosts (see docs/cpu-stack.md)."""

from __future__ import annotations

import os
from typing import Any

_applied = False


def apply_nixl_agent_defaults() -> None:
    """Make NIXL agents default to no progress thread unless ``KVTURN_NIXL_PROG_THREAD=1``."""
    global _applied
    if _applied:
        return
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    import nixl._api as nixl_api

    original = nixl_api.nixl_agent_config.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("enable_prog_thread", os.environ.get("KVTURN_NIXL_PROG_THREAD") == "1")
        original(self, *args, **kwargs)

    nixl_api.nixl_agent_config.__init__ = init
    _applied = True
