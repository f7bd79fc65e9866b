"""A run's model state as files: one generation in, the next generation out, tensor by tensor.

Generation ``g`` is two safetensors files: ``master-g`` holds the fp32 master and momentum
(``momentum::``-prefixed keys; none before the first merge), ``global-g`` the bf16 model the
sites download. A merge (:func:`merge_step` inside :func:`write_generation`) reads ``master-g``
and each delta one tensor at a time, applies Eq. 1 (:func:`crossfed.outer.stream_outer_step`)
and writes both files of ``g+1`` as it goes, so the memory it holds is a few tensors of the
largest size, whatever the size of the model.

The three parts of a merge run side by side, tensor by tensor: a reader thread reads tensor
``i+1``'s master, momentum and deltas while the merge's own thread computes tensor ``i`` and a
writer thread writes (and digests) the tensors already computed. The reader reads each
delta's piece on a thread of its own (one per contributor), beside the master's, so that
the round trips of ranged reads from an object store overlap rather than add up. ``pread``,
``write``, torch's kernels and BLAKE3's ``update`` all release the GIL. The threads hand
tensors over through :data:`SLOTS` buffer pairs, so at most that many tensors are between
the read and the write, and an error in any thread is raised in the merge's thread.

Files are read with ``pread`` (:class:`crossfed.wire.tensors.TensorFile`), never memory-mapped:
a merge's memory is what it allocates. Keys are found by name, so files written with any
tensor order (older coordinators wrote all master tensors before all momentum ones) load alike.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from crossfed import rowcounts
from crossfed.coordinator.faults import crash_point
from crossfed.outer import (
    DELTA_DTYPES,
    DeltaError,
    OuterStepReport,
    StateError,
    _check_keys,
    _names,
    stream_outer_step,
    token_shares,
)
from crossfed.outer_presets import OuterConfig
from crossfed.wire.codecs import decoded
from crossfed.wire.tensors import (
    Progress,
    TensorFile,
    TensorSpec,
    safetensors_header,
    stream_writer,
)

log = logging.getLogger(__name__)
MOMENTUM = "momentum::"
FORMAT = "crossfed-global-v1"
#: ``emit(name, w, b)``: one master tensor and its momentum (None before the first step); it
#: may return an event set once ``w`` and ``b`` are written (their buffers may then be reused)
Emit = Callable[[str, torch.Tensor, "torch.Tensor | None"], "threading.Event | None"]
#: master/momentum buffer pairs a merge cycles through: one tensor read or computed while the
#: one before it is written
SLOTS = 2
#: fp32 bytes of the largest block a merge moves at once: a larger tensor goes through the
#: read, the arithmetic and the write in blocks of its rows of at most about this size, so
#: the writer starts after the first block, not after the first (largest) tensor
PIECE_BYTES = 64 << 20
#: a delta in a store a round trip away (an object store) is read up to this many pieces
#: ahead of the merge, the pieces in flight at most :data:`PIECE_BYTES` of fp32 together
#: beyond the one the merge needs (a constant, whatever the model): read one piece at a
#: time, a Qwen3's 300 tensors wait out 300 round trips, 21 s at 70 ms
READAHEAD_PIECES = 8
_POLL_S = 0.1  # how often a waiting thread checks that the merge still runs
T = TypeVar("T")


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The master's tensor names and shapes, in file order, from a state file's header."""
    with TensorFile(path) as state:
        return {k: state.spec(k).shape for k in state.keys() if not k.startswith(MOMENTUM)}


def largest(shapes: Mapping[str, Sequence[int]]) -> int:
    """Elements of the largest tensor."""
    return max((math.prod(s) for s in shapes.values()), default=0)


@dataclass(frozen=True)
class Piece:
    """Rows ``lo:hi`` of tensor ``name`` (all of it when ``whole``), moved through a merge as
    one item under ``key`` (the name itself when whole)."""

    key: str
    name: str
    lo: int
    hi: int
    shape: tuple[int, ...]
    whole: bool


def pieces(shapes: Mapping[str, Sequence[int]], limit: int | None = None) -> list[Piece]:
    """``shapes``' tensors in order, each larger than ``limit`` fp32 bytes (default
    :data:`PIECE_BYTES`) cut into row blocks of near-equal size. Eq. 1 is elementwise, so a
    tensor merged block by block has the values it has merged whole."""
    limit = PIECE_BYTES if limit is None else limit
    out = []
    for name, dims in shapes.items():
        shape = tuple(dims)
        count = min(shape[0], math.ceil(4 * math.prod(shape) / limit)) if shape else 1
        if count <= 1:
            out.append(Piece(name, name, 0, shape[0] if shape else 1, shape, True))
            continue
        bounds = [shape[0] * k // count for k in range(count + 1)]
        for lo, hi in itertools.pairwise(bounds):
            out.append(Piece(f"{name}[{lo}:{hi}]", name, lo, hi, (hi - lo, *shape[1:]), False))
    return out


class StateView(Mapping[str, torch.Tensor]):
    """One role of a generation's state file, ``master`` (fp32 weights) or ``momentum``
    (``momentum::`` keys), read tensor by tensor.

    Over an open :class:`TensorFile` with a ``buffer``, each tensor is read into the buffer
    and is valid until the next read (the merge reads each tensor once); over a path, each
    read opens the file and returns a new tensor.
    """

    def __init__(
        self, source: TensorFile | Path, *, momentum: bool, buffer: torch.Tensor | None = None
    ) -> None:
        self.source, self.buffer = source, buffer
        self.prefix = MOMENTUM if momentum else ""
        with ExitStack() as files:
            state = (
                source
                if isinstance(source, TensorFile)
                else files.enter_context(TensorFile(source))
            )
            self._names = [
                k.removeprefix(MOMENTUM) for k in state.keys() if k.startswith(MOMENTUM) == momentum
            ]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        if isinstance(self.source, TensorFile):
            return self.source.read(self.prefix + name, self.buffer)
        with TensorFile(self.source) as state:
            return state.read(self.prefix + name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _Writer:
    """A thread that writes a generation's tensors in the order they are emitted: the fp32
    state (``w``, then its momentum) and ``w`` cast to bf16 for the global model (digested as
    written). :meth:`emit` queues a tensor pair, whole or a block of its rows (at most one
    waits), and returns an event set once that pair is written, or dropped after an error.
    The first error stops the writing; :meth:`emit` and :meth:`close` raise it in the
    caller's thread."""

    def __init__(
        self,
        state: Any,
        model: Any,
        shapes: Mapping[str, tuple[int, ...]],
        size: int,
        *,
        momentum: bool,
    ) -> None:
        self.state, self.model, self.momentum = state, model, momentum
        self.shapes = shapes
        self.halfway = len(shapes) // 2
        self.rows = 0  # rows of the current tensor written so far, when written in blocks
        self.bf16 = torch.empty(size, dtype=torch.bfloat16)  # one cast buffer for all
        self.written, self.busy_s = 0, 0.0
        self.error: BaseException | None = None
        self.cancelled = False
        self.queue: queue.Queue[
            tuple[str, torch.Tensor, torch.Tensor | None, threading.Event] | None
        ]
        self.queue = queue.Queue(maxsize=1)
        self.thread = threading.Thread(target=self._run, name="generation-writer", daemon=True)
        self.thread.start()

    def emit(self, name: str, w: torch.Tensor, b: torch.Tensor | None) -> threading.Event:
        if self.error is not None:
            raise self.error
        if self.momentum and b is None:
            raise ValueError(f"no momentum for tensor {name!r}")
        done = threading.Event()
        self.queue.put((name, w, b, done))
        return done

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            name, w, b, done = item
            del item
            try:
                if self.error is None and not self.cancelled:
                    self._write(name, w, b)
            except BaseException as exc:  # raised in the merge's thread
                self.error = exc
            finally:
                del w, b
                done.set()

    def _write(self, name: str, w: torch.Tensor, b: torch.Tensor | None) -> None:
        started = time.perf_counter()
        if w.numel() <= self.bf16.numel():
            bf16 = self.bf16[: w.numel()].view(w.shape).copy_(w)
        else:  # a whole tensor larger than a merge's blocks (a caller that emits tensors whole)
            bf16 = w.to(torch.bfloat16)
        if self.rows == 0 and tuple(w.shape) == tuple(self.shapes.get(name, ())):
            self.state.write(w)
            if self.momentum:
                self.state.write(b)
            self.model.write(bf16)
        else:  # a block of rows: the momentum's go to their place after the master's rows
            if self.momentum:
                self.state.write_part(b, ahead=1)
            self.state.write_part(w)
            self.model.write_part(bf16)
            self.rows += w.shape[0]
            if self.rows < self.shapes[name][0]:
                self.busy_s += time.perf_counter() - started
                return
            self.rows = 0
        self.busy_s += time.perf_counter() - started
        self.written += 1
        if self.written == self.halfway:
            crash_point("inside_generation_write")

    def close(self, *, cancel: bool) -> None:
        """Wait until every queued tensor is written (``cancel``: dropped) and the thread ends;
        raise the writing's error, if any, unless cancelled."""
        self.cancelled = self.cancelled or cancel
        self.queue.put(None)
        self.thread.join()
        if self.error is not None and not cancel:
            raise self.error


def write_generation(
    state_path: Path,
    global_path: Path,
    shapes: Mapping[str, tuple[int, ...]],
    generation: int,
    fill: Callable[[Emit], T],
    *,
    momentum: bool,
    extra: Mapping[str, torch.Tensor] | None = None,
    model_progress: Progress | None = None,
) -> tuple[str, T, float]:
    """Write one generation's two files as ``fill`` produces its tensors.

    ``fill(emit)`` calls ``emit(name, w, b)`` once per tensor of ``shapes``, in order: ``w``
    the fp32 master tensor, ``b`` its momentum (None when ``momentum`` is False). Each goes
    to both files, on a writer thread: the fp32 state (``name`` then ``momentum::name``) and
    the bf16 global model (digested as written). ``emit`` returns at once with an event set
    when the pair is written; ``fill`` must not change the tensors before that. Both files
    are temp files, fsynced and renamed when complete; an exception (in ``fill`` or in the
    writing, raised by the next ``emit`` or here) leaves neither. Returns the global model's
    digest, ``fill``'s result and the seconds the writer spent writing (which overlap the
    rest of the merge). ``extra`` tensors (the sites' merged second-moment factors,
    :mod:`crossfed.moments`) go to the end of the global model as they are.
    ``model_progress`` follows the global model's bytes as they are written (its size is
    :func:`model_file_bytes`): an object store's upload of it runs beside the merge.
    """
    extra = dict(extra or {})
    meta = _meta(generation)
    state_specs = []
    for name, shape in shapes.items():
        state_specs.append(TensorSpec(name, torch.float32, shape))
        if momentum:
            state_specs.append(TensorSpec(MOMENTUM + name, torch.float32, shape))
    global_specs = _model_specs(shapes, extra)
    with (
        stream_writer(state_path, state_specs, meta, algo=None) as state,
        stream_writer(global_path, global_specs, meta, progress=model_progress) as model,
    ):
        size = largest({p.key: p.shape for p in pieces(shapes)})
        writer = _Writer(state, model, shapes, size, momentum=momentum)
        try:
            result = fill(writer.emit)
        except BaseException:
            writer.close(cancel=True)
            raise
        writer.close(cancel=False)
        for value in extra.values():
            model.write(value.contiguous())
    crash_point("after_generation_write")
    return model.digest, result, writer.busy_s


def _meta(generation: int) -> dict[str, str]:
    return {"generation": str(generation), "format": FORMAT}


def _model_specs(
    shapes: Mapping[str, tuple[int, ...]], extra: Mapping[str, torch.Tensor]
) -> list[TensorSpec]:
    """The global model's tensors: the model in bf16, then the ``extra`` tensors as they are."""
    specs = [TensorSpec(name, torch.bfloat16, shape) for name, shape in shapes.items()]
    specs += [TensorSpec(name, v.dtype, tuple(v.shape)) for name, v in extra.items()]
    return specs


def model_file_bytes(
    shapes: Mapping[str, tuple[int, ...]],
    generation: int,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> int:
    """The size of the global model file :func:`write_generation` writes, known before it."""
    specs = _model_specs(shapes, dict(extra or {}))
    return len(safetensors_header(specs, _meta(generation))) + sum(s.nbytes for s in specs)


@dataclass
class _Slot:
    """A master and a momentum buffer of the largest tensor's size; ``written`` is set once
    the tensors last read into them are written (None: free)."""

    master: torch.Tensor
    momentum: torch.Tensor | None
    written: threading.Event | None = None


@dataclass
class _Bundle:
    """One tensor's inputs as read: ``items`` by (role, name), role ``master``, ``momentum``
    or a contributor's index; ``error`` is what reading ``failed`` raised."""

    name: str
    slot: _Slot | None
    items: dict[tuple[str | int, str], torch.Tensor] = field(default_factory=dict)
    failed: tuple[str | int, str] | None = None
    error: BaseException | None = None


class _Prefetch:
    """A thread that reads each piece's master, momentum and live deltas, in ``items``
    order, one piece ahead of the merge: into a free :class:`_Slot` (waiting until the
    tensors last read into it are written) and, for deltas, into fresh tensors (dropped once
    the merge moves on). The merge takes them with :meth:`get` in the same order; a read's
    error is raised there, at the piece whose read failed.

    A plain delta's rows are read block by block; a codec's (int8, int4: scales over the
    flattened tensor) is decoded whole at the tensor's first block and its rows handed out
    from that until the tensor's last. A plain delta whose every read is a round trip (an
    object's, ``TensorFile.remote``) is read ahead: up to :data:`READAHEAD_PIECES` pieces
    at once, :data:`PIECE_BYTES` of them in flight beyond the current one."""

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        items: Sequence[Piece],
        state: TensorFile,
        momentum: bool,
        deltas: Sequence[Mapping[str, torch.Tensor]],
        live: Sequence[int],
        size: int,
    ) -> None:
        self.shapes, self.items, self.state = shapes, list(items), state
        self.deltas, self.live = deltas, list(live)
        self.decoded: dict[int, tuple[str, torch.Tensor]] = {}  # a codec's tensor, whole
        self.free: queue.Queue[_Slot] = queue.Queue()
        for _ in range(SLOTS):
            self.free.put(_Slot(torch.empty(size), torch.empty(size) if momentum else None))
        self.ready: queue.Queue[_Bundle] = queue.Queue()  # bounded by the slots
        self.current: _Bundle | None = None
        self.stopped = threading.Event()
        self.ahead = [i for i in self.live if _read_ahead(deltas[i])]
        self.queued: dict[int, dict[int, Future]] = {}  # piece -> its reads of those deltas
        self.queued_to = 0  # the first piece whose reads are not queued
        # each live delta's piece is read on a thread of its own, beside the master's; a
        # delta read ahead has as many threads as pieces in flight
        workers = len(self.live) + (READAHEAD_PIECES - 1) * len(self.ahead)
        self.readers = ThreadPoolExecutor(
            max_workers=max(1, workers), thread_name_prefix="generation-delta-reader"
        )
        self.thread = threading.Thread(target=self._run, name="generation-reader", daemon=True)
        self.thread.start()

    def _slot(self) -> _Slot | None:
        """A slot whose tensors are written, or None once the merge has stopped."""
        while not self.stopped.is_set():
            try:
                slot = self.free.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            while slot.written is not None and not slot.written.wait(_POLL_S):
                if self.stopped.is_set():
                    return None
            slot.written = None
            return slot
        return None

    def _run(self) -> None:
        try:
            self._read_all()
        except BaseException as exc:  # outside any one read: the merge raises it at its next get
            self.ready.put(_Bundle("", None, failed=("", ""), error=exc))

    def _reads(self, k: int) -> dict[int, Future]:
        """Piece ``k``'s delta reads, by contributor: submitted now for a delta read in
        order, queued before for one read ahead (with the pieces after ``k`` that fit)."""

        def size(j: int) -> int:
            return 4 * math.prod(self.items[j].shape)

        while self.ahead and self.queued_to < len(self.items):
            j = self.queued_to
            fits = (
                len(self.queued) < READAHEAD_PIECES
                and sum(size(q) for q in self.queued if q != k) + size(j) <= PIECE_BYTES
            )
            if j > k and not fits:
                break
            self.queued[j] = {
                i: self.readers.submit(self._delta, i, self.items[j]) for i in self.ahead
            }
            self.queued_to += 1
        early = self.queued.pop(k, {})
        return {
            i: early[i] if i in early else self.readers.submit(self._delta, i, self.items[k])
            for i in self.live
        }

    def _read_all(self) -> None:
        for k, piece in enumerate(self.items):
            slot = self._slot()
            if slot is None:
                return
            name, rows = piece.key, None if piece.whole else (piece.lo, piece.hi)
            bundle = _Bundle(name, slot)
            reads = self._reads(k)
            key: tuple[str | int, str] = ("master", name)
            try:
                bundle.items[key] = self.state.read(piece.name, slot.master, rows=rows)
                if slot.momentum is not None:
                    key = ("momentum", name)
                    bundle.items[key] = self.state.read(
                        MOMENTUM + piece.name, slot.momentum, rows=rows
                    )
                for i, read in reads.items():
                    key = (i, name)
                    bundle.items[key] = read.result()
            except BaseException as exc:  # raised in the merge's thread, at this read
                bundle.failed, bundle.error = key, exc
                _settle(reads.values())
                _settle(read for queued in self.queued.values() for read in queued.values())
            self.ready.put(bundle)
            if bundle.error is not None:
                return

    def _delta(self, i: int, piece: Piece) -> torch.Tensor:
        """Contributor ``i``'s delta for ``piece``: read whole, read by rows (plain), or
        rows of the tensor decoded whole (a codec)."""
        blob = self.deltas[i]
        if piece.whole:
            return blob[piece.name]
        handle = getattr(blob, "handle", None)
        if getattr(blob, "codec", None) == "none" and isinstance(handle, TensorFile):
            spec = handle.spec(piece.name)
            _check_delta(piece.name, spec.dtype, spec.shape, self.shapes[piece.name])
            return handle.read(piece.name, rows=(piece.lo, piece.hi))
        held = self.decoded.get(i)
        if held is None or held[0] != piece.name:
            self.decoded.pop(i, None)  # the tensor before goes first
            full = blob[piece.name]
            if not isinstance(full, torch.Tensor):
                raise DeltaError(
                    f"delta tensor {piece.name!r} is a {type(full).__name__}, not a torch.Tensor",
                    piece.name,
                )
            _check_delta(piece.name, full.dtype, tuple(full.shape), self.shapes[piece.name])
            held = self.decoded[i] = (piece.name, full)
        rows = held[1][piece.lo : piece.hi]
        if piece.hi == self.shapes[piece.name][0]:
            del self.decoded[i]
        return rows

    def get(self, role: str | int, name: str) -> torch.Tensor:
        """``role``'s tensor ``name``: the current tensor's, or the next one's."""
        if self.current is None or self.current.name != name:
            self.current = None  # its deltas go now; its slot waits for the writer
            self.current = self._next()
            if self.current.error is not None and self.current.failed == ("", ""):
                raise self.current.error
            if self.current.name != name:
                raise RuntimeError(f"tensor {name!r} asked for out of order")
        bundle = self.current
        if (role, name) in bundle.items:
            return bundle.items[role, name]
        if bundle.failed == (role, name) and bundle.error is not None:
            raise bundle.error
        raise RuntimeError(f"{role} tensor {name!r} asked for out of order")

    def _next(self) -> _Bundle:
        """The next tensor's bundle, once read."""
        while True:
            try:
                return self.ready.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.thread.is_alive() and self.ready.empty():
                    raise RuntimeError("the merge's reader thread ended early") from None

    def release(self, name: str, written: threading.Event | None) -> None:
        """Tensor ``name`` is emitted: its slot is free once ``written`` is set."""
        bundle = self.current
        if bundle is None or bundle.name != name or bundle.slot is None:
            raise RuntimeError(f"tensor {name!r} emitted out of order")
        slot, bundle.slot = bundle.slot, None
        slot.written = written
        self.free.put(slot)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.readers.shutdown(wait=True, cancel_futures=True)  # reads ahead not begun go
        self.current = None


def _read_ahead(blob: Any) -> bool:
    """Whether a delta's pieces are worth reading ahead, and may be: plain values (a codec's
    tensor is decoded once for all its pieces, in order) from a store a round trip away."""
    handle = getattr(blob, "handle", None)
    return getattr(blob, "codec", None) == "none" and bool(getattr(handle, "remote", False))


def _settle(reads: Iterable[Future]) -> None:
    """Wait out the reads a failed piece still has in flight (their errors are not the
    first one), so that no reader thread outlives the piece it read for."""
    for read in reads:
        read.cancel()
        try:
            read.result()
        except BaseException:  # noqa: BLE001 - the piece's first error is the one raised
            pass


class _Prefetched(Mapping[str, torch.Tensor]):
    """One role of a :class:`_Prefetch` as a mapping over ``names``."""

    def __init__(self, prefetch: _Prefetch, role: str | int, names: Sequence[str]) -> None:
        self.prefetch, self.role, self._names = prefetch, role, list(names)
        self._set = set(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._set:
            raise KeyError(name)
        return self.prefetch.get(self.role, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _check_delta(
    name: str, dtype: torch.dtype, shape: tuple[int, ...], want: tuple[int, ...]
) -> None:
    """A delta tensor read by rows must have the dtype and shape the step checks whole."""
    if dtype not in DELTA_DTYPES:
        raise DeltaError(
            f"delta tensor {name!r} has dtype {dtype}; expected bfloat16 or float32", name
        )
    if tuple(shape) != tuple(want):
        raise DeltaError(
            f"delta tensor {name!r} has shape {tuple(shape)}; expected {tuple(want)}", name
        )


def _live(tokens: Sequence[int]) -> list[int]:
    """The contributors whose deltas the step reads (a positive token count); bad counts are
    left to :func:`stream_outer_step` to refuse."""
    try:
        return [i for i, n in enumerate(tokens) if operator.index(n) > 0]
    except TypeError:
        return []


def merge_step(
    state_path: Path,
    shapes: Mapping[str, tuple[int, ...]],
    delta_paths: Sequence[Path | TensorFile],
    tokens: Sequence[int],
    emit: Emit,
    config: OuterConfig,
    *,
    row_counts: Mapping[str, Sequence[torch.Tensor | None]] | None = None,
) -> OuterStepReport:
    """Eq. 1 from generation files: the state in ``state_path`` and the deltas (any codec)
    in ``delta_paths`` are read tensor by tensor and each new tensor goes to ``emit``. A
    delta may also be an open :class:`TensorFile` (an object read in ranges); it is closed
    with the merge.

    The step runs on :func:`pieces` of the tensors (row blocks of the large ones, each of
    :data:`PIECE_BYTES` or less), and ``emit`` gets each piece: a whole tensor, or its row
    blocks in row order. A reader thread (:class:`_Prefetch`) reads master and momentum
    into :data:`SLOTS` pairs of buffers of the largest piece's size, kept for the whole
    merge, and each delta's piece when its turn comes, one piece ahead of the arithmetic (a
    delta in an object store further ahead, :data:`READAHEAD_PIECES`); a pair is read into
    again once the event ``emit`` returned for its last piece is set.
    Key sets are checked by tensor name before the first read. ``row_counts``: by tensor,
    each delta's row counts (:mod:`crossfed.rowcounts`), which weight that tensor's rows.
    """
    items = pieces(shapes)
    by_key = {p.key: p for p in items}
    keys_of: dict[str, list[str]] = {}
    for p in items:
        keys_of.setdefault(p.name, []).append(p.key)

    def piece_keys(names: Sequence[str]) -> list[str]:
        return [k for name in names for k in keys_of.get(name, [name])]

    with ExitStack() as files:
        blobs = [
            decoded(files.enter_context(path if isinstance(path, TensorFile) else TensorFile(path)))
            for path in delta_paths
        ]
        state = files.enter_context(TensorFile(state_path))
        keys = state.keys()
        master_names = [k for k in keys if not k.startswith(MOMENTUM)]
        momentum_names = [k.removeprefix(MOMENTUM) for k in keys if k.startswith(MOMENTUM)]
        live = _live(tokens)
        if len(blobs) == len(tokens):  # else the step refuses the counts
            _check_names(shapes, momentum_names, [blobs[i] for i in live])
        prefetch = _Prefetch(
            shapes,
            items,
            state,
            bool(momentum_names),
            blobs,
            live,
            largest({p.key: p.shape for p in items}),
        )
        files.callback(prefetch.close)

        def sink(key: str, w: torch.Tensor, b: torch.Tensor | None) -> None:
            prefetch.release(key, emit(by_key[key].name, w, b))

        return stream_outer_step(
            {p.key: p.shape for p in items},
            _Prefetched(prefetch, "master", piece_keys(master_names)),
            _Prefetched(prefetch, "momentum", piece_keys(momentum_names)),
            [_Prefetched(prefetch, i, piece_keys(blob.keys())) for i, blob in enumerate(blobs)],
            tokens,
            sink,
            config,
            row_weights=_piece_weights(items, row_counts or {}, tokens, live),
        )


def _piece_weights(
    items: Sequence[Piece],
    row_counts: Mapping[str, Sequence[torch.Tensor | None]],
    tokens: Sequence[int],
    live: Sequence[int],
) -> dict[str, torch.Tensor]:
    """Each piece's rows' weights (live contributors by rows) for the tensors counted."""
    if not row_counts or not live or len(tokens) != len(next(iter(row_counts.values()))):
        return {}
    shares = token_shares([tokens[i] for i in live])
    out = {}
    for name, counts in row_counts.items():
        weights = rowcounts.row_weights([counts[i] for i in live], shares)
        if weights is None:
            log.warning("%s merged with token shares: a delta of the round counts no rows", name)
            continue
        for p in items:
            if p.name == name:
                out[p.key] = weights[:, p.lo : p.hi]
    return out


def _check_names(
    shapes: Mapping[str, tuple[int, ...]],
    momentum: Sequence[str],
    deltas: Sequence[Mapping[str, torch.Tensor]],
) -> None:
    """The momentum's and each live delta's tensor names against the master's, by tensor
    (the step itself sees pieces), with the step's errors."""
    if momentum and set(momentum) != set(shapes):
        missing = sorted(set(shapes).difference(momentum))
        extra = sorted(set(momentum).difference(shapes))
        raise StateError(
            "momentum must be empty or hold exactly the master's tensors; "
            f"missing {_names(missing) or 'none'}, unexpected {_names(extra) or 'none'}"
        )
    for delta in deltas:
        _check_keys(shapes, delta)  # type: ignore[arg-type]
