"""Structured, quiet logs: one event name plus key=value fields (or one JSON object per line).

At INFO the router logs only what changes: start-up, backends ejected and re-admitted, decode
restarts. Each request gets one line at DEBUG; failures get a WARNING with the request and
conversation ids.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

_FIELDS = "kvturn_fields"


def event(logger: logging.Logger, level: int, name: str, **fields: Any) -> None:
    """Log event ``name`` with ``fields`` (formatted only when the level is enabled)."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={_FIELDS: fields})


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    if text == "" or any(c in text for c in ' "=\n'):
        return json.dumps(text)
    return text


class KeyValueFormatter(logging.Formatter):
    """``2026-01-01T00:00:00Z INFO kvturn.router backend_ejected role=decode backend=...``"""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = f"{stamp}.{int(record.msecs):03d}Z {record.levelname} {record.name} " \
               f"{record.getMessage()}"
        fields = getattr(record, _FIELDS, None)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items()
                                   if v is not None)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event, then the fields."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname,
                                "logger": record.name, "event": record.getMessage()}
        fields = getattr(record, _FIELDS, None)
        if fields:
            data.update({k: v for k, v in fields.items() if v is not None})
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


def setup_logging(level: str, fmt: str) -> None:
    """Route kvturn's (and uvicorn's) logs to stderr in the chosen format."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("kvturn").setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
