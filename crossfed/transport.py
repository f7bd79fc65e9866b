"""Weights on the wire: bf16 safetensors files, written atomically and content-addressed."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

#: default inline/blob threshold: the paper's 2 GiB message cap
INLINE_MAX_BYTES = 2 * 1024**3
CHUNK = 1 << 20


def to_bf16(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous bf16 copies for the wire (fp32 stays on the coordinator)."""
    return {name: t.detach().to(torch.bfloat16).contiguous() for name, t in tensors.items()}


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomic(
    tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write a safetensors file via temp file, fsync and rename: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(dict(tensors), str(tmp), metadata=dict(metadata or {}))
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def delta_of(
    site_params: Mapping[str, torch.Tensor], global_params: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Delta = site model - global model, computed in fp32 and sent as bf16."""
    return {
        name: (site_params[name].detach().float() - global_params[name].float()).to(torch.bfloat16)
        for name in global_params
    }
