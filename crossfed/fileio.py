"""Weight files as bytes, without torch: digests, chunked reads, write-back and fsync.

What the coordinator client and the blob store need to move and check files; the tensor
side (safetensors layout, deltas) is :mod:`crossfed.transport`, which re-exports these. A
job that only downloads a file (the workflow's merge job) imports this, not torch.

Digests name their algorithm: ``"blake3:<64 hex>"`` (the default: several times faster than
SHA-256 on one core) or ``"sha256:<64 hex>"``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import blake3

#: default inline/blob threshold: the paper's 2 GiB message cap
INLINE_MAX_BYTES = 2 * 1024**3
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


def digest_file(path: Path, algo: str = DEFAULT_ALGO) -> str:
    """``algo:hex`` digest of a file, read in large chunks."""
    hasher = new_hasher(algo)
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        while n := handle.readinto(buffer):
            hasher.update(view[:n])
    return f"{algo}:{hasher.hexdigest()}"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file (no algorithm prefix)."""
    return parse_digest(digest_file(path, "sha256"))[1]


def _libc_function(name: str) -> Any:
    """A function of the C library (Linux only), or None where it does not exist."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return getattr(libc, name)
    except (OSError, AttributeError):
        return None


def _sync_file_range() -> Callable[..., int] | None:
    fn = _libc_function("sync_file_range")
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
#: allocations below this come from the heap, not a fresh mmap (which page-faults anew)
HEAP_MAX_ALLOC = 64 << 20
#: free memory kept at the top of the heap instead of being handed back and faulted in again
HEAP_KEEP_FREE = 256 << 20


def keep_stream_buffers_in_heap() -> bool:
    """Have glibc serve the few-MiB buffers of a weight transfer from its heap.

    By default each 4 MiB read buffer or received batch is a fresh ``mmap`` whose pages
    fault in on first touch, and a freed heap top is trimmed and refaulted. Raising both
    thresholds cut bench/transport.py's CPU per GB by about a tenth. Call it once at the
    start of a process that moves weights (the coordinator, a site job). False where the
    C library has no ``mallopt`` (not glibc)."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_MAX_ALLOC)) and bool(
        mallopt(_M_TRIM_THRESHOLD, HEAP_KEEP_FREE)
    )


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2
#: bytes written between two :func:`start_writeback` calls in :func:`save_stream`
WRITEBACK_EVERY = 32 << 20


def start_writeback(fd: int) -> None:
    """Have the kernel start writing ``fd``'s dirty pages to disk now, without waiting
    (Linux ``sync_file_range``), so the closing fsync finds little left to write and the disk
    works while the network does. A no-op where that call does not exist."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def kept_model_path(results: Path, generation: int) -> Path:
    """Where a run folder keeps generation ``generation``'s global model, no rule's output.

    The coordinator keeps only its last few generations; the workflow's checkpoint under
    ``results/checkpoints`` is a hard link to this copy, so a rerun that deleted the
    checkpoint finds the model here again.
    """
    return Path(results) / ".crossfed" / "models" / f"global-{generation}.safetensors"


def link_or_copy(source: Path, dest: Path) -> None:
    """``dest`` as a hard link to ``source`` (a copy across filesystems), replaced atomically."""
    import shutil

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.link")
    try:
        os.link(source, tmp)
    except OSError:  # another filesystem
        shutil.copyfile(source, tmp)
    os.replace(tmp, dest)


def keep_global_model(downloaded: Path, results: Path, generation: int) -> None:
    """Keep a global model a site loop downloaded as the run folder's copy (if it has none).

    A site loop trains the rounds back to back and may run rounds ahead of the workflow's
    merge jobs, which secure each round's model; this copy spares them a download the
    coordinator may no longer serve.
    """
    kept = kept_model_path(results, generation)
    if not kept.exists():
        link_or_copy(downloaded, kept)
