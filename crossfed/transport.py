"""Former home of the weights format, now :mod:`crossfed.wire`; its names stay importable here.

``crossfed.coordinator.service`` still imports ``digest_file`` from this module; new code
imports from :mod:`crossfed.wire.tensors`, :mod:`crossfed.wire.deltas`,
:mod:`crossfed.wire.digests` and :mod:`crossfed.wire.libc`. Drop this module once nothing
imports it.
"""

from __future__ import annotations

from crossfed.fileio import INLINE_MAX_BYTES, fsync_dir
from crossfed.wire.deltas import delta_of, delta_tensor, save_delta, to_bf16
from crossfed.wire.digests import (
    ALGOS,
    CHUNK,
    DEFAULT_ALGO,
    PART_BYTES,
    DigestError,
    Hasher,
    canonical_digest,
    digest_file,
    iter_chunks,
    new_hasher,
    parse_digest,
    sha256_file,
)
from crossfed.wire.libc import (
    HEAP_KEEP_FREE,
    HEAP_MAX_ALLOC,
    WRITEBACK_EVERY,
    keep_stream_buffers_in_heap,
    start_writeback,
)
from crossfed.wire.tensors import (
    DTYPE_NAMES,
    DTYPES_BY_NAME,
    HEADER_MAX_BYTES,
    READ_CHUNK,
    LazyTensors,
    StreamWriter,
    TensorFile,
    TensorSpec,
    open_tensors,
    safetensors_header,
    save_atomic,
    save_stream,
    save_tensors,
    stream_writer,
)

__all__ = [
    "ALGOS",
    "CHUNK",
    "DEFAULT_ALGO",
    "DTYPES_BY_NAME",
    "DTYPE_NAMES",
    "HEADER_MAX_BYTES",
    "HEAP_KEEP_FREE",
    "HEAP_MAX_ALLOC",
    "INLINE_MAX_BYTES",
    "PART_BYTES",
    "READ_CHUNK",
    "WRITEBACK_EVERY",
    "DigestError",
    "Hasher",
    "LazyTensors",
    "StreamWriter",
    "TensorFile",
    "TensorSpec",
    "canonical_digest",
    "delta_of",
    "delta_tensor",
    "digest_file",
    "fsync_dir",
    "iter_chunks",
    "keep_stream_buffers_in_heap",
    "new_hasher",
    "open_tensors",
    "parse_digest",
    "safetensors_header",
    "save_atomic",
    "save_delta",
    "save_stream",
    "save_tensors",
    "sha256_file",
    "start_writeback",
    "stream_writer",
    "to_bf16",
]
