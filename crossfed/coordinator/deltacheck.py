"""The delta check of a plain (bf16/fp32) delta made on its bytes as they stream past once,
while the coordinator hashes an uploaded object: the same tensors, dtypes and shapes as the
master, every value finite. The second-moment factors a site appends (:mod:`crossfed.moments`)
are passed over, as the full check passes over them: the merge checks those.

It only ever vouches: a delta it passes is one :func:`crossfed.outer.validate_delta` passes.
Anything else (a codec's delta, a header it cannot read, a bad tensor) leaves the delta
unchecked, and the submission runs the full check, which refuses it with its usual error.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import torch

from crossfed.moments import is_side_key
from crossfed.wire.codecs import CODEC_KEY
from crossfed.wire.tensors import DTYPES_BY_NAME, HEADER_MAX_BYTES

_PLAIN = {"BF16": torch.bfloat16, "F32": torch.float32}


class StreamingDeltaCheck:
    """Fed an object's bytes in order (:meth:`feed`), says whether it is a plain delta of
    the master's ``shapes`` with every value finite (:attr:`passed`, once all bytes are in)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.shapes = {k: tuple(v) for k, v in shapes.items()}
        self.failed = False
        self._head = bytearray()
        self._header_len: int | None = None
        #: each tensor's absolute start and end, and the dtype its values are checked as
        #: (None: a second-moment factor, passed over)
        self._plan: list[tuple[int, int, torch.dtype | None]] | None = None
        self._at = 0  # bytes fed so far
        self._index = 0  # the tensor whose bytes come next
        self._carry = b""  # the start of an element split between chunks

    @property
    def passed(self) -> bool:
        return not self.failed and self._plan is not None and self._index == len(self._plan)

    def feed(self, chunk: bytes) -> None:
        if self.failed or not chunk:
            return
        try:
            self._feed(memoryview(chunk))
        except (ValueError, KeyError, TypeError, struct.error):
            self.failed = True

    def _feed(self, view: memoryview) -> None:
        while view and not self.failed:
            if self._plan is None:
                view = self._read_header(view)
                continue
            if self._index == len(self._plan):
                self.failed = True  # bytes past the last tensor: not a file it vouches for
                return
            _, end, dtype = self._plan[self._index]
            take = min(len(view), end - self._at)
            if dtype is not None:
                self._check(dtype, bytes(view[:take]))
            view = view[take:]
            self._at += take
            if self._at == end:
                if self._carry:
                    self.failed = True
                self._index += 1

    def _read_header(self, view: memoryview) -> memoryview:
        need = 8 if self._header_len is None else 8 + self._header_len
        take = min(len(view), need - len(self._head))
        self._head += view[:take]
        self._at += take
        if len(self._head) == 8 and self._header_len is None:
            (self._header_len,) = struct.unpack("<Q", bytes(self._head))
            if self._header_len > HEADER_MAX_BYTES:
                self.failed = True
        elif self._header_len is not None and len(self._head) == 8 + self._header_len:
            self._plan = self._planned(json.loads(bytes(self._head[8:])), 8 + self._header_len)
        return view[take:]

    def _planned(self, header: dict, base: int) -> list[tuple[int, int, torch.dtype | None]] | None:
        meta = header.pop("__metadata__", None) or {}
        model = {k for k in header if not is_side_key(k)}
        if meta.get(CODEC_KEY, "none") != "none" or model != set(self.shapes):
            self.failed = True
            return None
        plan = []
        for name, entry in header.items():
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
            size = DTYPES_BY_NAME[entry["dtype"]].itemsize
            if end - start != size * _count(shape):
                self.failed = True
                return None
            if name not in model:  # second-moment factors, row counts: the merge checks those
                plan.append((base + start, base + end, None))
                continue
            dtype = _PLAIN.get(entry["dtype"])
            if dtype is None or shape != self.shapes[name]:
                self.failed = True
                return None
            plan.append((base + start, base + end, dtype))
        plan.sort()
        ends = [base] + [end for _, end, _ in plan[:-1]]
        if any(start != end for (start, _, _), end in zip(plan, ends, strict=True)):
            self.failed = True  # tensors must follow one another: no gap, no overlap
            return None
        return plan

    def _check(self, dtype: torch.dtype, data: bytes) -> None:
        """Every whole element of ``data`` (after the carried start of one) is finite."""
        joined = bytearray(self._carry)
        joined += data
        size = dtype.itemsize
        whole = len(joined) // size
        self._carry = bytes(joined[whole * size :])
        if whole:
            values = torch.frombuffer(joined, dtype=dtype, count=whole)
            if not bool(torch.isfinite(values).all()):
                self.failed = True


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
