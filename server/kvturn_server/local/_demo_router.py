"""The demo's stock router: ``kvturn router`` with the stock flags on the stack's own prefill and
decode, beside the stack's kvturn router, for as long as the demo runs.

It is the router ``kvturn bench agent`` runs its stock modes through (the same flags, the
decode's control endpoint given as there, which a router without reuse only asks which engine it
is), started on a free port of the router's address with its log in
``<state_dir>/logs/router-stock.log``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvturn_server._control_secret import ENV, ENV_FILE
from kvturn_server.local._process import (
    ServerSpec,
    free_port,
    http_url,
    launch,
    stop_group,
    wait_healthy,
)
from kvturn_server.local._secret import SECRET_FILE
from kvturn_server.local._stack_config import StackConfig

NAME = "router-stock"


def stock_router_spec(cfg: StackConfig, args: Sequence[str], port: int) -> ServerSpec:
    """``kvturn router`` over ``cfg``'s prefill and decode with ``args``, on ``port``."""
    host = cfg.host_of("router")
    argv = [sys.executable, "-m", "kvturn_server.cli", "router", "--host", host,
            "--port", str(port), "--prefill", cfg.prefill_url,
            "--decode", f"{cfg.decode_url},control={cfg.decode_control_url}", *args]
    env = {"PYTHONUNBUFFERED": "1"}
    secret_file = cfg.state_dir / SECRET_FILE
    if not os.environ.get(ENV) and not os.environ.get(ENV_FILE) and secret_file.is_file():
        # A stack started from another shell (kvturn up): its secret is in its state dir.
        env[ENV_FILE] = str(secret_file)
    return ServerSpec(name=NAME, argv=argv, port=port, health_url=f"{http_url(host, port)}/health",
                      log_path=cfg.state_dir / "logs" / f"{NAME}.log", env=env, host=host)


@contextmanager
def stock_router(cfg: StackConfig, args: Sequence[str],
                 timeout: float = 60.0) -> Iterator[str]:
    """Run the stock router while the block runs; yields its URL."""
    spec = stock_router_spec(cfg, args, free_port(cfg.host_of("router")))
    proc = launch(spec, die_with_parent=True)
    try:
        wait_healthy({spec.name: (spec, proc)}, timeout=timeout)
        yield http_url(spec.host, spec.port)
    finally:
        stop_group(proc.pid)
