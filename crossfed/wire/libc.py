"""glibc tuning for processes that move weights: heap-served stream buffers, early write-back.

Both are Linux/glibc calls reached through ``ctypes``; where they do not exist (another C
library, another system) each is a no-op that says so. Torch-free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from typing import Any


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
#: bytes written between two :func:`start_writeback` calls while a file is streamed
#: (:func:`crossfed.wire.tensors.save_stream`)
WRITEBACK_EVERY = 32 << 20


def start_writeback(fd: int) -> None:
    """Have the kernel start writing ``fd``'s dirty pages to disk now, without waiting
    (Linux ``sync_file_range``), so the closing fsync finds little left to write and the disk
    works while the network does. A no-op where that call does not exist."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
