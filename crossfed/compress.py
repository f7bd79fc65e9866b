"""Former home of the delta codecs, now :mod:`crossfed.wire.codecs`; its names stay importable.

``crossfed.coordinator.service`` still imports ``open_delta`` from this module; new code
imports :mod:`crossfed.wire.codecs`. Drop this module once nothing imports it.
"""

from __future__ import annotations

from crossfed.wire.codecs import (
    BLOCK,
    BLOCK_INT4,
    BLOCK_KEY,
    BLOCKS,
    CODEC_KEY,
    CODECS,
    INT4_MAX,
    SCALE_SUFFIX,
    SHAPES_KEY,
    CodecError,
    DecodedDelta,
    Encoder,
    decoded,
    dequantize_int4,
    dequantize_int8,
    encode_tensors,
    encoder,
    open_delta,
    quantize_int4,
    quantize_int8,
    save_delta,
)

__all__ = [
    "BLOCK",
    "BLOCKS",
    "BLOCK_INT4",
    "BLOCK_KEY",
    "CODECS",
    "CODEC_KEY",
    "INT4_MAX",
    "SCALE_SUFFIX",
    "SHAPES_KEY",
    "CodecError",
    "DecodedDelta",
    "Encoder",
    "decoded",
    "dequantize_int4",
    "dequantize_int8",
    "encode_tensors",
    "encoder",
    "open_delta",
    "quantize_int4",
    "quantize_int8",
    "save_delta",
]
