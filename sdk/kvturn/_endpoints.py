"""Where the router's own endpoints live, relative to the OpenAI base URL."""

from __future__ import annotations

import httpx2

from kvturn.wire import conversation_path


def router_root(base_url: httpx2.URL) -> str:
    """The router's root URL: the OpenAI ``base_url`` without its trailing ``/v1``.

    The router serves the OpenAI API under ``/v1`` and its own under ``/kvturn/v1`` on the same
    origin, so ``http://host:8000/v1`` gives ``http://host:8000/``. A base URL not ending in
    ``/v1`` (a path prefix added by a proxy, say) is taken as the root itself; pass
    ``kvturn_url=`` to the client when the router's endpoints live elsewhere.
    """
    path = base_url.raw_path.decode("ascii").split("?", 1)[0].rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return str(base_url.copy_with(raw_path=(path + "/").encode("ascii")))


def conversation_url(root: str, conversation_id: str, action: str | None = None) -> str:
    """``{root}/kvturn/v1/conversations/{id}[/{action}]`` with the id percent-encoded: ids may
    contain ``/``, ``:``, ``#``, ``%``, ``?``, ... and every one of them must stay in the
    path segment."""
    return root.rstrip("/") + conversation_path(conversation_id, action)
