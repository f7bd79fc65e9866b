"""Optional delta compression: blockwise int8 or int4 with one scale per block, and error
feedback.

Off by default (codec ``none``: plain bf16). Each tensor is cut, flattened, into blocks; a
block stores ``round(x / s)`` with ``s = max|x| / L``:

* ``int8``: L = 127, blocks of 256, one fp32 scale each: 1 + 4/256 bytes per value (0.508 of
  bf16). Tensor ``name`` holds the int8 values in the tensor's shape (torchft and INTELLECT-1
  quantise their pseudo-gradients the same way).
* ``int4``: L = 7 (codes -7..7), blocks of 64, one bf16 scale each (bf16 keeps fp32's
  exponent range, so no delta underflows): 0.5 + 2/64 bytes per value (0.266 of bf16).
  Tensor ``name`` holds two codes per byte (``code + 8``, the even value in the low nibble),
  flattened; the shapes are in the header's ``crossfed.shapes``. The encoder quantises with
  the scale as stored, so a decoder computes exactly what the encoder's residual assumed.

The file stays a plain safetensors file: ``name::scale`` holds a tensor's scales, the codec
and block size are in the header's metadata. The coordinator decodes on read
(:func:`open_delta`) to fp32 and accumulates the outer step in fp32, so validation and the
merge see the same tensors whatever codec a site chose.

Error feedback (:func:`save_delta` with ``residual_out``): a site sends
``Q(delta_t + e_t)`` and keeps ``e_{t+1} = (delta_t + e_t) - Q(delta_t + e_t)``, written
tensor by tensor beside the delta, so what quantisation drops in one round goes out in the
next (as SparseLoCo and MuLoCo do). Which residual a site carries is the site's decision
(:mod:`crossfed.site`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import Tensor

from crossfed.moments import is_moment_key, is_side_key
from crossfed.outer import DeltaError
from crossfed.rowcounts import is_count_key
from crossfed.wire.deltas import delta_tensor
from crossfed.wire.tensors import TensorSpec, save_stream, stream_writer

CODECS = ("none", "int8", "int4")
CODEC_KEY = "crossfed.codec"
BLOCK_KEY = "crossfed.block"
SHAPES_KEY = "crossfed.shapes"
SCALE_SUFFIX = "::scale"
#: values per int8 block (one fp32 scale each: 1.6% overhead)
BLOCK = 256
#: values per int4 block (one bf16 scale each: 6.3% overhead)
BLOCK_INT4 = 64
#: default block size per codec
BLOCKS = {"int8": BLOCK, "int4": BLOCK_INT4}
INT4_MAX = 7
_TINY = torch.finfo(torch.float32).tiny


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


def _check_scales(scale: Tensor, n: int, block: int, what: str) -> Tensor:
    """The fp32 scales of ``n`` values in blocks of ``block``: one per block, finite, >= 0."""
    n_blocks = math.ceil(n / block)
    if scale.dim() != 1 or scale.numel() != n_blocks:
        raise CodecError(
            f"{n} {what} values in blocks of {block} need {n_blocks} scales, got shape "
            f"{tuple(scale.shape)}"
        )
    scale = scale.float()
    finite = torch.isfinite(scale)
    if not bool(finite.all()):
        bad = int(finite.numel() - finite.sum())
        raise CodecError(f"{bad} of {n_blocks} scales are not finite (NaN or Inf)")
    if bool((scale < 0).any()):
        raise CodecError(f"{int((scale < 0).sum())} of {n_blocks} scales are negative")
    return scale


def _scale_blocks(out: Tensor, scale: Tensor, block: int) -> Tensor:
    """Multiply flat fp32 ``out`` in place by its per-block ``scale``."""
    n = out.numel()
    full = n // block
    if full:
        out[: full * block].view(full, block).mul_(scale[:full, None])
    if full * block < n:
        out[full * block :].mul_(scale[full])
    return out


def dequantize_int8(q: Tensor, scale: Tensor, block: int = BLOCK) -> Tensor:
    """fp32 values back from int8 ``q`` and its per-block ``scale``."""
    scale = _check_scales(scale, q.numel(), block, "int8")
    out = q.reshape(-1).to(torch.float32)
    return _scale_blocks(out, scale, block).view(q.shape)


# --------------------------------------------------------------------------- int4 kernels
def quantize_int4(x: Tensor, block: int = BLOCK_INT4) -> tuple[Tensor, Tensor]:
    """Blockwise symmetric int4: packed codes (uint8, two per byte, ``ceil(n / 2)`` of them,
    flat) and one bf16 scale per block. Codes are ``round(x / s)`` in -7..7 with ``s`` the
    block's ``max|x| / 7`` rounded to bf16, stored as ``code + 8``."""
    if block < 1:
        raise CodecError(f"block size must be >= 1, got {block}")
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    n_blocks = math.ceil(n / block)
    pad = n_blocks * block - n
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(n_blocks, block)
    amax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())
    scale = amax.div_(INT4_MAX).to(torch.bfloat16)
    used = scale.float()
    used = torch.where(used >= _TINY, used, torch.zeros_like(used))  # no Inf reciprocal
    scale = torch.where(used > 0, scale, torch.zeros_like(scale))
    inverse = torch.where(used > 0, used.reciprocal(), torch.zeros_like(used))
    codes = blocks.mul(inverse[:, None]).round_().clamp_(-INT4_MAX, INT4_MAX).add_(8)
    codes = codes.to(torch.uint8).view(-1)[:n]
    if n % 2:  # the last byte's unused high nibble: a zero
        codes = torch.cat([codes, codes.new_full((1,), 8)])
    packed = codes[0::2] | (codes[1::2] << 4)
    return packed, scale


def dequantize_int4(
    packed: Tensor, scale: Tensor, shape: tuple[int, ...], block: int = BLOCK_INT4
) -> Tensor:
    """fp32 values of ``shape`` back from packed int4 codes and their per-block scales."""
    n = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != (n + 1) // 2:
        raise CodecError(
            f"{n} int4 values pack into {(n + 1) // 2} uint8 bytes, got {packed.dtype} "
            f"{tuple(packed.shape)}"
        )
    scale = _check_scales(scale, n, block, "int4")
    codes = torch.stack((packed & 15, packed >> 4), dim=1).view(-1)[:n]
    bad = codes == 0
    if bool(bad.any()):
        raise CodecError(
            f"{int(bad.sum())} codes are -8, outside int4's -7..7 (no encoder writes them)"
        )
    out = codes.to(torch.float32).sub_(8)
    return _scale_blocks(out, scale, block).view(shape)


# --------------------------------------------------------------------------- encoders
class Encoder(Protocol):
    """The writer side of a codec: the stored tensors of each parameter, and back."""

    name: str

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]: ...

    def encode(self, name: str, delta: Tensor) -> dict[str, Tensor]: ...

    def decode(self, name: str, parts: Mapping[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        """fp32 values exactly as a reader of the file gets them."""
        ...

    def metadata(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]: ...


class _Plain:
    """Codec ``none``: bf16 deltas, one tensor per parameter."""

    name = "none"

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        return [TensorSpec(name, torch.bfloat16, shape)]

    def encode(self, name: str, delta: Tensor) -> dict[str, Tensor]:
        return {name: delta.to(torch.bfloat16)}

    def decode(self, name: str, parts: Mapping[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        return parts[name].float()

    def metadata(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
        return {}


class _Int8:
    """Codec ``int8``: values in the tensor's shape plus ``::scale`` per parameter."""

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

    def decode(self, name: str, parts: Mapping[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        return dequantize_int8(parts[name], parts[name + SCALE_SUFFIX], self.block)

    def metadata(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
        return {CODEC_KEY: self.name, BLOCK_KEY: str(self.block)}


class _Int4(_Int8):
    """Codec ``int4``: packed codes plus bf16 ``::scale`` per parameter, shapes in metadata."""

    name = "int4"

    def __init__(self, block: int = BLOCK_INT4) -> None:
        super().__init__(block)

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        n = math.prod(shape)
        return [
            TensorSpec(name, torch.uint8, ((n + 1) // 2,)),
            TensorSpec(name + SCALE_SUFFIX, torch.bfloat16, (math.ceil(n / self.block),)),
        ]

    def encode(self, name: str, delta: Tensor) -> dict[str, Tensor]:
        packed, scale = quantize_int4(delta, self.block)
        return {name: packed, name + SCALE_SUFFIX: scale}

    def decode(self, name: str, parts: Mapping[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        return dequantize_int4(parts[name], parts[name + SCALE_SUFFIX], shape, self.block)

    def metadata(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
        listed = {name: list(shape) for name, shape in shapes.items()}
        return {
            **super().metadata(shapes),
            SHAPES_KEY: json.dumps(listed, separators=(",", ":")),
        }


def encoder(codec: str, block: int | None = None) -> Encoder:
    """The writer side of ``codec`` (``none``, ``int8`` or ``int4``; ``block`` values per
    scale, the codec's default if None)."""
    if codec == "none":
        return _Plain()
    if codec == "int8":
        return _Int8(BLOCK if block is None else block)
    if codec == "int4":
        return _Int4(BLOCK_INT4 if block is None else block)
    raise CodecError(f"unknown delta codec {codec!r}; expected one of {', '.join(CODECS)}")


def encode_tensors(
    tensors: Mapping[str, Tensor], codec: str, block: int | None = None
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """In-memory encoding of a whole delta (for tests and benchmarks): tensors, metadata."""
    enc = encoder(codec, block)
    out: dict[str, Tensor] = {}
    for name, value in tensors.items():
        out.update(enc.encode(name, value.float()))
    return out, enc.metadata({name: tuple(t.shape) for name, t in tensors.items()})


def save_delta(
    site_params: Mapping[str, Tensor],
    global_params: Mapping[str, Tensor],
    path: Path,
    metadata: Mapping[str, str] | None = None,
    *,
    codec: str = "none",
    block: int | None = None,
    residual_in: Mapping[str, Tensor] | None = None,
    residual_out: Path | None = None,
    residual_metadata: Mapping[str, str] | None = None,
    extra: Mapping[str, Tensor] | None = None,
) -> str:
    """Write the ``codec``-encoded delta tensor by tensor; returns its digest.

    With ``residual_out`` (error feedback) each tensor's delta has ``residual_in``'s tensor
    (None: zeros) added before it is encoded, and what the encoding loses (the fp32
    difference to the decoded values) is written to ``residual_out`` as it goes, with
    ``residual_metadata`` in its header. One tensor's delta exists at a time and both
    ``global_params`` and ``residual_in`` may be lazy
    (:func:`crossfed.wire.tensors.open_tensors`), so no second copy of the model is ever held.
    Tensor names come from ``global_params``. ``extra`` tensors (the site's second-moment
    factors, :mod:`crossfed.moments`, and row counts, :mod:`crossfed.rowcounts`; their
    names carry their prefixes) follow the delta
    as they are, neither encoded nor fed back.
    """
    enc = encoder(codec, block)
    names = [n for n in global_params.keys() if not is_side_key(n)]
    shapes = {name: tuple(site_params[name].shape) for name in names}
    specs = [spec for name in names for spec in enc.specs(name, shapes[name])]
    extra = dict(extra or {})
    bad = [k for k in extra if not is_side_key(k)]
    if bad:
        raise ValueError(
            f"extra delta tensor {bad[0]!r} is neither a second-moment factor nor row counts"
        )
    specs += [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in extra.items()]
    meta = {**dict(metadata or {}), **enc.metadata(shapes)}
    stored_base = {spec.name: name for name in names for spec in enc.specs(name, shapes[name])}
    current: dict[str, Tensor] = {}
    with ExitStack() as stack:
        residual = None
        if residual_out is not None:
            residual_specs = [TensorSpec(n, torch.float32, shapes[n]) for n in names]
            residual = stack.enter_context(
                stream_writer(residual_out, residual_specs, residual_metadata, algo=None)
            )

        def produce(spec: TensorSpec) -> Tensor:
            if spec.name in extra:
                return extra[spec.name].contiguous()
            if spec.name not in current:
                current.clear()  # the previous tensor's parts are written: drop them
                base = stored_base[spec.name]
                delta = delta_tensor(site_params[base], global_params[base])
                if residual is None:
                    current.update(enc.encode(base, delta))
                else:
                    if residual_in is not None:
                        delta += _carried(residual_in, base, shapes[base]).to(delta.device)
                    parts = enc.encode(base, delta)
                    residual.write(delta.sub_(enc.decode(base, parts, shapes[base])))
                    current.update(parts)
            return current.pop(spec.name)

        return save_stream(path, specs, produce, meta)


def _carried(residual: Mapping[str, Tensor], name: str, shape: tuple[int, ...]) -> Tensor:
    try:
        value = residual[name]
    except KeyError:
        raise ValueError(f"the carried residual has no tensor {name!r}") from None
    if tuple(value.shape) != shape:
        raise ValueError(
            f"carried residual {name!r} has shape {tuple(value.shape)}; the model's is {shape}"
        )
    return value.float()


# --------------------------------------------------------------------------- decoding
class DecodedDelta(Mapping[str, Tensor]):
    """Read-once mapping over an open delta file: parameter name -> decoded tensor.

    Plain files give their bf16 tensors as stored; int8 and int4 files give fp32 values.
    """

    def __init__(self, handle: Any, metadata: Mapping[str, str] | None) -> None:
        self.handle = handle
        meta = dict(metadata or {})
        self.codec = meta.get(CODEC_KEY, "none")
        if self.codec not in CODECS:
            raise CodecError(f"delta uses unknown codec {self.codec!r}")
        stored = [k for k in handle.keys() if not is_side_key(k)]
        self._moments = [k for k in handle.keys() if is_moment_key(k)]
        self._counts = [k for k in handle.keys() if is_count_key(k)]
        self.block = BLOCKS.get(self.codec, BLOCK)
        self.shapes: dict[str, tuple[int, ...]] = {}
        if self.codec == "none":
            self._names = stored
            return
        try:
            self.block = int(meta.get(BLOCK_KEY, self.block))
        except ValueError as exc:
            raise CodecError(f"bad {BLOCK_KEY} {meta.get(BLOCK_KEY)!r} in metadata") from exc
        if self.block < 1:
            raise CodecError(f"bad {BLOCK_KEY} {self.block} in metadata")
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
            raise CodecError(f"{self.codec} tensor {missing[0]!r} has no {SCALE_SUFFIX} tensor")
        if self.codec == "int4":
            self.shapes = _shapes(meta.get(SHAPES_KEY), self._names)

    def keys(self) -> list[str]:  # type: ignore[override]
        return list(self._names)

    def moments(self) -> dict[str, Tensor]:
        """The site's second-moment factors the file carries (:mod:`crossfed.moments`;
        empty: none), in fp32. They are not among the mapping's keys."""
        return self._side(self._moments, "second-moment factor")

    def row_counts(self) -> dict[str, Tensor]:
        """The embedding row counts the file carries (:mod:`crossfed.rowcounts`; empty:
        none), in fp32. They are not among the mapping's keys."""
        return self._side(self._counts, "row counts")

    def _side(self, keys: list[str], what: str) -> dict[str, Tensor]:
        read_many = getattr(self.handle, "read_many", None)  # a TensorFile: one read a run
        if read_many is not None:
            stored = read_many(keys)
        else:
            stored = {key: self.handle.get_tensor(key) for key in keys}
        out = {}
        for key, value in stored.items():
            if not value.is_floating_point():
                raise CodecError(f"{what} {key!r} is stored as {value.dtype}", key)
            out[key] = value.float()
        return out

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
        want = torch.int8 if self.codec == "int8" else torch.uint8
        if value.dtype != want:
            raise CodecError(f"{self.codec} delta tensor {key!r} is stored as {value.dtype}", key)
        scale = self.handle.get_tensor(key + SCALE_SUFFIX)
        if scale.dtype not in (torch.float32, torch.bfloat16):
            raise CodecError(
                f"scale of {key!r} is {scale.dtype}; expected float32 or bfloat16", key
            )
        try:
            if self.codec == "int8":
                return dequantize_int8(value, scale, self.block)
            return dequantize_int4(value, scale, self.shapes[key], self.block)
        except CodecError as exc:
            raise CodecError(f"tensor {key!r}: {exc}", key) from exc


def _shapes(text: str | None, names: list[str]) -> dict[str, tuple[int, ...]]:
    """The ``crossfed.shapes`` metadata of an int4 file: one shape per values tensor."""
    if text is None:
        raise CodecError(f"int4 delta has no {SHAPES_KEY} in its metadata")
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise CodecError(f"{SHAPES_KEY} is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CodecError(f"{SHAPES_KEY} must map tensor names to shapes")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in names:
        shape = raw.get(name)
        if not (
            isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise CodecError(f"{SHAPES_KEY} has no shape (a list of sizes >= 0) for {name!r}", name)
        shapes[name] = tuple(shape)
    extra = sorted(set(raw).difference(names))
    if extra:
        raise CodecError(f"{SHAPES_KEY} names {extra[0]!r}, which the file does not hold")
    return shapes


@contextmanager
def open_delta(path: Path) -> Iterator[DecodedDelta]:
    """Open a delta file (any codec) as a lazy mapping of decoded tensors."""
    with safe_open(str(path), framework="pt") as handle:
        yield DecodedDelta(handle, handle.metadata())


def decoded(handle: Any) -> DecodedDelta:
    """A decoding view over an already open ``safe_open`` handle."""
    return DecodedDelta(handle, handle.metadata())
