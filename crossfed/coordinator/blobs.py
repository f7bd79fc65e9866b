"""Content-addressed blob store on disk: uploads stream in (in parts), digest checked, renamed.

A blob's key is its digest, ``blake3:<hex>`` or ``sha256:<hex>`` (a bare 64-hex key is a
legacy SHA-256); nothing else is accepted, so a key can never name a path. A blob lives at
``root/<algo>/<hex[:2]>/<hex>``.

An upload may come in several short requests (``offset`` and ``total``): bytes are appended
to ``root/.uploads/<algo>-<hex>.part`` while being hashed (the kernel is asked to start
writing them to disk at once), and the last part is checked against the key, fsynced and
renamed into place. Parts in between are not fsynced: a machine crash may lose or garble
their bytes, which the final digest check turns into a fresh upload. A part may be cut
short (a request past its time limit, a dropped connection, a killed coordinator): what
arrived stays, :meth:`BlobStore.upload_state` says where to resume, and a part resent from
an older offset is refused with the offset to use. Hashing and disk writes run on a worker
thread, overlapped with receiving the next bytes.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crossfed.coordinator.faults import crash_point
from crossfed.fileio import replace_durably
from crossfed.wire.digests import (
    CHUNK,
    DigestError,
    Hasher,
    canonical_digest,
    new_hasher,
    parse_digest,
)
from crossfed.wire.libc import start_writeback

#: bytes handed to the worker thread at once
BATCH = 8 << 20
_PART_NAME = re.compile(r"^(blake3|sha256)-([0-9a-f]{64})\.part$")


class BlobError(ValueError):
    """A bad key, a digest mismatch or an oversized body; ``status`` is the HTTP code."""

    def __init__(
        self, message: str, status: int = 400, code: str = "bad_blob", **extra: Any
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.extra = status, code, extra


def check_key(key: str) -> str:
    """The canonical ``algo:hex`` form of a blob key; anything else (paths included) is refused."""
    try:
        return canonical_digest(key)
    except DigestError as exc:
        raise BlobError(f"bad blob key: {exc}") from exc


@dataclass
class _Upload:
    """An upload in progress: bytes on disk and the hash of exactly those bytes."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    hasher: Hasher | None = None
    hashed: int = 0  # bytes the hasher has seen (== staged size when it is valid)


class BlobStore:
    """Blobs under ``root/<algo>/ab/abcdef...``; writes are atomic and verified."""

    def __init__(self, root: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self.clock = clock
        self.root.mkdir(parents=True, exist_ok=True)
        self.staging = root / ".uploads"
        self.staging.mkdir(exist_ok=True)
        self._uploads: dict[str, _Upload] = {}

    # ------------------------------------------------------------------ naming
    def path(self, key: str) -> Path:
        algo, hexdigest = parse_digest(check_key(key))
        return self.root / algo / hexdigest[:2] / hexdigest

    def _part_path(self, key: str) -> Path:
        algo, hexdigest = parse_digest(check_key(key))
        return self.staging / f"{algo}-{hexdigest}.part"

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def size(self, key: str) -> int:
        return self.path(key).stat().st_size

    def upload_state(self, key: str) -> dict[str, Any]:
        """``complete`` and the ``offset`` an upload of ``key`` resumes at."""
        key = check_key(key)
        target = self.path(key)
        if target.exists():
            size = target.stat().st_size
            return {"key": key, "complete": True, "offset": size, "bytes": size}
        part = self._part_path(key)
        offset = part.stat().st_size if part.exists() else 0
        return {"key": key, "complete": False, "offset": offset, "bytes": None}

    # ------------------------------------------------------------------ writing
    async def write_stream(
        self,
        key: str,
        chunks: AsyncIterator[bytes],
        max_bytes: int,
        deadline: float | None = None,
    ) -> int:
        """A whole blob in one body; returns its size (see :meth:`write_part`)."""
        state = await self.write_part(key, chunks, max_bytes=max_bytes, deadline=deadline)
        return int(state["bytes"])

    async def write_part(
        self,
        key: str,
        chunks: AsyncIterator[bytes],
        *,
        offset: int = 0,
        total: int | None = None,
        max_bytes: int,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """Append a body at ``offset`` of the upload of ``key``; finish it at ``total`` bytes.

        ``total=None`` means this body is the rest of the blob. ``deadline`` (a
        ``time.monotonic()`` value) cuts the part short once its first bytes arrived: what
        arrived is kept and a 408 says where to resume. Returns :meth:`upload_state` after
        the part.
        """
        key = check_key(key)
        if total is not None and not 0 <= total <= max_bytes:
            raise BlobError(
                f"blob of {total} bytes exceeds the {max_bytes}-byte limit", 413, "body_too_large"
            )
        if self.exists(key):  # idempotent for the same bytes; other bytes are refused
            return await self._match_existing(key, chunks, offset, total)
        upload = self._uploads.setdefault(key, _Upload())  # kept until the blob is complete
        async with upload.lock:
            state = await self._write_locked(
                key, upload, chunks, offset, total, max_bytes, deadline
            )
        if state["complete"] and self._uploads.get(key) is upload and not upload.lock.locked():
            del self._uploads[key]
        return state

    async def _write_locked(
        self,
        key: str,
        upload: _Upload,
        chunks: AsyncIterator[bytes],
        offset: int,
        total: int | None,
        max_bytes: int,
        deadline: float | None,
    ) -> dict[str, Any]:
        if self.exists(key):  # finished by a request that held the lock before us
            return await self._match_existing(key, chunks, offset, total)
        part = self._part_path(key)
        staged = part.stat().st_size if part.exists() else 0
        if offset == 0 and staged:
            part.unlink()  # a fresh start discards an old partial upload
            staged, upload.hasher, upload.hashed = 0, None, 0
        if offset != staged:
            raise BlobError(
                f"upload of {key} resumes at byte {staged}, not {offset}",
                409,
                "upload_offset",
                offset=staged,
            )
        if upload.hasher is None or upload.hashed != staged:
            upload.hasher = await asyncio.to_thread(_hash_prefix, part, key, staged)
            upload.hashed = staged
        limit = max_bytes if total is None else total
        loop = asyncio.get_running_loop()
        part.parent.mkdir(parents=True, exist_ok=True)  # recreated if deleted under us
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        pending: asyncio.Future[None] | None = None
        batch: list[bytes] = []
        batched = 0
        received = staged
        timed_out = False
        broken: Exception | None = None
        hasher = upload.hasher

        def absorb(pieces: list[bytes]) -> None:
            for piece in pieces:
                view = memoryview(piece)
                while view:
                    view = view[os.write(fd, view) :]
                hasher.update(piece)  # after the write: hashed bytes are always on disk
                upload.hashed += len(piece)
            start_writeback(fd)

        try:
            try:
                # the clock starts with the first bytes: a part always keeps at least one
                # chunk, so a bound shorter than one chunk's transfer still makes progress
                async with asyncio.timeout(None) as bound:
                    async for chunk in chunks:
                        if not chunk:
                            continue
                        if bound.when() is None and deadline is not None:
                            bound.reschedule(_loop_time(loop, deadline))
                        received += len(chunk)
                        if received > limit:
                            if total is None:
                                raise BlobError(
                                    f"blob exceeds the {max_bytes}-byte limit",
                                    413,
                                    "body_too_large",
                                )
                            raise BlobError(
                                f"body runs past the declared total of {total} bytes", 400
                            )
                        batch.append(chunk)
                        batched += len(chunk)
                        if batched >= BATCH:
                            if pending is not None:
                                await pending
                            pending = loop.run_in_executor(None, absorb, batch)
                            batch, batched = [], 0
            except TimeoutError:
                timed_out = True
            except BlobError:
                raise
            except Exception as exc:  # the body broke off (client gone, connection reset):
                broken = exc  # what arrived is kept, so the upload resumes after it
            if pending is not None:
                await pending
                pending = None
            if batch:
                await loop.run_in_executor(None, absorb, batch)
            if broken is not None:
                raise broken
            if total is None or upload.hashed >= total:  # parts in between are not fsynced:
                await asyncio.to_thread(os.fsync, fd)  # the final digest check covers them
        finally:
            if pending is not None:  # cancelled: let the worker finish before closing
                await asyncio.shield(pending)
            os.close(fd)
        crash_point("after_upload_part")
        done = upload.hashed
        if timed_out:
            raise BlobError(
                f"request exceeded its time limit; upload of {key} resumes at byte {done}",
                408,
                "request_timeout",
                offset=done,
            )
        if total is not None and done < total:
            return {"key": key, "complete": False, "offset": done, "bytes": None}
        actual = hasher.hexdigest()
        algo, expected = parse_digest(key)
        upload.hasher, upload.hashed = None, 0
        if actual != expected:
            part.unlink(missing_ok=True)
            raise BlobError(
                f"blob digest mismatch: body hashes to {algo}:{actual}, key says {key} "
                "(truncated or corrupted upload; retry)",
                422,
                "digest_mismatch",
                offset=0,
            )
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        replace_durably(part, target)
        return {"key": key, "complete": True, "offset": done, "bytes": done}

    async def _match_existing(
        self, key: str, chunks: AsyncIterator[bytes], offset: int, total: int | None
    ) -> dict[str, Any]:
        """A body sent for a blob that is already complete: the same bytes at ``offset`` (to
        the end when ``total`` is None) are answered as a finished upload; any other bytes
        are refused with 409 and the stored blob stays as it is (a key names one content)."""
        path = self.path(key)
        size = path.stat().st_size
        same = offset <= size and (total is None or total == size)
        position = offset
        batch: list[bytes] = []
        batched = 0
        fd = os.open(path, os.O_RDONLY)

        async def compare() -> bool:
            data = b"".join(batch)
            start = position - len(data)
            stored = await asyncio.to_thread(os.pread, fd, len(data), start)
            return stored == data

        try:
            async for chunk in chunks:  # read to the end either way (keeps the connection)
                if not same or not chunk:
                    continue
                position += len(chunk)
                if position > size:
                    same = False
                    continue
                batch.append(chunk)
                batched += len(chunk)
                if batched >= BATCH:
                    same = await compare()
                    batch, batched = [], 0
            if same and batch:
                same = await compare()
        finally:
            os.close(fd)
        if same and total is None and position != size:
            same = False  # a body meant to be the rest of the blob ends early
        if not same:
            raise BlobError(
                f"blob {key} is already stored ({size} bytes) and these bytes differ from it; "
                "a content-addressed key names exactly one content",
                409,
                "blob_exists",
            )
        return self.upload_state(key)

    # ------------------------------------------------------------------ joining
    async def compose(self, key: str, parts: list[str]) -> dict[str, Any]:
        """Blob ``key`` as the concatenation of complete blobs ``parts`` (an upload sent as
        byte ranges over several connections), copied in chunks and checked against
        ``key``; a stored ``key`` is answered as complete once the parts are shown to hash
        to it. Returns :meth:`upload_state`."""
        key = check_key(key)
        parts = [check_key(part) for part in parts]
        if missing := [part for part in parts if not self.exists(part)]:
            raise BlobError(
                f"cannot join {key}: part(s) {missing} are not stored; upload them first",
                404,
                "unknown_blob",
                missing=missing,
            )
        upload = self._uploads.setdefault(key, _Upload())
        async with upload.lock:
            stored = self.exists(key)
            out = None if stored else self._part_path(key)
            try:
                actual = await asyncio.to_thread(
                    _concatenate, [self.path(part) for part in parts], out, key
                )
            except FileNotFoundError as exc:  # a part pruned while being read
                raise BlobError(
                    f"cannot join {key}: a part vanished ({exc.filename}); upload it again",
                    404,
                    "unknown_blob",
                ) from exc
            if actual != key:
                if out is not None:
                    out.unlink(missing_ok=True)
                raise BlobError(
                    f"the parts join to {actual}, not {key}", 422, "digest_mismatch", offset=0
                )
            if out is not None:
                target = self.path(key)
                target.parent.mkdir(parents=True, exist_ok=True)
                replace_durably(out, target)
        if self._uploads.get(key) is upload and not upload.lock.locked():
            del self._uploads[key]
        return self.upload_state(key)

    # ------------------------------------------------------------------ retention
    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def keys(self) -> list[str]:
        """Every complete blob's key."""
        found = []
        for algo in ("blake3", "sha256"):
            base = self.root / algo
            if base.is_dir():
                found += [f"{algo}:{p.name}" for p in base.glob("??/*") if _is_hex(p.name)]
        return found

    def prune(self, drop: Iterable[str], keep: Iterable[str], grace_s: float) -> list[str]:
        """Delete blobs in ``drop``, and blobs or partial uploads in neither set whose last
        write is older than ``grace_s`` (uploaded but never submitted). Returns the keys
        deleted."""
        drop_set = {check_key(k) for k in drop}
        keep_set = {check_key(k) for k in keep} - drop_set
        cutoff = self.clock() - grace_s
        deleted = []
        for key in self.keys():
            if key in keep_set:
                continue
            path = self.path(key)
            if key in drop_set or _mtime(path) < cutoff:
                path.unlink(missing_ok=True)
                deleted.append(key)
        for part in self.staging.iterdir() if self.staging.is_dir() else ():
            match = _PART_NAME.match(part.name)
            if match is None:
                continue
            key = f"{match.group(1)}:{match.group(2)}"
            upload = self._uploads.get(key)
            if key in keep_set or (upload is not None and upload.lock.locked()):
                continue  # in progress right now
            if key in drop_set or _mtime(part) < cutoff:
                part.unlink(missing_ok=True)
                self._uploads.pop(key, None)
                deleted.append(key)
        return deleted


def _is_hex(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def _loop_time(loop: asyncio.AbstractEventLoop, deadline: float | None) -> float | None:
    """A ``time.monotonic()`` deadline on the event loop's clock."""
    if deadline is None:
        return None
    return loop.time() + (deadline - time.monotonic())


def _hash_prefix(part: Path, key: str, size: int) -> Hasher:
    """The hasher state after the first ``size`` staged bytes (a resumed upload)."""
    algo, _ = parse_digest(key)
    hasher = new_hasher(algo)
    if size:
        with open(part, "rb", buffering=0) as handle:
            left = size
            while left > 0:
                chunk = handle.read(min(CHUNK, left))
                if not chunk:
                    break
                hasher.update(chunk)
                left -= len(chunk)
    return hasher


def _concatenate(parts: list[Path], out: Path | None, key: str) -> str:
    """Hash ``parts`` in order (the digest algorithm of ``key``), writing them to ``out``
    (fsynced) unless it is None; returns the ``algo:hex`` digest."""
    algo, _ = parse_digest(key)
    hasher = new_hasher(algo)
    fd = None if out is None else os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for part in parts:
            with open(part, "rb", buffering=0) as handle:
                while chunk := handle.read(CHUNK):
                    hasher.update(chunk)
                    if fd is not None:
                        view = memoryview(chunk)
                        while view:
                            view = view[os.write(fd, view) :]
        if fd is not None:
            os.fsync(fd)
    finally:
        if fd is not None:
            os.close(fd)
    return f"{algo}:{hasher.hexdigest()}"
