"""The kvturn router: OpenAI-compatible front door over prefill and decode vLLM instances."""

from kvturn_server.router._app import Router, create_app, serve
from kvturn_server.router._config import RouterConfig

__all__ = ["Router", "RouterConfig", "create_app", "serve"]
