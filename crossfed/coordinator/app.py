"""The coordinator's HTTP API (FastAPI): versioned routes under /v1, bearer tokens per site.

Every request is short: waiting is done by clients polling with backoff, so sites behind an
HTTP forward proxy that reaps long connections work the same as direct ones.
"""

import asyncio
import errno
import gc
import hashlib
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import yaml
from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi import Path as PathParam
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from crossfed.backoff import Backoff
from crossfed.coordinator.blobs import BlobError, check_key
from crossfed.coordinator.claims import DeltaClaim
from crossfed.coordinator.guards import (
    AuthGate,
    BodyDeadline,
    BodyLimit,
    RequestTimeout,
    StatusCounter,
    StatusStats,
    bearer_token,
)
from crossfed.coordinator.http_ranged import RangedFile
from crossfed.coordinator.runspec import RunSpec, RunSpecError
from crossfed.coordinator.s3blobs import ObjectBlobs
from crossfed.coordinator.service import Coordinator, CoordinatorError
from crossfed.coordinator.status_page import add_ui_routes

log = logging.getLogger("crossfed.coordinator")
ADMIN = "__admin__"
MAX_INT = 2**63 - 1  # SQLite's INTEGER range
#: the error word of an HTTP status the framework answers itself (unknown route, method...)
HTTP_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "body_too_large",
    415: "unsupported_media_type",
}
BLOB_KEY = Annotated[str, PathParam(min_length=1, max_length=200, description="the blob's digest")]
ROUND = Annotated[int, PathParam(ge=-MAX_INT, le=MAX_INT)]
GENERATION = Annotated[int, PathParam(ge=-MAX_INT, le=MAX_INT)]
LEASE_ID = Annotated[int, PathParam(ge=-MAX_INT, le=MAX_INT)]
#: seconds an idle connection stays open (uvicorn's default is 5): a site's streams idle
#: for a phase between its transfers, and across a long link a new one costs round trips
KEEP_ALIVE_S = 75
#: the longest a status long poll waits: below proxies' idle timeouts and the 30 s a client
#: commonly gives a request
MAX_STATUS_WAIT_S = 25.0
#: how often a status long poll looks at the open round
STATUS_POLL_TICK_S = 0.05
#: the longest wait between two tries of a failing tick
TICK_RETRY_CAP_S = 2.0
#: a blob key in a body: "blake3:<hex>", "sha256:<hex>"
PART_KEY = Annotated[str, Field(min_length=64, max_length=80)]


def _json_safe(value: Any) -> Any:
    """Echoed input made sendable as JSON: non-finite floats and raw bytes become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


class Tokens:
    """Bearer tokens: one per site plus an admin token, compared in constant time."""

    def __init__(self, admin: str, sites: dict[str, str]) -> None:
        self.admin = admin
        self.pairs = [(admin, ADMIN)] + [(tok, site) for site, tok in sites.items()]
        # SHA-256 of each token -> caller: one lookup per request, however many sites
        self._by_digest = {_token_digest(tok): who for tok, who in self.pairs}

    @classmethod
    def load(cls, path: Path) -> "Tokens":
        data = yaml.safe_load(path.read_text()) or {}
        if "admin" not in data or not isinstance(data.get("sites", {}), dict):
            raise ValueError(f"{path}: a secrets file needs 'admin' and a 'sites' mapping")
        return cls(str(data["admin"]), {str(k): str(v) for k, v in data.get("sites", {}).items()})

    def identify(self, token: str) -> str | None:
        """The caller a token belongs to, or None, in time independent of the tokens: the
        presented token is hashed and looked up by its SHA-256, so the only comparisons made
        are between digests, whose timing says nothing usable about any token."""
        return self._by_digest.get(_token_digest(token))


def _token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _error_text(errors: list[dict[str, Any]]) -> str:
    """Pydantic's errors as one line: ``query.tokens: Input should be ...; body.site: ...``."""
    parts = []
    for error in errors:
        where = ".".join(str(part) for part in error.get("loc", ()))
        parts.append(f"{where}: {error.get('msg', 'invalid')}" if where else error.get("msg", ""))
    return "; ".join(parts) or "invalid request"


def _binary_body(description: str, max_bytes: int) -> dict[str, Any]:
    """OpenAPI for a route whose body is raw bytes (read as a stream, not parsed)."""
    schema = {"type": "string", "format": "binary", "maxLength": max_bytes}
    return {
        "requestBody": {
            "required": True,
            "description": description,
            "content": {"application/octet-stream": {"schema": schema}},
        }
    }


def _run_spec_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON schema of a run spec (from ``RunSpec`` itself) and its nested definitions,
    with the bounds ``RunSpec.from_dict`` enforces."""
    schema = TypeAdapter(RunSpec).json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    props = schema.get("properties", {})
    for name in ("n_windows", "block_size", "inner_steps"):
        if name in props:
            props[name]["minimum"] = 1
    if "sites" in props:
        props["sites"]["minProperties"] = 1
    return schema, defs


class RegisterBody(BaseModel):
    digest: str = Field(min_length=1, max_length=128)
    ranks: int = Field(ge=1, le=1_000_000)
    rtt_ms: float | None = Field(default=None, ge=0, le=600_000)
    round: int | None = Field(default=None, ge=1, description="the round this site means to join")


class LeaseBody(BaseModel):
    site: str = Field(min_length=1, max_length=64)
    round: int = Field(ge=1, le=MAX_INT)
    n_blocks: int = Field(ge=1, le=10_000_000)
    t_step_s: float | None = Field(default=None, ge=0, le=86_400)
    rtt_ms: float | None = Field(default=None, ge=0, le=600_000)


class HeartbeatBody(BaseModel):
    site: str = Field(min_length=1, max_length=64)
    consumed: int = Field(ge=0)
    t_step_s: float | None = Field(default=None, ge=0, le=86_400)
    echo: int | None = Field(default=None, ge=0)  # nonce of the previous heartbeat reply
    echo_held_s: float | None = Field(default=None, ge=0, le=86_400)  # how long it was held


class AdoptBody(BaseModel):
    site: str = Field(min_length=1, max_length=64)
    #: the lease's progress as the adopting job saw it (a status's ``active_leases``)
    consumed: int = Field(ge=0, le=MAX_INT)
    t_step_s: float | None = Field(default=None, ge=0, le=86_400)
    rtt_ms: float | None = Field(default=None, ge=0, le=600_000)


class SiteBody(BaseModel):
    site: str = Field(min_length=1, max_length=64)


class DeltaBody(BaseModel):
    site: str = Field(min_length=1, max_length=64)
    lease_id: int = Field(ge=0, le=MAX_INT)
    generation: int = Field(ge=0, le=MAX_INT)
    tokens: int = Field(ge=1, le=MAX_INT)
    steps: int = Field(ge=1, le=MAX_INT)
    consumed: int = Field(ge=1, le=MAX_INT)
    blob: str = Field(min_length=64, max_length=80)  # "blake3:<hex>", "sha256:<hex>"
    loss: float | None = Field(default=None, allow_inf_nan=False)
    compute_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    #: seconds the site held the lease waiting for a merge (overlapped rounds)
    idle_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    #: the blob's parts to join into it first (as ``/v1/blobs/{key}/compose`` does)
    parts: list[PART_KEY] | None = Field(default=None, min_length=1, max_length=1024)


class UploadBody(BaseModel):
    #: the blob's size in bytes
    bytes: int = Field(ge=0, le=MAX_INT)
    #: fresh URLs for this upload (under way) instead of a new upload
    upload_id: str | None = Field(default=None, min_length=1, max_length=1024)


class CompleteBody(BaseModel):
    #: the blob's size in bytes, as when the upload was asked for
    bytes: int = Field(ge=0, le=MAX_INT)


class ComposeBody(BaseModel):
    #: the blobs to join, in order
    parts: list[PART_KEY] = Field(min_length=1, max_length=1024)


def create_app(
    coordinator: Coordinator,
    tokens: Tokens,
    *,
    tick_s: float = 0.25,
    max_blob_bytes: int = 8 * 1024**3,
    max_json_bytes: int = 1024**2,
    max_request_s: float = 120.0,
) -> FastAPI:
    """The ASGI app; a background thread ticks the coordinator (lease expiry, round close).

    Every route but ``/v1/health`` needs a bearer token (``AuthGate``), the OpenAPI document
    included; the Swagger/ReDoc pages are off (they load scripts from a CDN). Bodies over
    ``max_json_bytes`` (blob routes: ``max_blob_bytes``) are refused with 413 before reading.
    Weight transfers stop after ``max_request_s`` (an upload answers 408 with the offset to
    resume at, a download is cut short); clients move weights in parts well below that. A
    JSON request whose body is not in by then is answered 408 (``BodyDeadline``).
    """
    app = FastAPI(
        title="crossfed coordinator",
        version="1",
        lifespan=_ticking(coordinator, tick_s),
        # no OpenTelemetry here; left on, FastAPI looks up providers on every request
        telemetry={"tracing": False, "metrics": False, "logs": False},
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    stats = StatusStats()
    app.add_middleware(BodyDeadline, max_request_s=max_request_s)
    app.add_middleware(BodyLimit, max_json_bytes=max_json_bytes, max_blob_bytes=max_blob_bytes)
    app.add_middleware(AuthGate, identify=tokens.identify)
    app.add_middleware(StatusCounter, stats=stats)  # outermost: counts the guards' refusals too
    app.state.http_stats = stats
    _add_error_handlers(app)
    api = _Api(coordinator, tokens, max_blob_bytes, max_request_s)
    add_ui_routes(
        app,
        coordinator,
        tokens.admin,
        lambda token: tokens.identify(token) == ADMIN,
        stats.snapshot,
    )
    _add_run_routes(app, api, stats)
    _add_lease_routes(app, api)
    _add_blob_routes(app, api)
    _add_object_routes(app, api)
    _add_delta_routes(app, api)
    _with_run_spec_schema(app)
    return app


def tick_until(tick: Callable[[], None], stop: threading.Event, tick_s: float) -> None:
    """Call ``tick`` every ``tick_s`` until ``stop``. A failing tick (the object store down
    mid-merge, say) is retried with backoff up to ``TICK_RETRY_CAP_S`` and logged once with
    its traceback, then once more when ticks succeed again; the server keeps serving."""
    backoff = Backoff(tick_s, max(tick_s, TICK_RETRY_CAP_S), sleep=stop.wait)
    failing = ""
    while True:
        backoff.wait()
        if stop.is_set():
            return
        try:
            tick()
        except Exception as exc:
            what = f"{type(exc).__name__}: {exc}"
            if what != failing:
                log.exception("coordinator tick failed; retrying with backoff")
            failing = what
            continue
        if failing:
            log.info("coordinator tick succeeds again (it failed with %s)", failing)
            failing = ""
        backoff.reset()


def _ticking(
    coordinator: Coordinator, tick_s: float
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: a thread ticks ``coordinator`` every ``tick_s`` while it serves."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()

        def ticker() -> None:
            tick_until(coordinator.tick, stop, tick_s)

        thread = threading.Thread(target=ticker, name="crossfed-tick", daemon=True)
        thread.start()
        # everything loaded so far lives as long as the server: keep it out of the cyclic
        # collector, whose full passes over it stalled requests for hundreds of ms
        gc.collect()
        gc.freeze()
        yield
        gc.unfreeze()  # collectable again, so the interpreter's exit finalises them cleanly
        stop.set()
        thread.join(timeout=10)

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal in one shape: ``{"error": <code>, "detail": <text>}``."""

    @app.exception_handler(CoordinatorError)
    async def _coordinator_error(_: Request, exc: CoordinatorError) -> JSONResponse:
        return JSONResponse(
            status_code=exc.status, content={"error": exc.code, "detail": exc.message}
        )

    @app.exception_handler(RequestTimeout)
    async def _request_timeout(_: Request, exc: RequestTimeout) -> JSONResponse:
        return JSONResponse(
            status_code=408, content={"error": "request_timeout", "detail": exc.detail}
        )

    @app.exception_handler(BlobError)
    async def _blob_error(_: Request, exc: BlobError) -> JSONResponse:
        return JSONResponse(
            status_code=exc.status, content={"error": exc.code, "detail": str(exc), **exc.extra}
        )

    @app.exception_handler(RunSpecError)
    async def _spec_error(_: Request, exc: RunSpecError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"error": "bad_run_spec", "detail": str(exc)})

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the input back; a NaN or Infinity in it cannot be JSON
        errors = jsonable_encoder(_json_safe(exc.errors()))
        return JSONResponse(
            status_code=422,
            content={"error": "invalid_request", "detail": _error_text(errors), "errors": errors},
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # the framework's own answers (unknown route, wrong method, a body cut off at the
        # limit) in the same shape as every other refusal
        code = HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        return JSONResponse(
            status_code=exc.status_code,
            content={"error": code, "detail": str(exc.detail)},
            headers=exc.headers,
        )

    @app.exception_handler(Exception)
    async def _server_error(_: Request, exc: Exception) -> JSONResponse:
        # a bug: logged with its traceback by the server; the client gets the usual shape
        return JSONResponse(
            status_code=500,
            content={
                "error": "internal_error",
                "detail": "internal error; see the coordinator log",
            },
        )

    @app.exception_handler(OSError)
    async def _os_error(request: Request, exc: OSError) -> JSONResponse:
        if exc.errno in STORAGE_FULL_ERRNOS:
            return _storage_full(request, exc)
        raise exc  # anything else is a bug: the server logs it, the client gets a 500

    @app.exception_handler(sqlite3.OperationalError)
    async def _sqlite_error(request: Request, exc: sqlite3.OperationalError) -> JSONResponse:
        if "disk is full" in str(exc):  # SQLITE_FULL: the transaction was rolled back
            return _storage_full(request, exc)
        raise exc

    @app.exception_handler(OverflowError)
    async def _overflow(_: Request, exc: OverflowError) -> JSONResponse:
        # integers past SQLite's 64-bit range (path or query parameters, spec fields)
        return JSONResponse(
            status_code=422,
            content={"error": "out_of_range", "detail": f"a number is out of range: {exc}"},
        )


#: a write refused for want of space (the device, or the user's quota)
STORAGE_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: how long a client waits before it sends a request refused for a full disk again
STORAGE_FULL_RETRY_S = 5


def _storage_full(request: Request, exc: Exception) -> JSONResponse:
    """507: the coordinator's disk is full. Nothing of the request was kept (a blob part keeps
    what reached the disk and resumes after it; a transaction was rolled back): the client
    sends it again later, as after a 503."""
    log.warning("storage full: %s %s refused (%s)", request.method, request.url.path, exc)
    return JSONResponse(
        status_code=507,
        content={
            "error": "storage_full",
            "detail": "the coordinator's disk is full; nothing was kept, send it again later",
        },
        headers={"Retry-After": str(STORAGE_FULL_RETRY_S)},
    )


def as_site(who: str, site: str) -> None:
    if who not in (ADMIN, site):
        raise CoordinatorError(403, "forbidden", f"this token may not act for site {site!r}")


def as_admin(who: str) -> None:
    if who != ADMIN:
        raise CoordinatorError(403, "forbidden", "admin token required")


def site_of(who: str) -> str | None:
    return None if who == ADMIN else who


async def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` on a worker thread: the coordinator's methods block (the lock, SQLite)."""
    return await asyncio.to_thread(fn, *args, **kwargs)


def own_view(who: str, reply: dict[str, Any]) -> dict[str, Any]:
    """A site sees its own leases only; the admin sees all."""
    if who == ADMIN or "active_leases" not in reply:
        return reply
    mine = [lease for lease in reply["active_leases"] if lease["site"] == who]
    return {**reply, "active_leases": mine}


class _Api:
    """What the route groups share: the coordinator, the tokens (``caller``, the bearer
    dependency) and the weight-transfer limits."""

    def __init__(
        self, coordinator: Coordinator, tokens: Tokens, max_blob_bytes: int, max_request_s: float
    ) -> None:
        self.coordinator, self.tokens = coordinator, tokens
        self.max_blob_bytes, self.max_request_s = max_blob_bytes, max_request_s

        async def caller(authorization: Annotated[str | None, Header()] = None) -> str:
            # async: a sync dependency would cost a thread-pool round trip on every request
            token = bearer_token(authorization)
            if token is None:
                raise CoordinatorError(
                    401, "unauthenticated", "missing 'Authorization: Bearer <token>'"
                )
            who = tokens.identify(token)
            if who is None:
                raise CoordinatorError(401, "unauthenticated", "unknown token")
            return who

        self.caller = caller
        #: the ``who`` parameter of every authenticated route
        self.Caller = Annotated[str, Depends(caller)]

    def file_backend(self) -> None:
        """Blob bytes through the coordinator only with the file store."""
        if self.coordinator.backend != "file":
            raise CoordinatorError(
                409,
                "wrong_backend",
                "blobs live in the object store: ask POST /v1/blobs/{key}/uploads (or GET "
                "/v1/models/{generation}/url, /v1/blobs/{key}/url) for presigned URLs and "
                "move the bytes there",
            )

    def object_backend(self) -> ObjectBlobs:
        """The object store's blobs, or a 409 saying this coordinator keeps them on disk."""
        if self.coordinator.s3 is None:
            raise CoordinatorError(
                409,
                "wrong_backend",
                "this coordinator keeps blobs on its own disk (blobs.backend: file): "
                "PUT /v1/blobs/{key} and GET /v1/models/{generation} move the bytes",
            )
        return self.coordinator.s3

    async def may_see_blob(self, who: str, key: str) -> None:
        """A site sees the blobs it uploaded (and its accepted deltas'); the admin sees all."""
        if who == ADMIN:
            return
        holders = await run(self.coordinator.blob_holders, key)
        if holders and who not in holders:
            raise CoordinatorError(403, "forbidden", f"blob {key} is another site's")

    async def compose(self, who: str, key: str, parts: list[str]) -> dict[str, Any]:
        """Join ``who``'s uploaded ``parts`` into blob ``key`` (a part that is not the
        caller's is 403, a missing one 404 ``unknown_blob``, bytes that do not hash to
        ``key`` 422); the parts are deleted once joined."""
        coordinator = self.coordinator
        self.file_backend()
        parts = [check_key(part) for part in parts]
        for part in parts:
            if who != ADMIN and who not in await run(coordinator.blob_holders, part):
                if coordinator.blobs.exists(part):
                    raise CoordinatorError(
                        403, "forbidden", f"part {part} is not an upload of {who}'s"
                    )
                raise CoordinatorError(404, "unknown_blob", f"part {part} is not stored")
        holders = set() if who == ADMIN else await run(coordinator.blob_holders, key)
        if who != ADMIN and not holders:
            await run(coordinator.hold_blob, key, who)  # before the first byte is kept
        state = await coordinator.blobs.compose(key, parts)
        if who != ADMIN:
            if who not in holders:  # another site's blob: the parts proved the same bytes
                await run(coordinator.hold_blob, key, who)
            await run(coordinator.drop_parts, parts, who, key)
        return state

    async def store_body(
        self, who: str, key: str, request: Request, offset: int, total: int | None
    ) -> dict[str, Any]:
        """Write a request body into the blob store as ``who``. An upload a site starts is
        recorded as its own before the first byte is kept; another site's blob may only be
        sent again whole and byte for byte (then the sender holds it too), so a part of it
        can never be probed or overwritten."""
        coordinator = self.coordinator
        self.file_backend()
        holders = set() if who == ADMIN else await run(coordinator.blob_holders, key)
        record_after = False
        if who != ADMIN and who not in holders:
            exists = coordinator.blobs.exists(key)
            if holders and not exists:
                raise CoordinatorError(403, "forbidden", f"blob {key} is another site's upload")
            if holders and (offset != 0 or total not in (None, coordinator.blobs.size(key))):
                raise CoordinatorError(
                    403,
                    "forbidden",
                    f"blob {key} is another site's; only all of its bytes may be sent again",
                )
            if holders:
                total = None  # the body must be the whole blob
            if exists:
                record_after = True
            else:
                await run(coordinator.hold_blob, key, who)
        state = await coordinator.blobs.write_part(
            key,
            request.stream(),
            offset=offset,
            total=total,
            max_bytes=self.max_blob_bytes,
            deadline=time.monotonic() + self.max_request_s,
        )
        if record_after:
            await run(coordinator.hold_blob, key, who)
        return state


def _add_run_routes(app: FastAPI, api: _Api, stats: StatusStats) -> None:
    """Health, the run, its status and ledger, site registration, models and rounds."""
    coordinator, Caller = api.coordinator, api.Caller

    @app.get("/v1/admin/http")
    async def http_counts(who: Caller) -> dict[str, Any]:
        """Responses by status code since this process started (5xx are also logged), the
        body bytes through the API and, with an object store, the bytes the coordinator
        itself read from it and wrote to it (its checks, merges and global models)."""
        as_admin(who)
        s3 = coordinator.s3
        moved = {"read": 0, "written": 0} if s3 is None else s3.objects.moved
        return {
            **stats.snapshot(),
            "store_bytes_read": moved["read"],
            "store_bytes_written": moved["written"],
        }

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        """Liveness, and the serving process's id (so a launcher knows it reached its own)."""
        return {
            "ok": True,
            "run": coordinator.spec is not None,
            "pid": os.getpid(),
            "blobs": coordinator.backend,
        }

    run_spec_schema, _ = _run_spec_schema()

    @app.post(
        "/v1/run",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": run_spec_schema}},
            }
        },
    )
    async def init_run(body: dict[str, Any], who: Caller) -> dict[str, Any]:
        as_admin(who)
        return await run(coordinator.init_run, RunSpec.from_dict(body))

    @app.get("/v1/status")
    async def status(
        who: Caller,
        after_round: Annotated[int | None, Query(ge=-MAX_INT, le=MAX_INT)] = None,
        wait_s: Annotated[float, Query(ge=0, le=MAX_STATUS_WAIT_S)] = 0.0,
    ) -> dict[str, Any]:
        """The run's state. With ``after_round`` the open round, a long poll: answered once
        that round closes or after ``wait_s`` seconds, whichever comes first (a site waiting
        for a merge learns of it without polling across a long link); any other round is
        answered at once."""
        deadline = time.monotonic() + wait_s
        while coordinator.spec is not None and coordinator.open_round_no == after_round:
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(STATUS_POLL_TICK_S)
        return own_view(who, await run(coordinator.status))

    @app.get("/v1/ledger")
    async def ledger(who: Caller) -> list[dict[str, Any]]:
        return await run(coordinator.ledger_table)

    @app.post("/v1/sites/{site}/register")
    async def register(
        site: Annotated[str, PathParam(min_length=1, max_length=64)],
        body: RegisterBody,
        who: Caller,
    ) -> dict[str, Any]:
        as_site(who, site)
        reply = await run(
            coordinator.register, site, body.digest, body.ranks, body.rtt_ms, body.round
        )
        return own_view(who, reply)

    @app.get("/v1/models/{generation}")
    async def model(generation: GENERATION, who: Caller) -> RangedFile:
        """Global bf16 weights; ``Range`` requests fetch them in parts (``X-Content-Digest``).
        With an object store: 409 ``wrong_backend`` (``/v1/models/{generation}/url``)."""
        api.file_backend()
        path, digest = await run(coordinator.global_file, generation)
        return RangedFile(path, digest, api.max_request_s)

    @app.get("/v1/rounds/{round_no}")
    async def round_info(round_no: ROUND, who: Caller) -> dict[str, Any]:
        info = await run(coordinator.round_info, round_no)
        # the round's compute time (its slowest accepted delta's inner phase) is the run's,
        # shared like merge_s, so every site's report times the round alike
        times = [d["compute_s"] for d in info["deltas"] if d["compute_s"] is not None]
        info["compute_s"] = max(times, default=None)
        if who != ADMIN:  # a site sees its own deltas only
            info["deltas"] = [d for d in info["deltas"] if d["site"] == who]
        return info


def _add_lease_routes(app: FastAPI, api: _Api) -> None:
    """Grants, heartbeats and releases.

    The heartbeat is served by two routes with one handler (``beat``): a plain Starlette
    endpoint matched first for integer lease ids, and the FastAPI route, which documents it
    in the OpenAPI schema and answers the ids the first does not match (a 422 in the usual
    shape). The first skips FastAPI's per-request dependency and validation machinery on
    the hottest path (every site, every few seconds); both give the same answers. Kept as
    two: the FastAPI route alone answered a heartbeat in a median 0.57 ms against 0.39 ms
    (in process over ASGI, 1,500 heartbeats each, interleaved).
    """
    coordinator, Caller = api.coordinator, api.Caller

    @app.post("/v1/leases")
    async def lease(body: LeaseBody, who: Caller) -> dict[str, Any]:
        as_site(who, body.site)
        return await run(
            coordinator.lease, body.site, body.round, body.n_blocks, body.t_step_s, body.rtt_ms
        )

    async def beat(lease_id: int, body: HeartbeatBody, who: str) -> dict[str, Any]:
        """With the coordinator idle a heartbeat is answered on the event loop (a TTL refresh
        is a short, unsynced transaction); when it is busy, from a worker thread."""
        as_site(who, body.site)
        args = (lease_id, body.site, body.consumed, body.t_step_s, body.echo, body.echo_held_s)
        if coordinator.lock.acquire(blocking=False):
            try:
                return coordinator.heartbeat(*args)
            finally:
                coordinator.lock.release()
        return await run(coordinator.heartbeat, *args)

    @app.post("/v1/leases/{lease_id}/heartbeat")
    async def heartbeat(lease_id: LEASE_ID, body: HeartbeatBody, who: Caller) -> dict[str, Any]:
        return await beat(lease_id, body, who)

    async def heartbeat_fast(request: Request) -> JSONResponse:
        """The same route as a plain Starlette endpoint matched first: the same guards, checks
        and errors, without FastAPI's per-request dependency machinery (the hottest path)."""
        who = await api.caller(request.headers.get("authorization"))
        try:
            body = HeartbeatBody.model_validate_json(await request.body())
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
            raise RequestValidationError(errors) from exc
        return JSONResponse(await beat(request.path_params["lease_id"], body, who))

    app.router.routes.insert(
        0, Route("/v1/leases/{lease_id:int}/heartbeat", heartbeat_fast, methods=["POST"])
    )

    @app.post("/v1/leases/{lease_id}/adopt")
    async def adopt(lease_id: LEASE_ID, body: AdoptBody, who: Caller) -> dict[str, Any]:
        """A restarted job takes over the live lease its dead predecessor held, at the
        progress it saw (``consumed``), to train it from its first block: a grant's reply."""
        as_site(who, body.site)
        return await run(
            coordinator.adopt, lease_id, body.site, body.consumed, body.t_step_s, body.rtt_ms
        )

    @app.post("/v1/leases/{lease_id}/release")
    async def release(lease_id: LEASE_ID, body: SiteBody, who: Caller) -> dict[str, Any]:
        as_site(who, body.site)
        return await run(coordinator.release, lease_id, body.site)


def _add_blob_routes(app: FastAPI, api: _Api) -> None:
    """Blob uploads (whole or in parts), their state and ranged downloads."""
    coordinator, Caller = api.coordinator, api.Caller

    @app.put(
        "/v1/blobs/{key}",
        status_code=201,
        openapi_extra=_binary_body("the blob's bytes (or one part of them)", api.max_blob_bytes),
    )
    async def put_blob(
        key: BLOB_KEY,
        request: Request,
        who: Caller,
        offset: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
        total: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
    ) -> dict[str, Any]:
        """Upload a blob (key = its digest) whole, or in parts at ``offset`` of ``total``.

        A blob is private to the site that uploads it. The same bytes again are answered
        as a finished upload; other bytes under a stored key are refused with 409."""
        return await api.store_body(who, check_key(key), request, offset, total)

    @app.post("/v1/blobs/{key}/compose")
    async def compose_blob(key: BLOB_KEY, body: ComposeBody, who: Caller) -> dict[str, Any]:
        """Join the caller's uploaded ``parts`` (byte ranges sent over several connections)
        into blob ``key``; the parts must hash to it together, and are deleted once joined."""
        return await api.compose(who, check_key(key), body.parts)

    @app.get("/v1/blobs/{key}/state")
    async def blob_state(key: BLOB_KEY, who: Caller) -> dict[str, Any]:
        """Whether a blob is complete, and the offset its upload resumes at."""
        key = check_key(key)
        api.file_backend()
        await api.may_see_blob(who, key)
        return coordinator.blobs.upload_state(key)

    @app.get("/v1/blobs/{key}")
    async def get_blob(key: BLOB_KEY, who: Caller) -> RangedFile:
        """A complete blob's bytes (``Range`` requests fetch it in parts)."""
        key = check_key(key)
        api.file_backend()
        await api.may_see_blob(who, key)
        if not coordinator.blobs.exists(key):
            raise CoordinatorError(404, "unknown_blob", f"no blob {key}")
        return RangedFile(coordinator.blobs.path(key), key, api.max_request_s)


def _add_object_routes(app: FastAPI, api: _Api) -> None:
    """With an object store: presigned URLs for the caller's own uploads and reads, and
    the coordinator's check of each upload it completes."""
    coordinator, Caller = api.coordinator, api.Caller

    @app.post("/v1/blobs/{key}/uploads")
    async def begin_upload(key: BLOB_KEY, body: UploadBody, who: Caller) -> dict[str, Any]:
        """Presigned URLs for the parts of an upload of blob ``key`` (a new upload, or fresh
        URLs for ``upload_id``): recorded as the caller's before the first URL is signed.
        Another site's blob is refused (403)."""
        s3 = api.object_backend()
        key = check_key(key)
        if body.bytes > api.max_blob_bytes:
            raise BlobError(
                f"blob of {body.bytes} bytes exceeds the {api.max_blob_bytes}-byte limit",
                413,
                "body_too_large",
            )
        if who != ADMIN:
            holders = await run(coordinator.blob_holders, key)
            if holders and who not in holders:
                raise CoordinatorError(403, "forbidden", f"blob {key} is another site's upload")
            await run(coordinator.hold_blob, key, who)
        return await run(s3.begin, key, who, body.bytes, body.upload_id)

    @app.post("/v1/blobs/{key}/uploads/{upload_id}/complete")
    async def complete_upload(
        key: BLOB_KEY,
        upload_id: Annotated[str, PathParam(min_length=1, max_length=1024)],
        body: CompleteBody,
        who: Caller,
    ) -> dict[str, Any]:
        """Join the upload's parts; the object is kept only if it hashes to ``key`` (422
        ``digest_mismatch`` deletes it; a part missing is 409 ``missing_part``)."""
        s3 = api.object_backend()
        key = check_key(key)
        holders = set() if who == ADMIN else await run(coordinator.blob_holders, key)
        if who != ADMIN and who not in holders:
            if holders:
                raise CoordinatorError(403, "forbidden", f"blob {key} is another site's upload")
            raise CoordinatorError(404, "unknown_upload", f"{who} has no upload of blob {key}")
        return await run(s3.complete, key, who, upload_id, body.bytes)

    @app.get("/v1/blobs/{key}/url")
    async def blob_url(key: BLOB_KEY, who: Caller) -> dict[str, Any]:
        """A presigned GET of the caller's own stored blob ``key``."""
        s3 = api.object_backend()
        key = check_key(key)
        await api.may_see_blob(who, key)
        stored = await run(s3.stored, key)
        owner = (
            who if who in stored else (next(iter(sorted(stored)), None) if who == ADMIN else None)
        )
        if owner is None:
            raise CoordinatorError(404, "unknown_blob", f"no blob {key}")
        return await run(s3.download, key, owner)

    @app.get("/v1/models/{generation}/url")
    async def model_url(generation: GENERATION, who: Caller) -> dict[str, Any]:
        """A presigned GET of generation ``generation``'s global model (its digest and size)."""
        api.object_backend()
        return await run(coordinator.model_download, generation)


def _add_delta_routes(app: FastAPI, api: _Api) -> None:
    """Deltas: by reference to an uploaded blob, or inline in the round message."""
    coordinator, Caller = api.coordinator, api.Caller

    @app.post("/v1/rounds/{round_no}/deltas")
    async def submit(round_no: ROUND, body: DeltaBody, who: Caller) -> dict[str, Any]:
        """Submit a delta by reference to its blob; with ``parts``, the blob's byte ranges
        (uploaded over several connections) are joined into it first, in the same request."""
        as_site(who, body.site)
        claim = DeltaClaim(round_no=round_no, **body.model_dump(exclude={"parts"}))
        if body.parts:  # unless the caller's blob is whole already (a resent submission)
            api.file_backend()
            key = check_key(body.blob)
            mine = who == ADMIN or who in await run(coordinator.blob_holders, key)
            if not (mine and coordinator.blobs.exists(key)):
                await api.compose(who, key, body.parts)
        return await run(coordinator.submit, claim, by=site_of(who))

    @app.post(
        "/v1/rounds/{round_no}/deltas/inline",
        openapi_extra=_binary_body("the delta's safetensors bytes", api.max_blob_bytes),
    )
    async def submit_inline(
        round_no: ROUND,
        request: Request,
        who: Caller,
        site: Annotated[str, Query(min_length=1, max_length=64)],
        lease_id: Annotated[int, Query(ge=0, le=MAX_INT)],
        generation: Annotated[int, Query(ge=0, le=MAX_INT)],
        tokens: Annotated[int, Query(ge=1, le=MAX_INT)],
        steps: Annotated[int, Query(ge=1, le=MAX_INT)],
        consumed: Annotated[int, Query(ge=1, le=MAX_INT)],
        loss: Annotated[float | None, Query(allow_inf_nan=False)] = None,
        compute_s: Annotated[float | None, Query(ge=0, allow_inf_nan=False)] = None,
        idle_s: Annotated[float | None, Query(ge=0, allow_inf_nan=False)] = None,
        x_content_digest: Annotated[str | None, Header(min_length=1, max_length=80)] = None,
        x_content_sha256: Annotated[str | None, Header(min_length=1, max_length=80)] = None,
    ) -> dict[str, Any]:
        """The delta's bytes inside the round message itself (the paper's inline transport).

        ``X-Content-Digest`` (``blake3:<hex>`` or ``sha256:<hex>``; the legacy
        ``X-Content-SHA256`` is a bare SHA-256) names the bytes; they are verified and kept
        like a blob. Every check that needs not the bytes (the query values, the lease, the
        claim) is made before the first byte is stored. Past ``max_request_s`` the answer
        is 408 with the offset reached, from which the client may finish the upload as a
        blob.
        """
        as_site(who, site)
        api.file_backend()
        digest = x_content_digest or x_content_sha256
        if not digest:
            raise CoordinatorError(
                422, "missing_digest", "inline deltas need an X-Content-Digest header"
            )
        claim = DeltaClaim(
            site=site, round_no=round_no, lease_id=lease_id, generation=generation,
            tokens=tokens, steps=steps, consumed=consumed, blob=check_key(digest), loss=loss,
            compute_s=compute_s, idle_s=idle_s,
        )  # fmt: skip
        await run(coordinator.vet_delta, claim)
        await api.store_body(who, claim.blob, request, 0, None)
        return await run(coordinator.submit, claim, by=site_of(who))


def _with_run_spec_schema(app: FastAPI) -> None:
    """FastAPI's OpenAPI document plus the run spec's nested definitions (``POST /v1/run``)."""
    _, run_spec_defs = _run_spec_schema()

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            document.setdefault("components", {}).setdefault("schemas", {}).update(run_spec_defs)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
