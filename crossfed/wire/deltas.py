"""Delta arithmetic: a site's delta ``site - global`` in fp32, sent as bf16.

One tensor's fp32 delta exists at a time; :func:`save_delta` streams the plain bf16 delta
file (codec ``none``). Encoded deltas and error feedback build on :func:`delta_tensor` in
:mod:`crossfed.wire.codecs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from crossfed.wire.tensors import TensorSpec, save_stream


def to_bf16(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous bf16 copies for the wire (fp32 stays on the coordinator)."""
    return {name: t.detach().to(torch.bfloat16).contiguous() for name, t in tensors.items()}


def delta_tensor(site: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """One tensor's delta ``site - reference``, computed in fp32 on the site tensor's device."""
    return site.detach().float() - reference.detach().to(site.device).float()


def delta_of(
    site_params: Mapping[str, torch.Tensor],
    global_params: Mapping[str, torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """Delta = site model - global model, computed in fp32 and sent as ``dtype`` (bf16)."""
    return {
        name: delta_tensor(site_params[name], global_params[name]).to(dtype)
        for name in global_params
    }


def save_delta(
    site_params: Mapping[str, torch.Tensor],
    global_params: Mapping[str, torch.Tensor],
    path: Path,
    metadata: Mapping[str, str] | None = None,
) -> str:
    """Write the bf16 delta tensor by tensor; returns its digest.

    Only one tensor's fp32 delta exists at a time and ``global_params`` may be lazy
    (:func:`crossfed.wire.tensors.open_tensors`: each reference tensor is read when its
    delta is made), so a site never holds a second copy of the model. Tensor names come from
    ``global_params``.
    Compressed deltas and error feedback: :func:`crossfed.wire.codecs.save_delta`.
    """
    specs = [
        TensorSpec(name, torch.bfloat16, tuple(site_params[name].shape))
        for name in global_params.keys()
    ]

    def produce(spec: TensorSpec) -> torch.Tensor:
        delta = delta_tensor(site_params[spec.name], global_params[spec.name])
        return delta.to(torch.bfloat16)

    return save_stream(path, specs, produce, metadata)
