"""What every route of the HTTP app shares: the server's settings, who may call (API keys, the
tenant a key stands for or the tenant header picks among the key's, the admin key), bounded
request bodies, and OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from onlinespec.safety import check_label, key_tenant, same_key, shown
from onlinespec.serve.handles import NotFound, Overloaded, ServeError


@dataclass
class ServerSettings:
    model_name: str = "default"  # the `model` clients send, and responses report
    aliases: tuple[str, ...] = ()  # more names clients may send (vLLM's --served-model-name a b: a is reported)
    api_key: str | None = None  # Bearer key for /v1 routes (None: open, unless api_keys); written as in api_keys
    api_keys: tuple[str, ...] = ()  # several keys, each "KEY" (a tenant of its own) or "KEY TENANT[,TENANT...]" (key_entry)
    tenant_header: str | None = None  # this header picks one of the key's tenants (an open server: any tenant); absent: the key's first
    admin_key: str | None = None  # Bearer key for /admin routes (None: the admin API is off)
    max_body_bytes: int = 1 << 20
    drain_seconds: float = 30.0  # SIGTERM: how long requests in flight may finish
    body_timeout: float = 30.0  # seconds a request's body may take to arrive, once its headers have: then 408, connection closed
    max_connections: int = 1000  # open connections (and requests in flight) past which new requests get 503 (uvicorn's limit_concurrency)
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open
    refusal_rate: float = 5.0  # a caller's 401 and 403 answers per second past a burst of 20; more wait (RefusalLimiter; 0: off)
    load_in_background: bool = True  # answer /health while the model loads
    tool_call_parser: str = "auto"  # the format of tool calls (onlinespec.serve.tools: auto, generic or hermes)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request's ``model`` may give, the reported one first."""
        return (self.model_name, *(a for a in self.aliases if a != self.model_name))

    def check_model(self, name: str | None) -> None:
        """A 404 naming the served models unless ``name`` is one (None: not given, accepted)."""
        if name is not None and name not in self.names:
            served = ", ".join(repr(n) for n in self.names)
            raise NotFound(f"model {shown(name)} is not served here: use {served} (GET /v1/models)", param="model", code="model_not_found")


class Unauthorized(ServeError):
    status, kind = 401, "authentication_error"


class Forbidden(ServeError):
    status, kind = 403, "permission_error"


class TooLarge(ServeError):
    status = 413


class RequestTimeout(ServeError):
    status = 408


def error_response(err: ServeError, request_id: str | None = None) -> JSONResponse:
    headers = {"X-Request-Id": request_id} if request_id else {}
    if isinstance(err, Overloaded):
        headers["Retry-After"] = str(err.retry_after)
    if isinstance(err, RequestTimeout):  # the rest of a trickled body is not waited for: the connection closes
        headers["Connection"] = "close"
    body = {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}
    return JSONResponse(body, status_code=err.status, headers=headers)


def key_entry(entry: str) -> tuple[str, tuple[str, ...]]:
    """An API key as given (a line of ``--api-key-file``, ``--api-key``, ``ONLINESPEC_API_KEY``):
    ``KEY``, a tenant of its own (:func:`onlinespec.safety.key_tenant`), or ``KEY TENANT[,TENANT...]``,
    the tenants it may act for, the first its default. A ``ValueError`` names a tenant that is
    not a label (never the key)."""
    key, rest = (entry.split(None, 1) + [""])[:2]
    if not key:
        raise ValueError("an API key is empty: give one per line")
    tenants = tuple(dict.fromkeys(t.strip() for t in rest.split(",") if t.strip()))
    for tenant in tenants:
        check_label(tenant, "an API key's tenant")
    return key, tenants or (key_tenant(key),)


class Access:
    """Who may call: the API keys guard /v1, each acting for its own tenants; the admin key /admin."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.keys: dict[str, tuple[str, ...]] = {}  # key -> the tenants it may act for, its default first
        for key, tenants in map(key_entry, [*([settings.api_key] if settings.api_key else []), *settings.api_keys]):
            self.keys[key] = tuple(dict.fromkeys([*self.keys.get(key, ()), *tenants]))

    def tenant(self, request: Request) -> str:
        """Check the API key; return the request's tenant (docs/serve.md, "Tenants"): the key's
        own, or the one the tenant header picks among the key's (403 otherwise); on an open
        server (no keys) the header's, else ``default``."""
        given, header = request.headers.get("authorization", ""), self.settings.tenant_header
        matched = [key for key in self.keys if same_key(given, f"Bearer {key}")]  # every key compared: no early exit
        if self.keys and not matched:
            raise Unauthorized("missing or wrong API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")
        allowed = self.keys[matched[0]] if matched else ("default",)
        value = request.headers.get(header) if header else None
        if value is None:
            return allowed[0]
        try:
            check_label(value, f"the {header} header")
        except ValueError as err:
            raise ServeError(str(err), param=header, code="invalid_tenant") from None
        if matched and value not in allowed:  # a key acts for its own tenants only; an open server trusts its clients
            raise Forbidden(f"the {header} header names a tenant this API key may not act for: leave the header out "
                            f"(the key's own tenant) or name one given to this key", param=header, code="tenant_not_allowed")
        return value

    def metrics(self, request: Request) -> None:
        """``/metrics`` carries client-chosen labels (every tenant's request domains): when API keys
        guard /v1 it needs the admin key, or, on a server without one, an API key (401 otherwise);
        an open server's is open (docs/serve.md, "Metrics")."""
        if not self.keys:
            return
        given, admin = request.headers.get("authorization", ""), self.settings.admin_key
        keys = [admin] if admin else list(self.keys)
        if not [key for key in keys if same_key(given, f"Bearer {key}")]:  # every key compared: no early exit
            who = "the admin key" if admin else "an API key"
            raise Unauthorized(f"GET /metrics needs {who} on this server (its labels name every tenant's domains): "
                               f"send 'Authorization: Bearer <key>'", code="invalid_api_key")

    def admin(self, request: Request) -> None:
        """Check the admin key (the admin API is off without one)."""
        key = self.settings.admin_key
        if key is None:
            raise Forbidden("the admin API is off: start the server with --admin-key")
        if not same_key(request.headers.get("authorization", ""), f"Bearer {key}"):
            raise Unauthorized("missing or wrong admin key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")


REFUSALS = (401, 403)  # the refusals RefusalLimiter counts: a wrong key, a tenant the key may not act for


class RefusalLimiter:
    """A per-caller rate limit on refused requests (issue 46). A client that floods the server with
    requests it refuses (a tenant header naming tenants its key may not act for, a wrong key) cost
    the event loop hundreds of answers a second, taken from every tenant's streams; past a burst
    of ``burst`` refusals, a caller's are answered ``rate`` a second, each later one held back
    (an asyncio sleep: no work) by what its bucket lacks, at most ``longest`` seconds, with
    ``Retry-After``. The answer is the same; requests the server serves are never held. The
    caller is its key for a 403 (the key is valid), its address for a 401 (any key may be sent);
    the callers kept are bounded (least recent out)."""

    def __init__(self, rate: float, burst: int = 20, longest: float = 10.0, callers: int = 4096) -> None:
        self.rate, self.burst, self.longest, self.callers = rate, burst, longest, callers
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # caller -> (refusals left, when)

    def wait(self, request: Request, status: int) -> float:
        """Seconds to hold this refusal back (0: answer now); counts it (on the event loop only)."""
        if not self.rate or status not in REFUSALS:
            return 0.0
        given = request.headers.get("authorization", "") if status == 403 else (request.client.host if request.client else "")
        caller = hashlib.sha256(f"{status // 2}:{given}".encode()).hexdigest()[:24]  # never the key itself
        now = time.monotonic()
        left, when = self._buckets.pop(caller, (float(self.burst), now))
        left = max(min(self.burst, left + (now - when) * self.rate) - 1, -self.longest * self.rate)
        self._buckets[caller] = (left, now)
        if len(self._buckets) > self.callers:
            self._buckets.popitem(last=False)
        return 0.0 if left >= 0 else min(-left / self.rate, self.longest)


async def read_body(request: Request, limit: int, deadline: float | None = None) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes, declared or sent; a declared size
    that is not a number of bytes is a 400; a body not all there within ``deadline`` seconds
    (``--body-timeout``: a client trickling it holds a connection) is a 408 that closes the
    connection."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):  # "²" is a digit to str.isdigit, not to int()
            raise ServeError(f"the Content-Length header {shown(declared)} is invalid: give the body's size in bytes",
                             param="Content-Length", code="invalid_content_length")
        if len(declared) > 18 or int(declared) > limit:  # int() refuses thousands of digits
            raise TooLarge(f"the body has {declared[:20]} bytes: the limit is {limit}", code="body_too_large")
    try:
        return await asyncio.wait_for(_collect(request, limit), deadline)
    except TimeoutError:
        raise RequestTimeout(f"the request's body did not arrive within {deadline:g} s (--body-timeout): send it whole, "
                             f"at once", code="body_timeout") from None


async def _collect(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the body is over the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)
