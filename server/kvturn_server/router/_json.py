"""JSON encoding on the request path: orjson when installed (bodies can be 100s of KB), else
the standard library. Both produce compact UTF-8 and read the same documents."""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is in the [router] extra
    orjson = None  # type: ignore[assignment]


if orjson is not None:
    JSONDecodeError: type[ValueError] = orjson.JSONDecodeError

    def loads(data: bytes | bytearray | str) -> Any:
        return orjson.loads(data)

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
else:  # pragma: no cover
    JSONDecodeError = json.JSONDecodeError

    def loads(data: bytes | bytearray | str) -> Any:
        return json.loads(data)

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
