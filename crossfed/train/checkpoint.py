"""A site's local training state: model, inner AdamW state and data cursor, saved atomically.

The tensors go through ``torch.distributed.checkpoint`` (DCP): each rank writes its own
shards, and a checkpoint written by W ranks loads into any other number of ranks (or into one
process). A checkpoint is a directory ``ckpt-r<round>-s<step>-<status>/`` holding the DCP files and
``cursor.json``; it counts only once ``latest.json`` names it. That pointer is replaced
atomically (temp file, fsync, rename) by rank 0 after every rank has written, so a job killed
at any instant leaves either the previous checkpoint or the new one, never a torn one.
A site writes its checkpoints, mid-phase and at the phase's end, in the background
(:func:`save_in_background`, DCP's ``async_save``): the state is copied at the call and
training (or the delta's writing) goes on while the files are written; the pointer moves
once they are complete, as with :func:`save`.

With error feedback the site also keeps a residual (the fp32 part of its last sent delta that
quantisation dropped): ``residual.safetensors`` beside the checkpoints, tagged with the
generation its delta started from. It is rank 0's whole-model state, written tensor by tensor
as the delta is (:func:`crossfed.wire.codecs.save_delta`) and put in place (one rename) only
once the coordinator has accepted that delta, so a killed job finds the residual that goes
into the delta it is about to (re)send. See :func:`carried_residual` for which residual a
delta carries.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from crossfed.fileio import replace_durably, write_atomic
from crossfed.train.distributed import Ranks, barrier, checkpoint_group
from crossfed.train.model import parameters_of

POINTER = "latest.json"
CURSOR = "cursor.json"
RESIDUAL = "residual.safetensors"
GENERATION_KEY = "crossfed.generation"
ROUND_KEY = "crossfed.round"

log = logging.getLogger(__name__)
# DCP warns on every call in one process that it assumes one process; a background save
# warns from its own thread, where a caller's ``catch_warnings`` does not reach
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled", module=r"torch\.distributed\.checkpoint"
)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, torn or does not fit the model."""


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(data, indent=2))


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
    path = _prepare(state_dir, cursor, ranks)
    if path is None:
        return path_of(state_dir, cursor)
    dcp.save(_state(model, optimizer), checkpoint_id=str(path))
    barrier(ranks)
    if ranks.main:
        _publish(Path(state_dir), path, cursor, ranks)
    barrier(ranks)
    return path


class BackgroundSave:
    """A checkpoint being written by DCP's background thread (``dcp.async_save``): the
    state was copied before :func:`save_in_background` returned, so training goes on while
    the files are written; rank 0 publishes it (``latest.json``) once every rank's files
    are complete. :meth:`wait` blocks until then and raises what the write raised."""

    def __init__(self, future: Future | None, path: Path) -> None:
        self.future, self.path = future, path

    def wait(self) -> Path:
        if self.future is not None:
            self.future.result()
            self.future = None
        return self.path


def save_in_background(
    state_dir: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    cursor: dict[str, Any],
    ranks: Ranks,
) -> BackgroundSave:
    """:func:`save` whose writing and publishing happen in the background (collective: every
    rank calls it, one save in flight at a time: wait for the last one first). A job killed
    before it is published leaves the checkpoint before it, as a killed :func:`save` does.
    Several ranks write over a gloo group of their own (``checkpoint_group``), so the
    background collectives never meet the training's."""
    path = _prepare(state_dir, cursor, ranks)
    if path is None:
        return BackgroundSave(None, path_of(state_dir, cursor))
    written = dcp.async_save(
        _state(model, optimizer), checkpoint_id=str(path), process_group=checkpoint_group()
    )
    assert isinstance(written, Future)  # the thread checkpointer's answer
    if not ranks.main:
        return BackgroundSave(written, path)
    published: Future = Future()

    def publish(done: Future) -> None:
        try:
            done.result()
            _publish(Path(state_dir), path, cursor, ranks)
        except BaseException as exc:  # surfaces in wait(), on the step loop's thread
            published.set_exception(exc)
        else:
            published.set_result(path)

    written.add_done_callback(publish)
    return BackgroundSave(published, path)


def path_of(state_dir: Path, cursor: dict[str, Any]) -> Path:
    """The folder ``cursor``'s checkpoint is (or will be) written to."""
    name = f"ckpt-r{int(cursor['round']):05d}-s{int(cursor['steps']):06d}-{cursor['status']}"
    return Path(state_dir) / name


def _prepare(state_dir: Path, cursor: dict[str, Any], ranks: Ranks) -> Path | None:
    """The folder ``cursor``'s checkpoint goes to, cleared of a torn attempt (all ranks
    wait); None when that very state is published already."""
    path = path_of(state_dir, cursor)
    barrier(ranks)  # rank 0 has published the checkpoint before (waited for on every rank)
    current = latest(state_dir)  # every rank reads it: the early return must agree
    if current is not None and Path(current["path"]).name == path.name:
        return None
    if ranks.main:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        if path.exists():  # a torn attempt of a killed job, or the checkpoint we replace
            shutil.rmtree(path)
    barrier(ranks)
    return path


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": _model_state(model), "optim": get_optimizer_state_dict(model, optimizer)}


def _publish(state_dir: Path, path: Path, cursor: dict[str, Any], ranks: Ranks) -> None:
    """Rank 0, once every rank's files are written: the cursor, then the pointer (the
    checkpoint counts from here), then the older checkpoints go, but for the one the new
    cursor ``folds_from`` (an early phase's fold-in still needs its weights)."""
    _write_json_atomic(path / CURSOR, {**cursor, "world": ranks.world})
    _write_json_atomic(state_dir / POINTER, {"checkpoint": path.name})
    keep = {path.name, cursor.get("folds_from")}
    for old in state_dir.glob("ckpt-*"):
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)


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
    _load_into(state, path)
    set_optimizer_state_dict(model, optimizer, state["optim"])


def load_weights(path: Path | str, model: torch.nn.Module) -> None:
    """Load the model weights (not the optimiser state) of the checkpoint at ``path``."""
    _load_into({"model": _model_state(model)}, path)


def _load_into(state: dict[str, Any], path: Path | str) -> None:
    """DCP's load of ``path`` into ``state`` in place; a checkpoint that does not fit is a
    :class:`CheckpointError` naming it."""
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as exc:  # DCP raises several kinds for missing/mismatched entries
        raise CheckpointError(f"{path}: cannot load into this model: {exc}") from exc


def discard(state_dir: Path, ranks: Ranks) -> None:
    """Forget every checkpoint of ``state_dir`` (rank 0 removes; all ranks wait)."""
    if ranks.main:
        (Path(state_dir) / POINTER).unlink(missing_ok=True)
        for old in Path(state_dir).glob("ckpt-*"):
            shutil.rmtree(old, ignore_errors=True)
    barrier(ranks)


# --------------------------------------------------------------------------- residual
def residual_metadata(round_no: int, generation: int) -> dict[str, str]:
    """Header of a residual left by the delta of ``round_no`` trained from ``generation``."""
    return {ROUND_KEY: str(round_no), GENERATION_KEY: str(generation)}


def carried_residual(state_dir: Path, generation: int) -> tuple[Path | None, str]:
    """The residual a delta trained from ``generation`` carries, and what was decided.

    Carried only when it trailed the delta merged into exactly this generation (the site took
    part in the round before). A site that missed rounds drops it: the residual corrects the
    site's contribution to a model that other sites' merges have since moved on from, it would
    enter the new average with this round's token share instead of the one it was owed, and
    it is at most half a quantisation step per value, so dropping it loses one rounding (what
    a site with no local state pays), while adding it applies a stale update.
    Returns ``(path or None, "carried" | "none" | "dropped: <why>")``.
    """
    path = Path(state_dir) / RESIDUAL
    if not path.exists():
        return None, "none"
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
        made_at, round_no = int(meta[GENERATION_KEY]), int(meta[ROUND_KEY])
    except Exception as exc:  # safetensors raises its own errors for torn headers
        raise CheckpointError(f"{path}: unreadable error-feedback residual: {exc}") from exc
    if made_at + 1 == generation:
        return path, "carried"
    why = (
        f"dropped: it trailed the delta of round {round_no} from generation {made_at}; "
        f"this delta starts from generation {generation}"
    )
    log.info("error-feedback residual %s", why)
    return None, why


def commit_residual(state_dir: Path, candidate: Path | None) -> bool:
    """Make ``candidate`` (written beside an accepted delta) the residual the next delta
    carries. False when there is none to commit (no error feedback, or committed already by a
    job that was killed before it could forget the delta)."""
    if candidate is None or not Path(candidate).exists():
        return False
    target = Path(state_dir) / RESIDUAL
    target.parent.mkdir(parents=True, exist_ok=True)
    replace_durably(Path(candidate), target)
    return True
