"""The coordinator's live status page: plain HTML + one script, no build step, no CDN.

Auth: the page is the admin's. ``GET /v1/ui?token=<admin>`` (or ``POST /v1/ui/login`` with a
``token`` form field, which keeps the token out of URLs) answers with a redirect to ``/v1/ui``
and an HttpOnly, SameSite=Strict session cookie scoped to ``/v1/ui`` (``Secure`` under TLS).
The cookie holds an HMAC of the admin token, not the token, and only opens the page's own
read-only routes; the rest of the API still wants a bearer token. Without a valid cookie or
admin bearer token the page answers 401 with a login form and no run data.

Routes (all GET unless noted): ``/v1/ui`` the page (state inlined, so it renders at once),
``/v1/ui/state`` the same state as JSON (polled by the page), ``/v1/ui/status.js`` and
``/v1/ui/status.css``, ``POST /v1/ui/login``, ``POST /v1/ui/logout``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from crossfed.coordinator.service import Coordinator, CoordinatorError

STATIC = Path(__file__).with_name("static")
COOKIE = "crossfed_ui"
COOKIE_PATH = "/v1/ui"
SESSION_S = 12 * 3600
LIVE_S = 30.0  # a site heard from within this many seconds (or holding a lease) is live
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def session_value(admin_token: str) -> str:
    """The cookie's value: derived from the admin token, useless as an API token."""
    return hmac.new(admin_token.encode(), b"crossfed-ui-session-v1", hashlib.sha256).hexdigest()


def page_state(
    coordinator: Coordinator, http: dict[str, Any] | None = None, now: float | None = None
) -> dict[str, Any]:
    """Everything the page shows, as plain JSON: round, sites with leases, ledger, losses."""
    now = time.time() if now is None else now
    try:
        status = coordinator.status()
    except CoordinatorError as exc:
        if exc.code != "no_run":
            raise
        return {"run": False, "now": now, "http": http or {}}
    leases: dict[str, list[dict[str, Any]]] = {}
    for lease in status["active_leases"]:
        leases.setdefault(lease["site"], []).append(lease)
    sites = []
    for row in coordinator.sites_view():
        held = leases.get(row["site"], [])
        seen = row["last_seen"]
        sites.append(
            {
                **row,
                "seen_s_ago": None if seen is None else max(0.0, now - seen),
                "live": bool(held) or (seen is not None and now - seen <= LIVE_S),
                "leases": [
                    {
                        "lease_id": lease["lease_id"],
                        "round": lease["round"],
                        "consumed": lease["consumed"],
                        "n_blocks": lease["n_blocks"],
                        "expires_in_s": lease["expires_at"] - now,
                    }
                    for lease in held
                ],
            }
        )
    status = {k: v for k, v in status.items() if k != "active_leases"}
    return {
        "run": True,
        "now": now,
        "status": status,
        "sites": sites,
        "ledger": coordinator.ledger_table(),
        "history": coordinator.round_history(),
        "http": http or {},
    }


def _finite(value: Any) -> Any:
    """NaN and infinities become null (JSON has no spelling for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def state_json(state: dict[str, Any]) -> str:
    """JSON safe to inline in a <script type="application/json"> element."""
    text = json.dumps(_finite(state), allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(state: dict[str, Any]) -> str:
    template = (STATIC / "status.html").read_text()
    return template.replace("{{STATE}}", state_json(state))


def login_page(message: str) -> str:
    return (STATIC / "login.html").read_text().replace("{{MESSAGE}}", _escape(message))


def _escape(text: str) -> str:
    return (
        text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
    )


def add_ui_routes(
    app: FastAPI,
    coordinator: Coordinator,
    admin_token: str,
    is_admin: Callable[[str], bool],
    http_stats: Callable[[], dict[str, Any]],
) -> None:
    """Add the status page's routes to ``app``; ``is_admin`` tells the admin's bearer token."""
    session = session_value(admin_token)

    def signed_in(request: Request) -> bool:
        cookie = request.cookies.get(COOKIE, "")
        if cookie and hmac.compare_digest(cookie.encode(), session.encode()):
            return True
        header = request.headers.get("authorization", "")
        return header.startswith("Bearer ") and is_admin(header[len("Bearer ") :])

    def denied(message: str, status: int = 401) -> HTMLResponse:
        return HTMLResponse(login_page(message), status_code=status, headers=HEADERS)

    def start_session(request: Request) -> Response:
        response = RedirectResponse("/v1/ui", status_code=303, headers=HEADERS)
        response.set_cookie(
            COOKIE,
            session,
            max_age=SESSION_S,
            path=COOKIE_PATH,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def state() -> dict[str, Any]:
        return await asyncio.to_thread(page_state, coordinator, http_stats())

    @app.get("/v1/ui", include_in_schema=False)
    async def page(request: Request, token: str | None = None) -> Response:
        if token is not None:
            if not is_admin(token):
                return denied("That is not the admin token.")
            return start_session(request)
        if not signed_in(request):
            return denied("Sign in with the coordinator's admin token.")
        return HTMLResponse(render_page(await state()), headers=HEADERS)

    @app.post("/v1/ui/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        token = (form.get("token") or [""])[0]
        if not is_admin(token):
            return denied("That is not the admin token.")
        return start_session(request)

    @app.post("/v1/ui/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        if not signed_in(request):
            return denied("Not signed in.")
        response = RedirectResponse("/v1/ui", status_code=303, headers=HEADERS)
        response.delete_cookie(COOKIE, path=COOKIE_PATH)
        return response

    @app.get("/v1/ui/state", include_in_schema=False)
    async def state_route(request: Request) -> Response:
        if not signed_in(request):
            return JSONResponse(
                {"error": "unauthenticated", "detail": "sign in at /v1/ui"},
                status_code=401,
                headers=HEADERS,
            )
        return Response(state_json(await state()), media_type="application/json", headers=HEADERS)

    for name, media in (("status.js", "text/javascript"), ("status.css", "text/css")):

        def asset(request: Request, name: str = name, media: str = media) -> Response:
            if not signed_in(request):
                return denied("Sign in with the coordinator's admin token.")
            return Response((STATIC / name).read_bytes(), media_type=media, headers=HEADERS)

        app.add_api_route(f"/v1/ui/{name}", asset, methods=["GET"], include_in_schema=False)
