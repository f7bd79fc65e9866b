"""A site's local training state: model, inner AdamW state and data cursor, saved atomically.

The tensors go through ``torch.distributed.checkpoint`` (DCP): each rank writes its own
shards, and a checkpoint written by W ranks loads into any other number of ranks (or into one
process). A checkpoint is a directory ``ckpt-r<round>-s<step>-<status>/`` holding the DCP files and
``cursor.json``; it counts only once ``latest.json`` names it. That pointer is replaced
atomically (temp file, fsync, rename) by rank 0 after every rank has written, so a job killed
at any instant leaves either the previous checkpoint or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from crossfed.train.distributed import Ranks, barrier
from crossfed.train.model import parameters_of
from crossfed.transport import fsync_dir

POINTER = "latest.json"
CURSOR = "cursor.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, torn or does not fit the model."""


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by name, sharing storage (DCP loads into them in place)."""
    return {name: p.detach() for name, p in parameters_of(model).items()}


def latest(state_dir: Path) -> dict[str, Any] | None:
    """The cursor of the newest complete checkpoint, with ``path`` added; None if none."""
    pointer = Path(state_dir) / POINTER
    if not pointer.exists():
        return None
    try:
        name = json.loads(pointer.read_text())["checkpoint"]
        path = Path(state_dir) / name
        cursor = json.loads((path / CURSOR).read_text())
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{pointer}: unreadable checkpoint pointer: {exc}") from exc
    return {**cursor, "path": str(path)}


def save(
    state_dir: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    cursor: dict[str, Any],
    ranks: Ranks,
) -> Path:
    """Write model, optimiser and ``cursor`` (collective: every rank calls), then publish it."""
    state_dir = Path(state_dir)
    name = f"ckpt-r{int(cursor['round']):05d}-s{int(cursor['steps']):06d}-{cursor['status']}"
    path = state_dir / name
    current = latest(state_dir)  # every rank reads it: the early return must agree
    if current is not None and Path(current["path"]).name == name:
        return path  # this very state is already published
    if ranks.main:
        state_dir.mkdir(parents=True, exist_ok=True)
        if path.exists():  # a torn attempt of a killed job, or the checkpoint we replace
            shutil.rmtree(path)
    barrier(ranks)
    state = {"model": _model_state(model), "optim": get_optimizer_state_dict(model, optimizer)}
    with warnings.catch_warnings():  # one process: DCP says it assumes so on every call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(path))
    barrier(ranks)
    if ranks.main:
        _write_json_atomic(path / CURSOR, {**cursor, "world": ranks.world})
        _write_json_atomic(state_dir / POINTER, {"checkpoint": name})
        for old in state_dir.glob("ckpt-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    barrier(ranks)
    return path


def load(
    cursor: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    weights: bool,
) -> None:
    """Load the optimiser state (and the model weights when ``weights``) of ``cursor``."""
    path = Path(cursor["path"])
    state: dict[str, Any] = {"optim": get_optimizer_state_dict(model, optimizer)}
    if weights:
        state["model"] = _model_state(model)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path))
    except Exception as exc:  # DCP raises several kinds for missing/mismatched entries
        raise CheckpointError(f"{path}: cannot load into this model: {exc}") from exc
    set_optimizer_state_dict(model, optimizer, state["optim"])


def discard(state_dir: Path, ranks: Ranks) -> None:
    """Forget every checkpoint of ``state_dir`` (rank 0 removes; all ranks wait)."""
    if ranks.main:
        (Path(state_dir) / POINTER).unlink(missing_ok=True)
        for old in Path(state_dir).glob("ckpt-*"):
            shutil.rmtree(old, ignore_errors=True)
    barrier(ranks)
