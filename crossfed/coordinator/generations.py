"""A run's model state as files: one generation in, the next generation out, tensor by tensor.

Generation ``g`` is two safetensors files: ``master-g`` holds the fp32 master and momentum
(``momentum::``-prefixed keys; none before the first merge), ``global-g`` the bf16 model the
sites download. A merge (:func:`merge_step` inside :func:`write_generation`) reads ``master-g``
and each delta one tensor at a time, applies Eq. 1 (:func:`crossfed.outer.stream_outer_step`)
and writes both files of ``g+1`` as it goes, so the memory it holds is a few tensors of the
largest size, whatever the size of the model.

Files are read with ``pread`` (:class:`crossfed.transport.TensorFile`), never memory-mapped:
a merge's memory is what it allocates. Keys are found by name, so files written with any
tensor order (older coordinators wrote all master tensors before all momentum ones) load alike.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TypeVar

import torch

from crossfed.compress import decoded
from crossfed.coordinator.faults import crash_point
from crossfed.outer import OuterConfig, OuterStepReport, stream_outer_step
from crossfed.transport import TensorFile, TensorSpec, stream_writer

log = logging.getLogger(__name__)
MOMENTUM = "momentum::"
FORMAT = "crossfed-global-v1"
#: ``emit(name, w, b)``: one master tensor and its momentum (None before the first step)
Emit = Callable[[str, torch.Tensor, "torch.Tensor | None"], None]
T = TypeVar("T")


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The master's tensor names and shapes, in file order, from a state file's header."""
    with TensorFile(path) as state:
        return {k: state.spec(k).shape for k in state.keys() if not k.startswith(MOMENTUM)}


def largest(shapes: Mapping[str, Sequence[int]]) -> int:
    """Elements of the largest tensor."""
    return max((math.prod(s) for s in shapes.values()), default=0)


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


def write_generation(
    state_path: Path,
    global_path: Path,
    shapes: Mapping[str, tuple[int, ...]],
    generation: int,
    fill: Callable[[Emit], T],
    *,
    momentum: bool,
) -> tuple[str, T, float]:
    """Write one generation's two files as ``fill`` produces its tensors.

    ``fill(emit)`` calls ``emit(name, w, b)`` once per tensor of ``shapes``, in order: ``w``
    the fp32 master tensor, ``b`` its momentum (None when ``momentum`` is False). Each goes
    straight to both files: the fp32 state (``name`` then ``momentum::name``) and the bf16
    global model (digested as written). Both are temp files, fsynced and renamed when
    complete; an exception leaves neither. Returns the global model's digest, ``fill``'s
    result and the seconds spent writing.
    """
    meta = {"generation": str(generation), "format": FORMAT}
    state_specs, global_specs = [], []
    for name, shape in shapes.items():
        state_specs.append(TensorSpec(name, torch.float32, shape))
        if momentum:
            state_specs.append(TensorSpec(MOMENTUM + name, torch.float32, shape))
        global_specs.append(TensorSpec(name, torch.bfloat16, shape))
    bf16 = torch.empty(largest(shapes), dtype=torch.bfloat16)  # one cast buffer for all
    halfway = len(shapes) // 2
    written: list[float] = []
    with (
        stream_writer(state_path, state_specs, meta, algo=None) as state,
        stream_writer(global_path, global_specs, meta) as model,
    ):

        def emit(name: str, w: torch.Tensor, b: torch.Tensor | None) -> None:
            started = time.perf_counter()
            state.write(w)
            if momentum:
                if b is None:
                    raise ValueError(f"no momentum for tensor {name!r}")
                state.write(b)
            model.write(bf16[: w.numel()].view(w.shape).copy_(w))
            written.append(time.perf_counter() - started)
            if len(written) == halfway:
                crash_point("inside_generation_write")

        result = fill(emit)
    crash_point("after_generation_write")
    return model.digest, result, sum(written)


def merge_step(
    state_path: Path,
    shapes: Mapping[str, tuple[int, ...]],
    delta_paths: Sequence[Path],
    tokens: Sequence[int],
    emit: Emit,
    config: OuterConfig,
) -> OuterStepReport:
    """Eq. 1 from generation files: the state in ``state_path`` and the deltas (any codec)
    in ``delta_paths`` are read tensor by tensor and each new tensor goes to ``emit``.

    Master and momentum are read into two buffers of the largest tensor's size, kept for
    the whole merge; each delta tensor is read (and decoded) when its turn comes.
    """
    with ExitStack() as files:
        blobs = [files.enter_context(TensorFile(path)) for path in delta_paths]
        state = files.enter_context(TensorFile(state_path))
        size = largest(shapes)
        master = StateView(state, momentum=False, buffer=torch.empty(size))
        momentum = StateView(state, momentum=True, buffer=torch.empty(size))
        return stream_outer_step(
            shapes, master, momentum, [decoded(b) for b in blobs], tokens, emit, config
        )
