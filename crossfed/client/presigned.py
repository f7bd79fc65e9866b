"""A site's transfers with an object store, through the presigned URLs the coordinator hands
out (``blobs.backend: s3``): the bytes go to and from the store directly, in parallel parts.

An upload asks the coordinator for an upload of its own (``POST /v1/blobs/{key}/uploads``),
puts each part to its URL (several at once), and asks the coordinator to complete it: the
coordinator joins the parts the store holds and keeps the object only if it hashes to the
key. A part refused because its URL expired gets a fresh URL for the same upload; parts the
store lost (it restarted) are sent again when the completion names them; a digest mismatch
starts a new upload. A download fetches byte spans of the object in parallel and checks the
whole file against its digest. Every request is retried through the client's backoff
(:class:`crossfed.client.transfer.Progress`) while it makes progress.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import httpx

from crossfed.client.transfer import (
    MISMATCH_RETRIES,
    RETRY_STATUS,
    IntegrityError,
    Progress,
    Refused,
    fetch_spans,
    write_all,
)
from crossfed.wire.digests import iter_chunks

log = logging.getLogger("crossfed.client")
#: fresh URLs asked for in a row without a part getting through before giving up
MAX_REFRESHES = 3


class Expired(Exception):
    """The store refused a presigned URL (expired, or its signature no longer holds)."""


class UrlClient(Protocol):
    """What presigned transfers ask of the coordinator's client
    (:class:`crossfed.client.http.CoordinatorClient`): the URLs, its retry
    budget and its stream settings."""

    retry_budget_s: float
    part_bytes: int
    streams: int
    sleep: Callable[[float], None]

    def get(self, path: str, **kwargs: Any) -> Any: ...

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Any: ...

    def streams_for(self, size: int) -> int: ...


class ObjectTransfers:
    """Uploads and downloads of one client through presigned URLs."""

    def __init__(self, client: UrlClient, http: httpx.Client) -> None:
        self.client, self.http = client, http

    # ------------------------------------------------------------------ upload
    def upload(self, path: Path, key: str) -> str:
        """Put ``path`` into the store as blob ``key`` (the caller's own); returns ``key``."""
        size = path.stat().st_size
        uploads = f"/v1/blobs/{key}/uploads"
        plan = self.client.post(uploads, {"bytes": size})
        mismatches = refreshes = 0
        while not plan["complete"]:
            try:
                self._put_parts(path, plan["parts"])
            except Expired as exc:
                refreshes += 1
                if refreshes > MAX_REFRESHES:
                    raise Refused(403, "url_refused", str(exc)) from exc
                log.warning("%s: %s; asking for fresh URLs", path.name, exc)
                plan = self._fresh(uploads, size, plan)
                continue
            refreshes = 0
            try:
                plan = self.client.post(f"{uploads}/{plan['upload_id']}/complete", {"bytes": size})
            except Refused as exc:
                if exc.code == "missing_part":  # the store lost parts: send them again
                    log.warning("%s: %s; sending them again", path.name, exc.detail)
                    plan = self._fresh(uploads, size, plan)
                elif exc.code == "digest_mismatch":
                    mismatches += 1
                    if mismatches > MISMATCH_RETRIES:
                        raise IntegrityError(
                            f"{path}: the coordinator hashed it differently {mismatches} times "
                            f"(key {key}); is the file changing while it is sent?"
                        ) from exc
                    plan = self.client.post(uploads, {"bytes": size})
                elif exc.code == "unknown_upload":
                    plan = self.client.post(uploads, {"bytes": size})
                else:
                    raise
        return key

    def _fresh(self, uploads: str, size: int, plan: dict[str, Any]) -> dict[str, Any]:
        """Fresh URLs for the same upload (a new upload if it is gone)."""
        try:
            return self.client.post(uploads, {"bytes": size, "upload_id": plan["upload_id"]})
        except Refused as exc:
            if exc.code != "unknown_upload":
                raise
            return self.client.post(uploads, {"bytes": size})

    def _put_parts(self, path: Path, parts: list[dict[str, Any]]) -> None:
        """PUT every part, ``streams`` at a time; each retried while the store is away."""
        workers = max(1, min(self.client.streams, len(parts)))

        def put(part: dict[str, Any]) -> None:
            self._put_part(path, part)

        with ThreadPoolExecutor(workers, thread_name_prefix="crossfed-put") as pool:
            list(pool.map(put, parts))

    def _put_part(self, path: Path, part: dict[str, Any]) -> None:
        start, length = int(part["offset"]), int(part["bytes"])
        progress = Progress(self.client.retry_budget_s)
        while True:
            try:
                response = self.http.put(
                    part["url"],
                    content=iter_chunks(path, start, start + length),
                    headers={"Content-Length": str(length)},
                )
            except httpx.TransportError as exc:
                progress.wait(self.client.sleep, f"upload of {path.name}", exc)
                continue
            if response.status_code < 300:
                return
            error = _store_error(response, f"part {part['number']} of {path.name}")
            if response.status_code == 403:
                raise Expired(str(error))
            if response.status_code not in RETRY_STATUS | {500}:
                raise error
            progress.wait(self.client.sleep, f"upload of {path.name}", error)

    # ------------------------------------------------------------------ download
    def download(self, url: str, dest: Path, what: str, expected: str | None = None) -> Path:
        """The object the coordinator's ``url`` presigns, to ``dest`` (atomic, in parallel
        spans, digest-checked); nothing is fetched if ``dest`` exists."""
        if dest.exists():
            return dest
        info = self.client.get(url)
        size, digest = int(info["bytes"]), str(info["digest"])
        if expected is not None and digest != expected:
            raise IntegrityError(f"{what}: the coordinator names it {digest}")
        current = {"url": info["url"]}

        def fetch(_i: int, fd: int, span: tuple[int, int]) -> None:
            self._fetch_span(url, current, fd, span, what)

        return fetch_spans(dest, size, digest, self.client.streams_for(size), fetch, what)

    def _fetch_span(
        self, url: str, current: dict[str, str], fd: int, span: tuple[int, int], what: str
    ) -> None:
        """Bytes ``[start, end)`` into ``fd`` in ranges of ``part_bytes``; a range cut short
        resumes from the bytes written, an expired URL is presigned again."""
        position, end = span
        progress = Progress(self.client.retry_budget_s)
        refreshes = 0
        while position < end:
            stop = min(end, position + self.client.part_bytes) - 1
            try:
                with self.http.stream(
                    "GET", current["url"], headers={"Range": f"bytes={position}-{stop}"}
                ) as response:
                    if response.status_code >= 300:
                        response.read()
                        error = _store_error(response, what)
                        if response.status_code == 403 and refreshes < MAX_REFRESHES:
                            refreshes += 1
                            current["url"] = self.client.get(url)["url"]
                            continue
                        if response.status_code not in RETRY_STATUS | {500}:
                            raise error
                        progress.wait(self.client.sleep, f"download of {what}", error)
                        continue
                    for chunk in response.iter_raw():
                        chunk = chunk[: stop + 1 - position]
                        write_all(fd, chunk, position)
                        position += len(chunk)
                progress.advanced()
                refreshes = 0
            except httpx.TransportError as exc:
                progress.wait(self.client.sleep, f"download of {what}", exc)


def _store_error(response: httpx.Response, what: str) -> Refused:
    """The store's refusal (an S3 XML error) as a :class:`Refused` naming its code."""
    text = response.text
    code = "store_error"
    if "<Code>" in text:
        code = text.split("<Code>", 1)[1].split("</Code>", 1)[0]
    return Refused(response.status_code, code, f"the object store refused {what}: {text[:300]}")
