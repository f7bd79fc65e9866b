"""Serving a file over HTTP in short requests: single byte ranges, a digest header, a deadline.

Clients fetch large files as a series of ``Range`` requests (each one short, so a forward
proxy that reaps long connections never sees one), and check the whole file's digest,
sent with every response as ``X-Content-Digest``, once all ranges are in. A response
still running at its deadline is cut off; the client resumes from the bytes it has.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from crossfed.wire.digests import CHUNK

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class RangeError(ValueError):
    """A ``Range`` header this server cannot satisfy."""


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, end)`` (end exclusive) of a single-range header, or None for the whole file."""
    if header is None or size == 0:
        return None  # the whole file (an empty file has no satisfiable range)
    match = _RANGE.match(header.strip())
    if match is None or match.group(1) == match.group(2) == "":
        raise RangeError(f"unsupported Range {header[:80]!r}; use one 'bytes=start-end' range")
    first, last = match.group(1), match.group(2)
    if first == "":  # suffix range: the last N bytes
        start, end = max(0, size - int(last)), size
    else:
        start = int(first)
        end = size if last == "" else min(size, int(last) + 1)
    if start >= size or start >= end:
        raise RangeError(f"range {header[:80]!r} is outside the {size}-byte file")
    return start, end


async def _read(fd: int, position: int, end: int) -> bytes:
    """One chunk, read on a worker thread through its own descriptor (a response that stops
    early may close ``fd`` while the read is still running)."""
    own = os.dup(fd)

    def work() -> bytes:
        try:
            return os.pread(own, min(CHUNK, end - position), position)
        finally:
            os.close(own)

    return await asyncio.to_thread(work)


class RangedFile(Response):
    """A file (or one byte range of it) streamed in large chunks until ``deadline_s``."""

    def __init__(self, path: Path, digest: str, deadline_s: float | None = None) -> None:
        super().__init__(status_code=200, media_type="application/octet-stream")
        self.path, self.digest, self.deadline_s = path, digest, deadline_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.monotonic()
        fd = os.open(self.path, os.O_RDONLY)
        ahead: asyncio.Future[bytes] | None = None
        try:
            size = os.fstat(fd).st_size
            header = None
            for key, value in scope.get("headers", []):
                if key.lower() == b"range":
                    header = value.decode("latin-1")
            try:
                span = parse_range(header, size)
            except RangeError as exc:
                refusal = JSONResponse(
                    {"error": "bad_range", "detail": str(exc)},
                    status_code=416,
                    headers={"Content-Range": f"bytes */{size}"},
                )
                await refusal(scope, receive, send)
                return
            start, end = span if span is not None else (0, size)
            headers = [
                (b"content-type", b"application/octet-stream"),
                (b"content-length", str(end - start).encode()),
                (b"accept-ranges", b"bytes"),
                (b"x-content-digest", self.digest.encode()),
                (b"x-content-size", str(size).encode()),
            ]
            status = 200
            if span is not None:
                status = 206
                headers.append((b"content-range", f"bytes {start}-{end - 1}/{size}".encode()))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            if scope["method"] == "HEAD":
                await send({"type": "http.response.body", "body": b""})
                return
            if start == end:
                await send({"type": "http.response.body", "body": b""})
                return
            # read ahead: the next chunk comes off disk while this one is being sent
            ahead = asyncio.ensure_future(_read(fd, start, end))
            position = start
            while position < end:
                data = await ahead
                ahead = None
                if not data:
                    return
                position += len(data)
                if position < end:
                    ahead = asyncio.ensure_future(_read(fd, position, end))
                await send(
                    {"type": "http.response.body", "body": data, "more_body": position < end}
                )
                if (
                    position < end
                    and self.deadline_s is not None
                    and time.monotonic() - started > self.deadline_s
                ):
                    return  # cut short (after one chunk at least): the client resumes
        finally:
            if ahead is not None:
                ahead.cancel()
            os.close(fd)
