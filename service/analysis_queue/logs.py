"""Logging: one JSON object per line (or readable lines on a terminal), extras included."""

from __future__ import annotations

import contextvars
import logging
import re
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}
# GET /v1/events takes the user's JWT as ``?access_token=`` (EventSource cannot set headers).
# None of our log calls carries a URL with a query; this keeps any that ever does (an access
# log switched on, a library's message) from writing the token down.
_ACCESS_TOKEN = re.compile(r"(access_token=)[^&\s\"'#]+")


# The X-Request-ID of the request being handled (set by api.request_id_middleware), added to
# every log line written while it runs, across awaits.
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "request_id", default=None
)


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        request_id = request_id_var.get()
        if request_id is not None and not hasattr(record, "request_id"):
            record.request_id = request_id
        return True


def redact(text: str) -> str:
    """``text`` with the value of every ``access_token=`` parameter replaced."""
    return _ACCESS_TOKEN.sub(r"\1[redacted]", text)


class RedactTokens(logging.Filter):
    """Redacts query-string tokens from a record's message and string extras."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "access_token=" in message:
            record.msg, record.args = redact(message), None
        for key, value in _extras(record).items():
            if isinstance(value, str) and "access_token=" in value:
                setattr(record, key, redact(value))
        return True


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_extras(record),
        }
        if record.exc_info and record.exc_info[0] is not None:
            entry["exc_type"] = record.exc_info[0].__name__
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class HumanFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(f"{k}={v}" for k, v in _extras(record).items() if v is not None)
        line = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname:<7} {record.getMessage()}"
        if extras:
            line += f"  {extras}"
        if record.exc_info and record.exc_info[0] is not None:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(level: str = "INFO", *, json_lines: bool | None = None) -> None:
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else HumanFormatter())
    handler.addFilter(RequestIdFilter())
    handler.addFilter(RedactTokens())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
