"""Content-addressed blob store on disk: PUT streams in, hash checked, renamed into place."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path

from crossfed.transport import fsync_dir

_KEY = re.compile(r"^[0-9a-f]{64}$")


class BlobError(ValueError):
    """A bad key, a digest mismatch or an oversized body; ``status`` is the HTTP code."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def check_key(key: str) -> str:
    """Blob keys are lowercase hex SHA-256 digests; anything else (paths included) is refused."""
    if not _KEY.match(key):
        raise BlobError(f"blob key must be a 64-character lowercase hex SHA-256, got {key[:80]!r}")
    return key


class BlobStore:
    """Blobs under ``root/ab/abcdef...``; writes are atomic and verified."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        check_key(key)
        return self.root / key[:2] / key

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    async def write_stream(self, key: str, chunks: AsyncIterator[bytes], max_bytes: int) -> int:
        """Stream a body to disk while hashing; keep it only if its SHA-256 equals ``key``."""
        target = self.path(key)
        if target.exists():
            async for _ in chunks:  # drain: the client sent it anyway
                pass
            return target.stat().st_size
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{key}.{os.getpid()}.{id(chunks)}.part")
        digest = hashlib.sha256()
        size = 0
        try:
            with open(tmp, "wb") as handle:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise BlobError(f"blob exceeds the {max_bytes}-byte limit", status=413)
                    digest.update(chunk)
                    handle.write(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            actual = digest.hexdigest()
            if actual != key:
                raise BlobError(
                    f"blob digest mismatch: body hashes to {actual}, key says {key} "
                    "(truncated or corrupted upload; retry)",
                    status=422,
                )
            os.replace(tmp, target)
            fsync_dir(target.parent)
        finally:
            tmp.unlink(missing_ok=True)
        return size

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)
