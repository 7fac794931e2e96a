"""The server's log on stderr: one JSON object a line (or plain text), with a timestamp and a level.

Every line has ``ts`` (ISO-8601, UTC, milliseconds), ``level``, ``logger`` and ``msg``, then the
fields its caller gave (``extra={"fields": {...}}``): the request log (``onlinespec.requests``,
:mod:`onlinespec.serve.writer`) its figures, the access log (``onlinespec.access``,
:class:`AccessLog`) the method, path, status, duration and request id. Never a body, a header
but the request id, or a key; prompt and output text only with ``--log-text``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("json", "text")
access_log = logging.getLogger("onlinespec.access")


@dataclass(frozen=True)
class LogSettings:
    level: str = "info"  # debug, info (request and access lines), warning or error
    format: str = "json"  # json: one object a line; text: ts LEVEL logger msg {fields}

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"--log-level {self.level!r}: use one of {', '.join(LEVELS)}")
        if self.format not in FORMATS:
            raise ValueError(f"--log-format {self.format!r}: use json or text")


def _head(record: logging.LogRecord) -> dict:
    ts = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return {"ts": ts, "level": record.levelname, "logger": record.name, "msg": record.getMessage()}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = _head(record)
        for key, value in (getattr(record, "fields", None) or {}).items():
            line.setdefault(key, value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        head, fields = _head(record), getattr(record, "fields", None)
        text = f"{head['ts']} {head['level']} {head['logger']} {head['msg']}" + (f" {json.dumps(fields, default=str)}" if fields else "")
        return text + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


def configure_logging(settings: LogSettings | None = None) -> str:
    """Send our loggers' and uvicorn's lines to stderr in ``settings``' format and level; return
    the level for uvicorn (its info lines only at debug: they say nothing per request)."""
    settings = settings or LogSettings()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.format == "json" else TextFormatter())
    level = getattr(logging, settings.level.upper())
    uvicorn_level = "debug" if level == logging.DEBUG else max(settings.level, "warning", key=LEVELS.index)
    for name, lvl in (("onlinespec", level), ("uvicorn", getattr(logging, uvicorn_level.upper()))):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(lvl)
        logger.propagate = False
    for name in ("onlinespec.requests", "onlinespec.access"):  # a level set before (a replica's earlier setup) gives way
        logging.getLogger(name).setLevel(logging.NOTSET)
        logging.getLogger(name).handlers = []
        logging.getLogger(name).propagate = True
    return uvicorn_level


PROBES = frozenset({"/health", "/ready", "/metrics"})  # polled every few seconds by load balancers and Prometheus


class AccessLog:
    """ASGI middleware: one ``onlinespec.access`` line per HTTP request once its response has
    ended: method, path (no query string), status, seconds, request id, client address. A probe
    (:data:`PROBES`) that succeeds logs at DEBUG, so a health check every few seconds does not
    bury the requests; a failing one logs at INFO like any other request."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, seen = time.perf_counter(), {"status": 500, "request_id": None}

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                seen["request_id"] = next((v.decode("latin-1") for k, v in message.get("headers", ()) if k.lower() == b"x-request-id"), None)
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            asked = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
            client = scope.get("client")
            path = scope.get("path", "")
            level = logging.DEBUG if path in PROBES and seen["status"] < 400 else logging.INFO
            access_log.log(level, "access", extra={"fields": {
                "method": scope.get("method"), "path": path[:256], "status": seen["status"],
                "duration_seconds": round(time.perf_counter() - start, 6),
                "request_id": (seen["request_id"] or asked or "")[:128] or None, "client": client[0] if client else None}})
