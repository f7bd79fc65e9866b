"""Weight files as bytes, without torch: digests that name their algorithm, chunked reads.

What the coordinator client and the blob store need to move and check files. A job that
only downloads a file (the workflow's merge job) imports this, not torch.

Digests name their algorithm: ``"blake3:<64 hex>"`` (the default: several times faster than
SHA-256 on one core) or ``"sha256:<64 hex>"``.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import blake3

#: bytes per read/write/hash call when streaming files
CHUNK = 4 << 20
#: bytes per upload request or download range: one short HTTP request's worth
PART_BYTES = 64 << 20
#: digest algorithm for new files
DEFAULT_ALGO = "blake3"
ALGOS = ("blake3", "sha256")

_DIGEST = re.compile(r"^(blake3|sha256):([0-9a-f]{64})$")
_BARE_HEX = re.compile(r"^[0-9a-f]{64}$")


class DigestError(ValueError):
    """A digest string that is not ``<algorithm>:<64 lowercase hex>``."""


class Hasher(Protocol):
    def update(self, data: Any, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_hasher(algo: str) -> Hasher:
    """A fresh hasher for ``algo`` (``blake3`` or ``sha256``)."""
    if algo == "blake3":
        return blake3.blake3()
    if algo == "sha256":
        return hashlib.sha256()
    raise DigestError(f"unknown digest algorithm {algo!r}; expected one of {', '.join(ALGOS)}")


def parse_digest(text: str) -> tuple[str, str]:
    """``"blake3:<hex>"`` -> ``("blake3", hex)``; a bare 64-hex string is a legacy SHA-256."""
    if not isinstance(text, str):
        raise DigestError(f"a digest is a string, not {type(text).__name__}")
    if _BARE_HEX.match(text):
        return "sha256", text
    match = _DIGEST.match(text)
    if match is None:
        raise DigestError(
            f"digest must be 'blake3:<64 lowercase hex>' or 'sha256:<64 lowercase hex>', "
            f"got {text[:80]!r}"
        )
    return match.group(1), match.group(2)


def canonical_digest(text: str) -> str:
    """The ``algo:hex`` spelling of a digest (legacy bare hex becomes ``sha256:hex``)."""
    algo, hexdigest = parse_digest(text)
    return f"{algo}:{hexdigest}"


def digest_file(
    path: Path, algo: str = DEFAULT_ALGO, start: int = 0, end: int | None = None
) -> str:
    """``algo:hex`` digest of a file (or of its bytes ``[start, end)``), read in large chunks."""
    hasher = new_hasher(algo)
    for chunk in iter_chunks(path, start, end):
        hasher.update(chunk)
    return f"{algo}:{hasher.hexdigest()}"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file (no algorithm prefix)."""
    return parse_digest(digest_file(path, "sha256"))[1]


def iter_chunks(path: Path, start: int = 0, end: int | None = None) -> Iterable[bytes]:
    """The bytes of ``path`` in ``[start, end)``, in ``CHUNK``-sized pieces."""
    with open(path, "rb", buffering=0) as handle:
        handle.seek(start)
        left = (os.fstat(handle.fileno()).st_size if end is None else end) - start
        while left > 0:
            chunk = handle.read(min(CHUNK, left))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk
