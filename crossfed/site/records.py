"""What a site job knows and writes down: its settings and the typed records of one round.

``RoundStart`` is what rank 0 decides before a phase (the lease, the model, where to resume)
and hands to every rank; ``Cursor`` is where a phase stands (it goes into every checkpoint);
``PendingDelta`` is a delta written but not yet accepted (``pending.json``: it survives the
job); ``RoundOutcome`` is what the round came to (the train record's JSON). The dict forms
(``to_dict`` / ``from_dict``) are the file formats, unchanged.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from crossfed.coordinator.claims import DeltaClaim
from crossfed.fileio import INLINE_MAX_BYTES
from crossfed.train.distributed import ParallelConfig
from crossfed.train.inner import InnerConfig, PhaseState
from crossfed.train.overlap import OverlapConfig


@dataclass(frozen=True)
class SiteSettings:
    """Everything a site job needs that is not on the coordinator."""

    site: str
    data_dir: Path
    work_dir: Path
    block_size: int
    data_seed: int
    inner: InnerConfig
    heartbeat_s: float = 1.0
    inline_max_bytes: int = INLINE_MAX_BYTES
    #: delta codec on the wire: "none" (bf16), "int8" (about half the bytes) or "int4"
    #: (about a quarter); see crossfed.wire
    compress: str = "none"
    #: carry what the codec drops from one round's delta into the next (error feedback)
    error_feedback: bool = False
    device: str = "cpu"
    log_every: int = 5
    #: the run's rounds (N of "round k/N" in the progress lines), if known
    rounds: int | None = None
    lease_wait_s: float = 60.0
    #: "simulate" (one process plays the W ranks) or "torchrun" (W processes, FSDP2)
    launcher: str = "simulate"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    #: steps between in-phase checkpoints (0: only the end-of-phase one)
    checkpoint_every: int = 0
    #: checkpoints written in the background (a host copy of the state while it is written)
    checkpoint_background: bool = True
    #: epoch seconds after which no step may end (a chain job's walltime less its margin):
    #: the phase stops at the end of the block in progress and sends the blocks trained
    stop_training_at: float | None = None
    #: overlapped rounds: train the next lease while this one's delta is merged
    overlap: OverlapConfig = field(default_factory=OverlapConfig)


@dataclass(frozen=True)
class Cursor:
    """Where one phase stands: its round, lease and data position (saved in each checkpoint)."""

    round: int
    status: str  # training | done
    lease_id: int
    blocks: list[int]
    generation: int
    global_step: int
    site: str
    accumulation: int  # the phase's A: a resumed phase keeps it
    phase: PhaseState
    path: str | None = None  # the checkpoint it was read from
    #: an early phase's (overlapped rounds, before its fold-in; generation -1): the checkpoint
    #: holding the weights the site sent its last delta from, which the fold-in needs
    folds_from: str | None = None

    @property
    def before_fold_in(self) -> bool:
        """A checkpoint of an early phase not yet folded in (trained from the site's own
        weights): resumed, it folds the merged model in first."""
        return self.generation < 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "status": self.status,
            "lease_id": self.lease_id,
            "blocks": list(self.blocks),
            "generation": self.generation,
            "global_step": self.global_step,
            "site": self.site,
            "accumulation": self.accumulation,
            **self.phase.to_dict(),
            **({"path": self.path} if self.path else {}),
            **({"folds_from": self.folds_from} if self.folds_from else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cursor:
        return cls(
            round=int(data["round"]),
            status=str(data["status"]),
            lease_id=int(data["lease_id"]),
            blocks=[int(b) for b in data["blocks"]],
            generation=int(data["generation"]),
            global_step=int(data["global_step"]),
            site=str(data.get("site", "")),
            accumulation=int(data.get("accumulation") or 0),
            phase=PhaseState.from_dict(data),
            path=data.get("path"),
            folds_from=data.get("folds_from"),
        )


@dataclass(frozen=True)
class RoundStart:
    """What rank 0 decided for a round's phase, broadcast to every rank."""

    generation: int
    global_step: int
    schedule: dict[str, Any]
    flavour: str
    vocab_size: int
    lease: dict[str, Any]  # the coordinator's lease record: lease_id, n_blocks, blocks, ...
    model_path: str
    cursor: Cursor | None  # a checkpoint of this very phase to continue
    download_s: float
    rtt_ms: float
    accumulation: int
    #: an early lease (overlapped rounds): the phase starts from the site's own weights and
    #: folds the merged model in when it arrives; generation and model_path are set then
    early: bool = False
    #: a restarted job's first early phase: the end-of-phase checkpoint of the round whose
    #: delta it resends in the background (the killed job's), whose weights the phase starts
    #: from and folds from (the new process holds none yet)
    sent_from: Cursor | None = None

    @property
    def lease_id(self) -> int:
        return int(self.lease["lease_id"])


@dataclass(frozen=True)
class PendingDelta:
    """A delta written to disk and not yet accepted: resent by the next job if this one dies."""

    round: int
    lease_id: int
    generation: int
    tokens: int
    steps: int
    consumed: int  # blocks trained completely
    loss: float | None
    compute_s: float
    delta: str  # the delta file
    key: str | None  # its digest, computed while it was written
    residual: str | None  # the residual it leaves (error feedback)
    idle_s: float | None = None  # held waiting for a merge (overlapped rounds), not working

    def claim(self, site: str, blob: str) -> DeltaClaim:
        """What the coordinator is sent for it: ``site``'s claim, ``blob`` its digest."""
        return DeltaClaim(
            site=site, round_no=self.round, lease_id=self.lease_id, generation=self.generation,
            tokens=self.tokens, steps=self.steps, consumed=self.consumed, blob=blob,
            loss=self.loss, compute_s=self.compute_s, idle_s=self.idle_s or None,
        )  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PendingDelta:
        data = json.loads(text)
        return cls(**{f.name: data.get(f.name) for f in fields(cls)})


@dataclass
class RoundOutcome:
    """What one site did in one round (written as the train job's JSON output)."""

    site: str
    round: int
    status: str  # accepted | missed | no_data | lease_lost | stale | walltime
    detail: str = ""
    generation: int | None = None
    lease_id: int | None = None
    blocks_leased: int = 0
    blocks_committed: int = 0
    steps: int = 0
    tokens: int = 0
    windows: int = 0
    loss_mean: float | None = None
    loss_last: float | None = None
    compute_s: float = 0.0
    overhead_s: float = 0.0
    download_s: float = 0.0
    upload_s: float = 0.0
    checkpoint_s: float = 0.0
    tokens_per_s: float = 0.0
    step_s: float = 0.0
    #: model FLOPs utilisation on GPU (None on CPU, where no peak is known)
    mfu: float | None = None
    accumulation: int = 0
    ranks: int = 0
    micro_batch: int = 0
    launcher: str = ""
    transport: str = ""
    rtt_ms: float = 0.0
    #: overlapped rounds: the phase's step at which the merged model was folded in (None: it
    #: started from the merged model), the end-of-phase wait for it (idle), and the transfers
    #: that ran beside training (hidden) or held it up (exposed)
    fold_step: int | None = None
    merge_wait_s: float = 0.0
    comms_hidden_s: float = 0.0
    comms_exposed_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def outcome_json(outcome: RoundOutcome) -> str:
    return json.dumps(asdict(outcome), indent=2)
