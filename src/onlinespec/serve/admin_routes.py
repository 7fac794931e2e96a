"""The admin API under ``/admin`` (Bearer ``--admin-key``; off without one): list drafts and
versions (with the training data's governance counts), pause / resume learning, start an update,
roll back, pin a version, purge a request's training records (``POST /admin/data/purge``)."""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request

from onlinespec.serve.handles import NotFound, ServeError
from onlinespec.serve.interface import Core
from onlinespec.serve.web import Access, ServerSettings, read_body

PURGE_BODY = "the body must be {\"request_id\": \"ID\"} or {\"older_than_days\": 30}"


def admin_router(core: Core, settings: ServerSettings, access: Access) -> APIRouter:
    router = APIRouter(prefix="/admin")

    async def operate(request: Request, action: str, name: str | None = None, version: str | None = None):
        access.admin(request)
        if not core.ready:
            raise ServeError(f"not ready: the model is {core.status}")
        return await asyncio.to_thread(core.operate, action, name=name, version=version)

    @router.get("/drafts")
    async def drafts(request: Request):
        access.admin(request)
        if not core.ready:
            return {"learning": None, "drafts": [], "governance": None, "routing": None, "replicas": []}
        return await asyncio.to_thread(lambda: {"learning": core.learning(), "drafts": core.drafts(), "governance": core.governance(),
                                                "routing": core.routing(), "replicas": core.replica_rows()})

    @router.post("/data/purge")
    async def purge(request: Request):
        access.admin(request)
        if not core.ready:
            raise ServeError(f"not ready: the model is {core.status}")
        data = await json_body(request, settings.max_body_bytes)
        if not isinstance(data, dict) or set(data) - {"request_id", "older_than_days"}:
            raise ServeError(PURGE_BODY)
        rid, days = data.get("request_id"), data.get("older_than_days")
        if not isinstance(rid, (str, type(None))) or isinstance(days, bool) or not isinstance(days, (int, float, type(None))):
            raise ServeError(PURGE_BODY)
        return await asyncio.to_thread(core.purge, request_id=rid, older_than_days=days)

    @router.post("/learning/{action}")
    async def learning(request: Request, action: str):
        if action not in ("pause", "resume"):
            raise NotFound(f"unknown learning action {action!r}: use pause or resume")
        return await operate(request, action)

    @router.post("/drafts/{name}/update")
    async def update(request: Request, name: str):
        return await operate(request, "update", name)

    @router.post("/drafts/{name}/rollback")
    async def rollback(request: Request, name: str):
        return await operate(request, "rollback", name)

    @router.post("/drafts/{name}/pin")
    async def pin(request: Request, name: str):
        access.admin(request)
        data = await json_body(request, settings.max_body_bytes)
        version = data.get("version") if isinstance(data, dict) else None
        if not isinstance(data, dict) or not isinstance(version, (str, type(None))):
            raise ServeError("the body must be {\"version\": \"v0003\"} (or {\"version\": null} to unpin)", param="version")
        return await operate(request, "pin", name, version)

    return router


async def json_body(request: Request, limit: int):
    """The body as JSON (empty: ``{}``); None when it is not JSON."""
    try:
        return json.loads(await read_body(request, limit) or b"{}")
    except ValueError:
        return None
