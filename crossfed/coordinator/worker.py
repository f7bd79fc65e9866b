"""The merge worker: ``crossfed coordinator worker``, a small HTTP service beside the object
store that does the coordinator's byte-heavy work for it (``blobs.s3.merge_worker``).

It reads each uploaded delta back for its digest and delta check, writes generation 0,
merges each round's deltas into the next generation (its fp32 master and momentum on its own
disk, the bf16 global model straight to the store) and prunes its old masters: the calls of
:class:`crossfed.coordinator.merger.LocalMerger`, made by the coordinator's
:class:`~crossfed.coordinator.merger.RemoteMerger`. It decides nothing: which deltas, whose,
which generation is committed stay the coordinator's. Only the coordinator may call it (the
run's admin token). One merge runs at a time; the same merge asked again (a coordinator that
restarted or timed out while it ran) is answered from the first one's result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from crossfed.coordinator.blobs import BlobError
from crossfed.coordinator.guards import AuthGate
from crossfed.coordinator.merger import LocalMerger, Written, shape_pairs, shapes_of
from crossfed.outer_presets import OuterConfig

log = logging.getLogger("crossfed.worker")
ADMIN = "admin"
#: merges answered from memory when asked again
REMEMBERED = 4


class CheckRequest(BaseModel):
    name: str
    algo: str
    size: int
    shapes: list[tuple[str, list[int]]] | None = None


class InitialRequest(BaseModel):
    flavour: str
    vocab_size: int
    model_seed: int
    model_object: str | None = None


class MergeRequest(BaseModel):
    base: int
    shapes: list[tuple[str, list[int]]]
    deltas: list[str]
    tokens: list[int]
    outer: dict[str, Any]
    shared_moments: bool
    sites: list[str]
    model_object: str | None = None
    row_counts: bool = False


class RetainRequest(BaseModel):
    oldest_master: int
    oldest_global: int
    keep_start: bool


def create_worker_app(merger: LocalMerger, admin_token: str) -> FastAPI:
    """The worker's ASGI app over ``merger`` (its models dir and the object store)."""
    app = FastAPI(title="crossfed merge worker", docs_url=None, redoc_url=None)
    digest = hashlib.sha256(admin_token.encode()).digest()

    def identify(token: str) -> str | None:
        return ADMIN if hashlib.sha256(token.encode()).digest() == digest else None

    app.add_middleware(AuthGate, identify=identify)
    merging = threading.Lock()
    answered: OrderedDict[str, dict[str, Any]] = OrderedDict()

    @app.exception_handler(BlobError)
    async def _blob_error(_: Request, exc: BlobError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content={"error": exc.code, "detail": str(exc)})

    @app.exception_handler(FileNotFoundError)
    async def _missing(_: Request, exc: FileNotFoundError) -> JSONResponse:
        return JSONResponse(
            status_code=404,
            content={"error": "not_found", "detail": f"not found: {exc}"},
        )

    @app.exception_handler(Exception)
    async def _failed(_: Request, exc: Exception) -> JSONResponse:
        log.error("worker call failed", exc_info=exc)
        return JSONResponse(
            status_code=500,
            content={"error": "merge_failed", "detail": f"{type(exc).__name__}: {exc}"},
        )

    @app.get("/v1/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "role": "merge_worker", "pid": os.getpid()}

    @app.get("/v1/traffic")
    def traffic() -> dict[str, int]:
        moved = {"read": 0, "written": 0} if merger.objects is None else merger.objects.moved
        return {"store_bytes_read": moved["read"], "store_bytes_written": moved["written"]}

    @app.get("/v1/generations/{generation}/shapes")
    def shapes(generation: int) -> dict[str, Any]:
        found = merger.shapes(generation)
        return {"shapes": shape_pairs(found)}

    @app.post("/v1/check")
    def check(body: CheckRequest) -> dict[str, Any]:
        shapes = None if body.shapes is None else shapes_of(body.shapes)
        checked = merger.check(body.name, body.algo, body.size, shapes)
        return {"digest": checked.digest, "size": checked.size, "passed": checked.passed}

    @app.post("/v1/generations/0")
    def initial(body: InitialRequest) -> dict[str, Any]:
        with merging:
            return merger.initial(
                body.flavour, body.vocab_size, body.model_seed, body.model_object
            ).to_dict()

    @app.post("/v1/generations/{generation}")
    def merge(generation: int, body: MergeRequest) -> JSONResponse:
        if generation != body.base + 1:
            raise BlobError(
                f"generation {generation} is made from generation {generation - 1}, not "
                f"{body.base}",
                422,
                "bad_generation",
            )
        key = hashlib.sha256(json.dumps(body.model_dump(), sort_keys=True).encode()).hexdigest()
        with merging:
            if key in answered:
                log.info("generation %d asked again: answered from its merge", generation)
                return JSONResponse(answered[key])
            written: Written = merger.merge(
                body.base,
                shapes_of(body.shapes),
                body.deltas,
                body.tokens,
                OuterConfig(**body.outer),
                shared_moments=body.shared_moments,
                sites=body.sites,
                model_object=body.model_object,
                row_counts=body.row_counts,
            )
            answered[key] = written.to_dict()
            while len(answered) > REMEMBERED:
                answered.popitem(last=False)
            log.info("generation %d written from %d deltas", generation, len(body.deltas))
            return JSONResponse(answered[key])

    @app.post("/v1/retain")
    def retain(body: RetainRequest) -> dict[str, bool]:
        merger.retain(body.oldest_master, body.oldest_global, body.keep_start)
        return {"ok": True}

    return app
