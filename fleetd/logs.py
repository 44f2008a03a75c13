"""Structured logs: one JSON object per line (or plain text for humans).

Context such as the shard number and session id is attached once with
:func:`set_context`; per-event fields (``connection_id``, ``reason`` …) go in
``extra=``.  picows logs every connect and disconnect at INFO, which at thousands
of connections is noise, so its logger is raised to WARNING.

Both formatters redact URLs in the message, in string fields and in tracebacks
(:func:`fleetd.validation.redact_urls`): an upstream URL's query string may carry a
token, and whoever reads the logs need not see it.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

from fleetd.validation import redact_urls

_RESERVED = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}
_context: dict[str, Any] = {}


def set_context(**fields: Any) -> None:
    """Fields added to every record of this process (e.g. shard, session)."""
    _context.update({k: v for k, v in fields.items() if v is not None})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "event": redact_urls(record.getMessage()),
            **_context,
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                out[key] = redact_urls(value) if isinstance(value, str) else value
        if record.exc_info:
            out["exc"] = redact_urls(self.formatException(record.exc_info))
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = {**_context, **{k: v for k, v in record.__dict__.items()
                                 if k not in _RESERVED and not k.startswith("_")}}
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{stamp} {record.levelname:<7} {record.name}: {record.getMessage()} {extra}".rstrip()
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return redact_urls(line)


def setup(fmt: str = "json", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("picows").setLevel(logging.WARNING)
    logging.getLogger("botocore").setLevel(logging.WARNING)
    logging.getLogger("aiobotocore").setLevel(logging.WARNING)


class RateLimiter:
    """Allows one log line per key per interval, so a flapping upstream cannot flood the logs."""

    __slots__ = ("_last", "interval_s")

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}

    def allow(self, key: str) -> bool:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self.interval_s:
            return False
        if len(self._last) > 10_000:
            self._last.clear()  # bounded memory; worst case a few extra lines
        self._last[key] = now
        return True
