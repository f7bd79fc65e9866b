"""Optional delta compression: blockwise int8 with one fp32 scale per block.

Off by default (codec ``none``: plain bf16). With ``int8`` each tensor is cut, flattened, into
blocks of ``block`` values; a block stores ``round(x / s)`` as int8 with ``s = max|x| / 127``,
so a delta costs about 1 + 4/block bytes per value instead of 2 (torchft and INTELLECT-1
quantise their pseudo-gradients the same way). The file stays a plain safetensors file:
tensor ``name`` holds the int8 values in the tensor's shape and ``name::scale`` the scales;
the codec and block size are in the header's metadata.

The coordinator decodes on read (:func:`open_delta`), so validation and the outer step see
the same fp32 tensors whatever codec a site chose.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from crossfed.outer import DeltaError
from crossfed.transport import TensorSpec

CODECS = ("none", "int8")
CODEC_KEY = "crossfed.codec"
BLOCK_KEY = "crossfed.block"
SCALE_SUFFIX = "::scale"
#: values per int8 block (one fp32 scale each: 1.6% overhead)
BLOCK = 256


class CodecError(DeltaError):
    """A compressed delta that cannot be decoded, or an unknown codec name."""


# --------------------------------------------------------------------------- int8 kernels
def quantize_int8(x: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Blockwise symmetric int8: values (shaped like ``x``) and one fp32 scale per block."""
    if block < 1:
        raise CodecError(f"block size must be >= 1, got {block}")
    flat = x.detach().reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.float()
    n = flat.numel()
    full = n // block
    q = torch.empty(n, dtype=torch.int8, device=flat.device)
    scale = torch.empty(math.ceil(n / block), dtype=torch.float32, device=flat.device)
    if full:
        _quantize_blocks(flat[: full * block].view(full, block), q[: full * block], scale[:full])
    if full * block < n:  # the last, shorter block
        _quantize_blocks(flat[full * block :].view(1, -1), q[full * block :], scale[full:])
    return q.view(x.shape), scale


def _quantize_blocks(blocks: Tensor, q_out: Tensor, scale_out: Tensor) -> None:
    """One scale per row: max|x| / 127 (no temporary |x| copy); a zero row stays zero."""
    scale = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).div_(127.0)
    inverse = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    scaled = blocks * inverse[:, None]
    q_out.copy_(scaled.round_().clamp_(-127, 127).view(-1))
    scale_out.copy_(scale)


def dequantize_int8(q: Tensor, scale: Tensor, block: int = BLOCK) -> Tensor:
    """fp32 values back from int8 ``q`` and its per-block ``scale``."""
    n = q.numel()
    n_blocks = math.ceil(n / block)
    if scale.dim() != 1 or scale.numel() != n_blocks:
        raise CodecError(
            f"{n} int8 values in blocks of {block} need {n_blocks} scales, got shape "
            f"{tuple(scale.shape)}"
        )
    flat = q.reshape(-1)
    out = torch.empty(n, dtype=torch.float32, device=q.device)
    full = n // block
    scale = scale.float()
    if full:
        head = flat[: full * block].view(full, block)
        torch.mul(head, scale[:full, None], out=out[: full * block].view(full, block))
    if full * block < n:
        out[full * block :] = flat[full * block :].float() * scale[full]
    return out.view(q.shape)


# --------------------------------------------------------------------------- encoders
class _Plain:
    """Codec ``none``: bf16 deltas, one tensor per parameter."""

    name = "none"

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        return [TensorSpec(name, torch.bfloat16, shape)]

    def encode(self, name: str, delta: Tensor) -> dict[str, Tensor]:
        return {name: delta.to(torch.bfloat16)}

    def base_name(self, stored: str) -> str:
        return stored

    def metadata(self) -> dict[str, str]:
        return {}


class _Int8:
    """Codec ``int8``: values plus ``::scale`` per parameter."""

    name = "int8"

    def __init__(self, block: int = BLOCK) -> None:
        if block < 1:
            raise CodecError(f"block size must be >= 1, got {block}")
        self.block = block

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        n_blocks = math.ceil(math.prod(shape) / self.block)
        return [
            TensorSpec(name, torch.int8, shape),
            TensorSpec(name + SCALE_SUFFIX, torch.float32, (n_blocks,)),
        ]

    def encode(self, name: str, delta: Tensor) -> dict[str, Tensor]:
        q, scale = quantize_int8(delta, self.block)
        return {name: q, name + SCALE_SUFFIX: scale}

    def base_name(self, stored: str) -> str:
        return stored.removesuffix(SCALE_SUFFIX)

    def metadata(self) -> dict[str, str]:
        return {CODEC_KEY: self.name, BLOCK_KEY: str(self.block)}


def encoder(codec: str, block: int = BLOCK) -> _Plain | _Int8:
    """The writer side of ``codec`` (``none`` or ``int8``)."""
    if codec == "none":
        return _Plain()
    if codec == "int8":
        return _Int8(block)
    raise CodecError(f"unknown delta codec {codec!r}; expected one of {', '.join(CODECS)}")


def encode_tensors(
    tensors: Mapping[str, Tensor], codec: str, block: int = BLOCK
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """In-memory encoding of a whole delta (for tests and benchmarks): tensors, metadata."""
    enc = encoder(codec, block)
    out: dict[str, Tensor] = {}
    for name, value in tensors.items():
        out.update(enc.encode(name, value.float()))
    return out, enc.metadata()


# --------------------------------------------------------------------------- decoding
class DecodedDelta(Mapping[str, Tensor]):
    """Read-once mapping over an open delta file: parameter name -> decoded tensor.

    Plain files give their bf16 tensors as stored; int8 files give fp32 values.
    """

    def __init__(self, handle: Any, metadata: Mapping[str, str] | None) -> None:
        self.handle = handle
        meta = dict(metadata or {})
        self.codec = meta.get(CODEC_KEY, "none")
        if self.codec not in CODECS:
            raise CodecError(f"delta uses unknown codec {self.codec!r}")
        self.block = BLOCK
        if self.codec == "int8":
            try:
                self.block = int(meta.get(BLOCK_KEY, BLOCK))
            except ValueError as exc:
                raise CodecError(f"bad {BLOCK_KEY} {meta.get(BLOCK_KEY)!r} in metadata") from exc
            if self.block < 1:
                raise CodecError(f"bad {BLOCK_KEY} {self.block} in metadata")
        stored = list(handle.keys())
        if self.codec == "none":
            self._names = stored
        else:
            self._names = [k for k in stored if not k.endswith(SCALE_SUFFIX)]
            have = set(self._names)
            orphans = [
                k
                for k in stored
                if k.endswith(SCALE_SUFFIX) and k.removesuffix(SCALE_SUFFIX) not in have
            ]
            if orphans:
                raise CodecError(f"scale tensor {orphans[0]!r} has no values tensor")
            scales = set(stored)
            missing = [k for k in self._names if k + SCALE_SUFFIX not in scales]
            if missing:
                raise CodecError(f"int8 tensor {missing[0]!r} has no {SCALE_SUFFIX} tensor")

    def keys(self) -> list[str]:  # type: ignore[override]
        return list(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, key: object) -> bool:
        return key in self._names

    def __getitem__(self, key: str) -> Tensor:
        if key not in self._names:
            raise KeyError(key)
        value = self.handle.get_tensor(key)
        if self.codec == "none":
            return value
        if value.dtype != torch.int8:
            raise CodecError(f"int8 delta tensor {key!r} is stored as {value.dtype}", key)
        scale = self.handle.get_tensor(key + SCALE_SUFFIX)
        if scale.dtype not in (torch.float32, torch.bfloat16):
            raise CodecError(f"scale of {key!r} is {scale.dtype}; expected float32", key)
        try:
            return dequantize_int8(value, scale, self.block)
        except CodecError as exc:
            raise CodecError(f"tensor {key!r}: {exc}", key) from exc


@contextmanager
def open_delta(path: Path) -> Iterator[DecodedDelta]:
    """Open a delta file (any codec) as a lazy mapping of decoded tensors."""
    with safe_open(str(path), framework="pt") as handle:
        yield DecodedDelta(handle, handle.metadata())


def decoded(handle: Any) -> DecodedDelta:
    """A decoding view over an already open ``safe_open`` handle."""
    return DecodedDelta(handle, handle.metadata())
