"""Weights on the wire: safetensors files, streamed tensor by tensor and digested as written.

A file is written once, in the safetensors layout (8-byte header length, JSON header, raw
little-endian tensor bytes), one tensor at a time: the writer never holds a second copy of
the model, and the digest that names the file on the wire is computed from the same bytes
as they go to disk. Files appear atomically (:func:`crossfed.fileio.atomic_file`: temp
file, fsync, rename, fsync of the folder). Files are read back lazily (:func:`open_tensors`)
or with ``pread`` into tensors the reader owns (:class:`TensorFile`).

Digests are :mod:`crossfed.wire.digests`, delta arithmetic :mod:`crossfed.wire.deltas`,
codecs :mod:`crossfed.wire.codecs`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from crossfed.fileio import atomic_file
from crossfed.wire.digests import CHUNK, DEFAULT_ALGO, Hasher, new_hasher
from crossfed.wire.libc import WRITEBACK_EVERY, start_writeback

#: torch dtype -> safetensors dtype name
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


#: ``progress(fd, n)``: the first ``n`` bytes of the file open as ``fd`` are written
Progress = Callable[[int, int], None]


# --------------------------------------------------------------------------- safetensors
@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor in a file, known before its bytes exist."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> TensorSpec:
        return cls(name, dtype or tensor.dtype, tuple(tensor.shape))


def safetensors_header(
    specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None
) -> bytes:
    """Length prefix plus JSON header for tensors stored back to back in ``specs`` order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for spec in specs:
        if spec.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {spec.name!r}: dtype {spec.dtype} has no safetensors name")
        if spec.name in header:
            raise ValueError(f"tensor name {spec.name!r} appears twice")
        size = spec.nbytes
        header[spec.name] = {
            "dtype": DTYPE_NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # tensor data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (it must be contiguous and on the CPU)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


class StreamWriter:
    """An open safetensors file being written tensor by tensor, in the order of its specs.

    Made by :func:`stream_writer`; :meth:`write` checks each tensor against its spec, writes
    it and keeps no reference to it. ``digest`` is set once the file is in place.
    """

    def __init__(
        self,
        handle: Any,
        specs: Sequence[TensorSpec],
        hasher: Hasher | None,
        progress: Progress | None = None,
    ) -> None:
        self._handle, self._hasher, self._progress = handle, hasher, progress
        self._specs = list(specs)
        self._next = 0
        self._done: dict[int, int] = {}  # bytes written so far of tensors written in parts
        self._unsynced = 0
        self._written = 0  # bytes written in order from the file's start
        self.digest = ""

    def _put(self, data: bytes | memoryview) -> None:
        if self._hasher is not None:
            self._hasher.update(data)
        view = memoryview(data)
        self._unsynced += len(view)
        self._written += len(view)
        while view:
            view = view[self._handle.write(view) :]
        if self._unsynced >= WRITEBACK_EVERY:
            start_writeback(self._handle.fileno())
            self._unsynced = 0
        if self._progress is not None:
            self._progress(self._handle.fileno(), self._written)

    def write(self, tensor: torch.Tensor) -> None:
        """Write the next tensor; it must match the next spec's dtype and shape."""
        if self._next >= len(self._specs):
            raise ValueError(f"all {len(self._specs)} tensors of the header are written")
        spec = self._specs[self._next]
        if self._next in self._done:
            raise ValueError(f"tensor {spec.name!r} is being written in parts")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"tensor {spec.name!r} is {tensor.dtype} {tuple(tensor.shape)}; "
                f"its header says {spec.dtype} {spec.shape}"
            )
        tensor = tensor.detach().to("cpu").contiguous()
        data = _raw_bytes(tensor)
        for lo in range(0, len(data), CHUNK):
            self._put(data[lo : lo + CHUNK])
        self._next += 1

    def write_part(self, rows: torch.Tensor, *, ahead: int = 0) -> None:
        """Write the next rows (of the first dimension) of the next tensor, or, ``ahead``
        specs after it, of a later one: those go to their place in the file with ``pwrite``,
        so only a file with no digest takes them. A tensor is written once all its rows are;
        the file is the same as if each tensor had been written whole, in order."""
        index = self._next + ahead
        if ahead < 0 or index >= len(self._specs):
            raise ValueError(f"no tensor {ahead} after the next of {len(self._specs)}")
        if ahead and self._hasher is not None:
            raise ValueError("a digested file is written in order")
        spec = self._specs[index]
        if rows.dtype != spec.dtype or not spec.shape or tuple(rows.shape[1:]) != spec.shape[1:]:
            raise ValueError(
                f"rows {rows.dtype} {tuple(rows.shape)} are not rows of tensor {spec.name!r} "
                f"{spec.dtype} {spec.shape}"
            )
        data = _raw_bytes(rows.detach().to("cpu").contiguous())
        done = self._done.get(index, 0)
        if done + len(data) > spec.nbytes:
            raise ValueError(f"rows past the end of tensor {spec.name!r}")
        if ahead == 0:
            for lo in range(0, len(data), CHUNK):
                self._put(data[lo : lo + CHUNK])
        else:
            fd = self._handle.fileno()
            at = self._handle.tell() - self._done.get(self._next, 0) + done
            at += sum(s.nbytes for s in self._specs[self._next : index])
            put = 0
            while put < len(data):
                put += os.pwrite(fd, data[put:], at + put)
            self._unsynced += len(data)
            if self._unsynced >= WRITEBACK_EVERY:
                start_writeback(fd)
                self._unsynced = 0
        self._done[index] = done + len(data)
        while self._next in self._done and self._done[self._next] == self._specs[self._next].nbytes:
            if self._next != index or ahead:  # written ahead: step over it
                self._handle.seek(self._specs[self._next].nbytes, os.SEEK_CUR)
            del self._done[self._next]
            self._next += 1

    @property
    def spec(self) -> TensorSpec:
        """The spec of the tensor :meth:`write` expects next."""
        return self._specs[self._next]

    @property
    def complete(self) -> bool:
        return self._next == len(self._specs)


@contextmanager
def stream_writer(
    path: Path,
    specs: Sequence[TensorSpec],
    metadata: Mapping[str, str] | None = None,
    *,
    algo: str | None = DEFAULT_ALGO,
    progress: Progress | None = None,
) -> Iterator[StreamWriter]:
    """A safetensors file written atomically: the header now, each tensor by
    :meth:`StreamWriter.write`, and the file in place (fsync, rename, fsync of the folder)
    when the block ends with every tensor written. An exception leaves no file behind.

    ``progress(fd, n)``, if given, is called each time the first ``n`` bytes of the file are
    written (``fd``: the temp file being written; the file must be written in order)."""
    if progress is not None and algo is None:
        raise ValueError("progress is reported for a file written in order: give it a digest")
    hasher = new_hasher(algo) if algo else None
    with atomic_file(path, buffering=0) as handle:
        writer = StreamWriter(handle, specs, hasher, progress)
        writer._put(safetensors_header(specs, metadata))
        yield writer
        if not writer.complete:
            raise ValueError(f"{path.name}: {writer._next} of {len(writer._specs)} tensors written")
    writer.digest = f"{algo}:{hasher.hexdigest()}" if hasher is not None else ""


def save_stream(
    path: Path,
    specs: Sequence[TensorSpec],
    produce: Callable[[TensorSpec], torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    algo: str | None = DEFAULT_ALGO,
) -> str:
    """Write a safetensors file atomically, asking ``produce`` for one tensor at a time.

    Each produced tensor must match its spec (dtype and shape); it is written and dropped
    before the next is made. Returns the file's ``algo:hex`` digest ("" when ``algo`` is None).
    """
    with stream_writer(path, specs, metadata, algo=algo) as writer:
        for spec in specs:
            writer.write(produce(spec))
    return writer.digest


def save_tensors(
    tensors: Mapping[str, torch.Tensor],
    path: Path,
    metadata: Mapping[str, str] | None = None,
    *,
    dtype: torch.dtype | None = None,
    algo: str | None = DEFAULT_ALGO,
) -> str:
    """Write ``tensors`` (cast to ``dtype`` one at a time, if given); returns the digest."""
    specs = [TensorSpec.of(name, t, dtype) for name, t in tensors.items()]
    return save_stream(
        path, specs, lambda spec: tensors[spec.name].to(spec.dtype), metadata, algo=algo
    )


def save_atomic(
    tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write a safetensors file via temp file, fsync and rename: readers see all or nothing."""
    save_tensors(tensors, path, metadata, algo=None)
    return path


class LazyTensors(Mapping[str, torch.Tensor]):
    """Read-once view of an open safetensors file: a tensor is loaded when asked for."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._names = list(handle.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self.handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@contextmanager
def open_tensors(path: Path) -> Iterator[LazyTensors]:
    """A safetensors file as a lazy mapping (no tensor is read until it is asked for)."""
    with safe_open(str(path), framework="pt") as handle:
        yield LazyTensors(handle)


#: safetensors dtype name -> torch dtype
DTYPES_BY_NAME: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}
#: a safetensors header longer than this is refused (the format's own limit is 100 MB)
HEADER_MAX_BYTES = 100_000_000
#: bytes per ``pread`` when reading a tensor into memory
READ_CHUNK = 64 << 20


class TensorFile:
    """A safetensors file read tensor by tensor with ``pread``, into tensors the caller owns.

    ``safe_open`` maps the whole file copy-on-write: its tensors are views of that map, and
    writing to one turns the touched pages into private memory until the file is closed.
    Here each tensor is read into a fresh tensor, or into ``out`` (a buffer kept across
    tensors), so a reader holds exactly the tensors it keeps and nothing of the file. Offers
    ``keys``, ``metadata`` and ``get_tensor`` like a ``safe_open`` handle.
    """

    #: each read waits out a round trip (an object store): a reader gains by reading ahead
    remote = False

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self._meta, self._entries = self._parse(os.fstat(self._fd).st_size)
        except BaseException:
            os.close(self._fd)
            raise

    def _pread(self, length: int, offset: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (a subclass may read them from elsewhere)."""
        return os.pread(self._fd, length, offset)

    def _readinto(self, view: memoryview, offset: int) -> int:
        """Bytes at ``offset`` into ``view``; how many were read (0: the end of the file)."""
        return os.preadv(self._fd, [view], offset)

    def _parse(self, size: int) -> tuple[dict[str, str] | None, dict[str, tuple[TensorSpec, int]]]:
        """The header's metadata and, per tensor, its spec and absolute byte offset."""
        where = f"{self.path.name}:"
        prefix = self._pread(8, 0)
        if len(prefix) < 8:
            raise ValueError(f"{where} {size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(HEADER_MAX_BYTES, size - 8):
            raise ValueError(f"{where} header length {length} does not fit the {size}-byte file")
        try:
            header = json.loads(self._pread(length, 8))
        except ValueError as exc:
            raise ValueError(f"{where} the header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise ValueError(f"{where} the header is not a JSON object")
        meta = header.pop("__metadata__", None)
        base, entries = 8 + length, {}
        for name, entry in header.items():
            try:
                dtype = DTYPES_BY_NAME[entry["dtype"]]
                shape = tuple(int(d) for d in entry["shape"])
                start, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{where} tensor {name!r} has a malformed entry") from None
            spec = TensorSpec(name, dtype, shape)
            if min(shape, default=0) < 0 or end - start != spec.nbytes or base + end > size:
                raise ValueError(
                    f"{where} tensor {name!r} {entry['dtype']} {list(shape)} at bytes "
                    f"{start}..{end} does not fit its size or the file"
                )
            entries[name] = (spec, base + start)
        return meta, entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def metadata(self) -> dict[str, str] | None:
        return None if self._meta is None else dict(self._meta)

    def spec(self, name: str) -> TensorSpec:
        if name not in self._entries:
            raise KeyError(name)
        return self._entries[name][0]

    def read(
        self, name: str, out: torch.Tensor | None = None, *, rows: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Tensor ``name``, read into a new tensor or into the front of ``out`` (a contiguous
        buffer of the same dtype with room for it): the result is then a view of ``out``.
        ``rows=(lo, hi)`` reads only those rows (of the first dimension)."""
        spec, offset = self._entries[name]
        shape = spec.shape
        if rows is not None:
            lo, hi = rows
            if not shape or not 0 <= lo < hi <= shape[0]:
                raise ValueError(f"{self.path.name}: rows {lo}:{hi} are not rows of {spec}")
            offset += lo * (spec.nbytes // shape[0])
            shape = (hi - lo, *shape[1:])
        numel = math.prod(shape)
        if out is None:
            tensor = torch.empty(shape, dtype=spec.dtype)
        elif out.dtype != spec.dtype or not out.is_contiguous() or out.numel() < numel:
            raise ValueError(f"buffer {out.dtype} x{out.numel()} cannot hold {spec}")
        else:
            tensor = out.view(-1)[:numel].view(shape)
        self._fill(_raw_bytes(tensor), offset, name)
        return tensor

    def _fill(self, view: memoryview, offset: int, name: str) -> None:
        """All of ``view`` from the file at ``offset`` (in reads of at most
        :data:`READ_CHUNK`); a file that ends first is tensor ``name`` cut short."""
        done = 0
        while done < len(view):
            n = self._readinto(view[done : done + READ_CHUNK], offset + done)
            if n == 0:
                raise ValueError(f"{self.path.name}: tensor {name!r} is cut short")
            done += n

    def get_tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a new tensor (``safe_open`` handle's spelling)."""
        return self.read(name)

    def read_many(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Tensors ``names`` as new tensors, each run of them that lies back to back in the
        file read in one read (many small tensors, such as a delta's second-moment factors,
        then cost one ranged ``GET`` of an object instead of one each)."""
        spans = sorted((self._entries[n][1], n) for n in names)
        out: dict[str, torch.Tensor] = {}
        run: list[tuple[int, str]] = []
        for offset, name in spans:
            if run and offset != run[-1][0] + self._entries[run[-1][1]][0].nbytes:
                out.update(self._read_run(run))
                run = []
            run.append((offset, name))
        if run:
            out.update(self._read_run(run))
        return {n: out[n] for n in names}

    def _read_run(self, run: Sequence[tuple[int, str]]) -> dict[str, torch.Tensor]:
        """Tensors lying back to back from ``run[0]``'s offset, read at once."""
        start = run[0][0]
        end = run[-1][0] + self._entries[run[-1][1]][0].nbytes
        view = memoryview(bytearray(end - start))
        self._fill(view, start, run[-1][1])
        tensors = {}
        for offset, name in run:
            spec = self._entries[name][0]
            tensor = torch.empty(spec.shape, dtype=spec.dtype)
            if spec.nbytes:
                _raw_bytes(tensor)[:] = view[offset - start : offset - start + spec.nbytes]
            tensors[name] = tensor
        return tensors

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
