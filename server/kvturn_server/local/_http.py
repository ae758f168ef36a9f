"""Plain JSON-over-HTTP calls to vLLM instances (benchmarks and tests measure with these)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """POST ``body`` to ``url`` and return the parsed JSON reply (raises on HTTP errors)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data: dict[str, Any] = json.loads(resp.read())
        return data
