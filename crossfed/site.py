"""The loop a site job runs for one outer round.

join (digest checked) -> fetch the global model -> lease blocks -> train H inner steps while a
heartbeat keeps the lease alive -> checkpoint -> send the bf16 delta, which commits the blocks
in the same coordinator transaction.

Crash safety, in order of where a job dies:

* mid-phase: every ``checkpoint_every`` steps the model, inner AdamW state and data cursor
  are checkpointed (DCP, atomic). A restarted job in the same round whose lease is still alive
  continues it from the cursor: no window is retrained or skipped. If the lease has expired
  its blocks went back to the pool, so the checkpoint's weights and cursor are dropped and the
  job leases anew.
* after the end-of-phase checkpoint: the checkpointed delta is resent when the job restarts
  (the coordinator answers idempotently per lease).

Inner optimiser state persists across rounds, as in DiLoCo: a site that adopts a newer global
model (the next round, or after missing rounds) keeps its AdamW moments and step count, and
only a site with no local state starts AdamW afresh. AdamW's moments decay geometrically
(beta2 = 0.95: about 1% left after 90 steps), so stale moments are forgotten within a round,
while resetting them would restart the bias correction at the schedule's current (peak) rate.

With error feedback (``transport.error_feedback``) the delta carries the residual the codec
dropped from the site's previous delta, and leaves a new one beside it; that one becomes the
site's residual once the coordinator accepts the delta (a refused delta leaves the old one).
A job killed anywhere in between finds the residual its delta was or will be made with. A site
that missed rounds drops its residual (:func:`crossfed.train.checkpoint.carried_residual`).

Under torchrun (``launcher: torchrun``) every rank runs this loop; rank 0 alone talks to the
coordinator and broadcasts the round's plan, the lease and every step's window limit.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from crossfed.compress import save_delta
from crossfed.coordinator.client import CoordinatorClient, Refused
from crossfed.coordinator.faults import crash_point
from crossfed.darl.blockspace import BlockSpace
from crossfed.darl.leases import lease_blocks
from crossfed.fileio import keep_global_model
from crossfed.progress import CONSOLE, step_line
from crossfed.site_lock import hold_site_folder
from crossfed.train import checkpoint
from crossfed.train.distributed import (
    DistributedError,
    ParallelConfig,
    Ranks,
    broadcast_int,
    broadcast_object,
    full_parameters,
    load_full_parameters,
    mfu,
    parallelize,
    rank_device,
    sum_over_ranks,
    uses_autocast,
)
from crossfed.train.inner import (
    InnerConfig,
    LeaseWindows,
    PhaseResult,
    PhaseState,
    StepInfo,
    Trainer,
    make_optimizer,
    run_inner_phase,
)
from crossfed.train.model import build_model, flops_per_token
from crossfed.train.schedule import LRSchedule
from crossfed.train.windows import WindowStore
from crossfed.transport import open_tensors

log = logging.getLogger("crossfed.site")


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
    inline_max_bytes: int = 2 * 1024**3
    #: delta codec on the wire: "none" (bf16), "int8" (about half the bytes) or "int4"
    #: (about a quarter); see crossfed.compress
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
    #: epoch seconds after which no step may end (a chain job's walltime less its margin):
    #: the phase stops at the end of the block in progress and sends the blocks trained
    stop_training_at: float | None = None


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
    extra: dict[str, Any] = field(default_factory=dict)


class Heartbeat:
    """Background thread: refreshes the lease, reports progress, learns of steals and expiry."""

    def __init__(
        self, client: CoordinatorClient, site: str, lease: dict, interval_s: float
    ) -> None:
        self.client, self.site, self.interval_s = client, site, interval_s
        self.lease_id = lease["lease_id"]
        self.allowed_blocks = lease["n_blocks"]
        self.consumed = 0
        self.t_step_s: float | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{site}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        echo, received = None, 0.0  # the last reply's nonce, for the coordinator's RTT
        while not self._stop.wait(self.interval_s):
            try:
                held = time.perf_counter() - received if echo is not None else None
                reply = self.client.heartbeat(
                    self.lease_id, self.site, self.consumed, self.t_step_s, echo, held
                )
                echo, received = reply.get("echo"), time.perf_counter()
            except Refused as exc:
                self.lost = f"{exc.code}: {exc.detail}"
                return
            except Exception as exc:  # transient: the TTL covers a few missed beats
                log.warning("[%s] heartbeat failed: %s", self.site, exc)
                continue
            shrunk = reply["lease"]["n_blocks"]
            if shrunk < self.allowed_blocks:
                log.info(
                    "[%s] lease %d: %d blocks stolen",
                    self.site,
                    self.lease_id,
                    self.allowed_blocks - shrunk,
                )
            self.allowed_blocks = shrunk


class _LocalBeat:
    """Stand-in for the heartbeat on ranks other than 0 (rank 0 alone talks to the coordinator)."""

    def __init__(self, lease: dict) -> None:
        self.allowed_blocks = lease["n_blocks"]
        self.consumed = lease.get("consumed", 0)
        self.t_step_s: float | None = None
        self.lost: str | None = None

    def __enter__(self) -> _LocalBeat:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class SiteRunner:
    """One site's state across rounds: model, inner optimiser, local checkpoints.

    Under torchrun every rank builds a runner; rank 0 alone holds a coordinator client. It
    decides what the round does (join, adopt, lease or resume) and broadcasts that; all ranks
    then train, checkpoint and gather the delta together, and rank 0 sends it.
    """

    def __init__(
        self,
        settings: SiteSettings,
        client: CoordinatorClient | None,
        ranks: Ranks | None = None,
    ) -> None:
        self.s = settings
        self.client = client
        self.ranks = ranks or Ranks()
        if self.ranks.distributed and self.ranks.world != settings.inner.ranks:
            raise DistributedError(
                f"site {settings.site}: {self.ranks.world} torchrun processes for "
                f"{settings.inner.ranks} ranks; start one process per rank"
            )
        if self.ranks.main and client is None:
            raise DistributedError("rank 0 needs a coordinator client")
        self.device = rank_device(settings.device, self.ranks)
        self.store = WindowStore.open(settings.data_dir, "train")
        self.space = BlockSpace(self.store.n_windows, settings.block_size, settings.data_seed)
        self.dir = settings.work_dir / settings.site
        self.state_dir = self.dir / "state"
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.ranks.main:  # a second job of this site waits for this one to end
            hold_site_folder(self.dir)
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.flops_per_token: float | None = None
        self._restored = False

    # ---------------------------------------------------------------- local files
    @property
    def pending_path(self) -> Path:
        return self.dir / "pending.json"

    def _write_pending(self, pending: dict[str, Any]) -> None:
        tmp = self.pending_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(pending))
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, self.pending_path)

    def _model_path(self, generation: int) -> Path:
        return self.dir / "models" / f"global-{generation:06d}.safetensors"

    # ---------------------------------------------------------------- one round
    def run_round(self, round_no: int, accumulation: int | None = None) -> RoundOutcome:
        """Train one round; every rank calls this, rank 0's outcome is the one to report.

        ``accumulation`` (rank 0's, from the round's plan) replaces the settings' A for this
        round and the ones after it; a phase resumed from its checkpoint keeps the A it began with.
        """
        if accumulation and self.ranks.main:
            self._use_accumulation(int(accumulation))
        start = self._prepare(round_no) if self.ranks.main else None
        start = broadcast_object(start, self.ranks)
        if isinstance(start, RoundOutcome):
            return start
        self._use_accumulation(int(start["accumulation"]))
        return self._run_phase(round_no, start)

    def _use_accumulation(self, accumulation: int) -> None:
        if accumulation != self.s.inner.accumulation:
            inner = replace(self.s.inner, accumulation=accumulation)
            self.s = replace(self.s, inner=inner)

    def _prepare(self, round_no: int) -> RoundOutcome | dict[str, Any]:
        """Rank 0: join, resend a checkpointed delta, adopt the global model, lease or resume."""
        assert self.client is not None
        rtt = self.client.rtt_ms()
        joined = self.client.register(
            self.s.site, self.space.digest(), self.s.inner.ranks, rtt, round_no
        )
        resumed = self._resume_pending(round_no)
        if resumed is not None:
            return resumed
        if joined["round"] != round_no:
            return RoundOutcome(
                self.s.site,
                round_no,
                "missed",
                rtt_ms=rtt,
                detail=f"round {round_no} closed; coordinator is at round {joined['round']}",
            )
        generation = joined["generation"]
        t0 = time.perf_counter()
        model_path = self._download(generation)
        download_s = time.perf_counter() - t0
        want = lease_blocks(
            joined["inner_steps"],
            self.s.inner.micro_batch,
            self.s.inner.ranks,
            self.s.inner.accumulation,
            self.s.block_size,
        )
        cursor, lease = self._resumable(round_no, generation, joined)
        if cursor is not None and cursor.get("accumulation"):
            self._use_accumulation(int(cursor["accumulation"]))  # the phase's own A
        if lease is None:
            lease = self._lease(round_no, want, rtt)
        if lease == "missed":
            return RoundOutcome(
                self.s.site,
                round_no,
                "missed",
                generation=generation,
                rtt_ms=rtt,
                detail=f"round {round_no} closed before this job could lease",
            )
        if lease is None:
            return RoundOutcome(
                self.s.site,
                round_no,
                "no_data",
                generation=generation,
                rtt_ms=rtt,
                detail="no blocks to lease or steal before the round closed",
            )
        log.info(
            "[%s r%d] lease %d: %d blocks (asked %d), generation %d, global step %d%s",
            self.s.site,
            round_no,
            lease["lease_id"],
            lease["n_blocks"],
            want,
            generation,
            joined["global_step"],
            f", resuming at window {cursor['windows']}" if cursor else "",
        )
        return {
            "generation": generation,
            "global_step": cursor["global_step"] if cursor else joined["global_step"],
            "schedule": joined["schedule"],
            "flavour": joined["flavour"],
            "vocab_size": joined["vocab_size"],
            "lease": lease,
            "model_path": str(model_path),
            "cursor": cursor,
            "download_s": download_s,
            "rtt_ms": rtt,
            "accumulation": self.s.inner.accumulation,
        }

    def _resumable(
        self, round_no: int, generation: int, joined: dict
    ) -> tuple[dict | None, dict | None]:
        """A checkpoint this job can continue: same round and generation, and the lease it
        trained is still alive (a heartbeat confirms it). A "done" one (killed between the
        end-of-phase checkpoint and the delta) trains nothing more and goes on to the delta.
        Otherwise the checkpoint's weights and cursor are dropped (its blocks return to the
        pool on the lease's TTL)."""
        cursor = checkpoint.latest(self.state_dir)
        if cursor is None or cursor.get("status") not in ("training", "done"):
            return None, None
        if cursor["round"] != round_no or cursor["generation"] != generation:
            if cursor["status"] == "training":
                log.info(
                    "[%s] dropping the mid-phase checkpoint of round %d (now round %d)",
                    self.s.site,
                    cursor["round"],
                    round_no,
                )
            return None, None
        live = [
            lease
            for lease in joined.get("active_leases", [])
            if lease["lease_id"] == cursor["lease_id"] and lease["site"] == self.s.site
        ]
        if not live:
            log.info(
                "[%s r%d] lease %d of the mid-phase checkpoint has expired; training anew",
                self.s.site,
                round_no,
                cursor["lease_id"],
            )
            return None, None
        lease = live[0]
        assert self.client is not None
        try:
            reply = self.client.heartbeat(lease["lease_id"], self.s.site, lease["consumed"], None)
        except Refused as exc:
            log.info(
                "[%s r%d] lease %d is gone (%s)", self.s.site, round_no, lease["lease_id"], exc.code
            )
            return None, None
        lease = reply["lease"]
        if list(lease["blocks"]) != list(cursor["blocks"])[: len(lease["blocks"])]:
            raise checkpoint.CheckpointError(
                f"lease {lease['lease_id']}: blocks differ from the checkpoint's record"
            )
        return cursor, lease

    def _download(self, generation: int) -> Path:
        """The global model of ``generation`` on local disk (older ones removed)."""
        assert self.client is not None
        path = self._model_path(generation)
        self.client.download_model(generation, path)
        keep_global_model(path, self.s.work_dir.parent, generation)
        for old in path.parent.glob("global-*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
        return path

    # ---------------------------------------------------------------- all ranks
    def _ensure_model(self, flavour: str, vocab_size: int) -> None:
        """Build, parallelise and pair with AdamW once per process; reload the inner state.

        The inner AdamW state is kept across rounds (DiLoCo): a restarted job reloads it from
        the newest local checkpoint, whatever generation that checkpoint trained from.
        """
        if self.model is not None:
            return
        model = build_model(flavour, vocab_size=vocab_size, device=self.device)
        self.flops_per_token = flops_per_token(model, flavour, vocab_size, self.store.seq_len)
        self.model = parallelize(model, self.ranks, self.s.parallel, self.device)
        self.optimizer = make_optimizer(self.model, self.s.inner, lr=0.0)

    def _restore(self, cursor: dict | None) -> None:
        """Resuming ``cursor``: its weights and optimiser state. A fresh process: the inner
        optimiser state of the newest checkpoint (kept across rounds, as DiLoCo does)."""
        assert self.model is not None and self.optimizer is not None
        if cursor is not None:
            checkpoint.load(cursor, self.model, self.optimizer, weights=True)
        elif not self._restored:
            newest = checkpoint.latest(self.state_dir)
            if newest is not None:
                checkpoint.load(newest, self.model, self.optimizer, weights=False)
        self._restored = True

    def _run_phase(self, round_no: int, start: dict[str, Any]) -> RoundOutcome:
        self._ensure_model(start["flavour"], start["vocab_size"])
        assert self.model is not None and self.optimizer is not None
        cursor = start["cursor"]
        if cursor is None:
            load_full_parameters(self.model, load_file(start["model_path"]))
        self._restore(cursor)
        lease, generation = start["lease"], start["generation"]
        state = PhaseState.from_dict(cursor) if cursor else PhaseState()
        resumed_at = state.windows
        beat: Heartbeat | _LocalBeat = _LocalBeat(lease)
        if self.ranks.main:
            assert self.client is not None
            beat = Heartbeat(self.client, self.s.site, lease, self.s.heartbeat_s)
        beat.consumed = max(beat.consumed, lease.get("consumed", 0))
        # the heartbeat runs until the delta is in: a commit needs a live lease
        with beat:
            state = self._train(round_no, start, state, beat)
            result = PhaseResult.of(state)
            outcome = RoundOutcome(
                self.s.site,
                round_no,
                "accepted",
                generation=generation,
                lease_id=lease["lease_id"],
                blocks_leased=lease["n_blocks"],
                steps=state.steps,
                tokens=state.tokens,
                windows=state.windows,
                loss_mean=result.loss_mean,
                loss_last=result.loss_last,
                compute_s=state.compute_s,
                download_s=start["download_s"],
                step_s=result.step_s,
                rtt_ms=start["rtt_ms"],
                tokens_per_s=state.tokens / state.compute_s if state.compute_s else 0.0,
                accumulation=self.s.inner.accumulation,
                ranks=self.s.inner.ranks,
                micro_batch=self.s.inner.micro_batch,
                launcher=self.s.launcher,
            )
            outcome.mfu = mfu(
                outcome.tokens_per_s, self.flops_per_token, self.device, self.ranks.world
            )
            if resumed_at:
                outcome.extra["resumed_at_window"] = resumed_at
            lost = broadcast_object(beat.lost, self.ranks)
            # rank 0 alone knows the walltime (Slurm's end time): its verdict holds for all
            timed_out = broadcast_object(
                state.stopped_early and out_of_time(self.s.stop_training_at, None), self.ranks
            )
            if lost is None and state.steps == 0 and timed_out:
                if self.ranks.main:  # nothing trained: its blocks go back to the pool now
                    assert self.client is not None
                    self.client.release(lease["lease_id"], self.s.site)
                outcome.status, outcome.detail = "walltime", "the walltime came before a step"
                return outcome
            if lost is not None or state.steps == 0:
                outcome.status, outcome.detail = "lease_lost", lost or "lease empty"
                return outcome
            if timed_out:
                outcome.detail = f"stopped for the walltime after {outcome.windows} windows"
            pending = self._checkpoint(round_no, start, state, outcome)
            if not self.ranks.main:
                return outcome
            return self._send(pending, outcome)

    def _cursor(self, round_no: int, start: dict, state: PhaseState, status: str) -> dict:
        return {
            "round": round_no,
            "status": status,
            "lease_id": start["lease"]["lease_id"],
            "blocks": list(start["lease"]["blocks"]),
            "generation": start["generation"],
            "global_step": start["global_step"],
            "site": self.s.site,
            "accumulation": self.s.inner.accumulation,
            **state.to_dict(),
        }

    def _checkpoint(
        self, round_no: int, start: dict, state: PhaseState, outcome: RoundOutcome
    ) -> dict | None:
        """Model, optimiser and cursor (DCP), the delta and the pending record: all before the
        commit. Collective; rank 0 returns the pending record."""
        assert self.model is not None and self.optimizer is not None
        t1 = time.perf_counter()
        params = full_parameters(self.model)
        checkpoint.save(
            self.state_dir,
            self.model,
            self.optimizer,
            self._cursor(round_no, start, state, "done"),
            self.ranks,
        )
        pending = None
        if self.ranks.main:
            delta_path = self.dir / f"delta-r{round_no:05d}.safetensors"
            residual_path = None
            with ExitStack() as files:  # the reference and the residual: tensor by tensor
                reference = files.enter_context(open_tensors(Path(start["model_path"])))
                carried = None
                if self.s.error_feedback:
                    residual_path = self.dir / f"residual-r{round_no:05d}.safetensors"
                    path, decision = checkpoint.carried_residual(
                        self.state_dir, start["generation"]
                    )
                    outcome.extra["residual"] = decision
                    if path is not None:
                        carried = files.enter_context(open_tensors(path))
                key = save_delta(
                    params,
                    reference,
                    delta_path,
                    {"site": self.s.site, "round": str(round_no)},
                    codec=self.s.compress,
                    residual_in=carried,
                    residual_out=residual_path,
                    residual_metadata=checkpoint.residual_metadata(round_no, start["generation"]),
                )
            pending = {
                "round": round_no,
                "lease_id": start["lease"]["lease_id"],
                "generation": start["generation"],
                "tokens": state.tokens,
                "steps": state.steps,
                "consumed": self._blocks_covered(start["lease"], state.windows),
                "loss": PhaseResult.of(state).loss_mean,
                "compute_s": state.compute_s,
                "delta": str(delta_path),
                "key": key,
                "residual": str(residual_path) if residual_path else None,
            }
            self._write_pending(pending)
        del params
        outcome.checkpoint_s = state.checkpoint_s + time.perf_counter() - t1
        return pending

    def _lease(self, round_no: int, want: int, rtt: float) -> dict | str | None:
        """A lease, None when no data turned up in time, or "missed" when the round closed.

        A restarted job whose previous incarnation still holds a lease it cannot continue
        waits for that lease's TTL to return it to the pool (the crash costs exactly that
        lease), then leases anew.
        """
        assert self.client is not None
        deadline = time.monotonic() + self.s.lease_wait_s
        delay = 0.5
        while True:
            try:
                reply = self.client.lease(self.s.site, round_no, want, None, rtt)
            except Refused as exc:
                if exc.code in ("round_closed", "already_contributed"):
                    return "missed"
                if exc.code != "already_holding":
                    raise
                reply = {"lease": None}
                log.info(
                    "[%s r%d] a previous job still holds a lease; waiting for its TTL",
                    self.s.site,
                    round_no,
                )
            if reply["lease"] is not None:
                return reply["lease"]
            if time.monotonic() > deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _ranges(self, blocks: list[int]) -> list[tuple[int, int]]:
        return [(r.start, r.stop) for r in (self.space.block_windows(b) for b in blocks)]

    def _blocks_covered(self, lease: dict, windows_done: int) -> int:
        """How many of the lease's blocks were trained completely."""
        covered = 0
        for block in lease["blocks"]:
            size = len(self.space.block_windows(block))
            if windows_done < size:
                break
            windows_done -= size
            covered += 1
        return covered

    def _train(
        self, round_no: int, start: dict, state: PhaseState, beat: Heartbeat | _LocalBeat
    ) -> PhaseState:
        assert self.model is not None and self.optimizer is not None
        lease = start["lease"]
        windows = LeaseWindows.of(self._ranges(lease["blocks"]))
        sizes = [stop - start_ for start_, stop in windows.ranges]
        started = time.perf_counter()
        trainer = Trainer(
            self.model,
            self.optimizer,
            self.s.inner,
            device=self.device,
            rank=self.ranks.rank,
            world=self.ranks.world,
            autocast=uses_autocast(self.device, self.ranks),
            reduce_loss=lambda loss: sum_over_ranks(loss, self.ranks),
        )

        done = [state.windows]
        steps = -(-len(windows) // self.s.inner.windows_per_step)  # this phase's steps

        def limit() -> int:
            allowed = 0 if beat.lost is not None else sum(sizes[: beat.allowed_blocks])
            if out_of_time(self.s.stop_training_at, beat.t_step_s):
                allowed = min(allowed, block_end(sizes, done[0]))
            return broadcast_int(allowed, self.ranks)

        def on_step(info: StepInfo) -> None:
            crash_point("site_after_step", f"{self.s.site}:{round_no}")  # tests only
            done[0] = info.windows_done
            beat.consumed = max(beat.consumed, self._blocks_covered(lease, info.windows_done))
            beat.t_step_s = info.step_s
            if self.ranks.main and (
                info.step % self.s.log_every == 0 or info.windows_done >= len(windows)
            ):
                tokens_per_s = (info.tokens - tokens0) / max(1e-9, time.perf_counter() - started)
                loss = info.loss
                CONSOLE.info(
                    step_line(
                        self.s.site,
                        round_no,
                        self.s.rounds,
                        info.step,
                        steps,
                        loss,
                        tokens_per_s,
                        mfu(tokens_per_s, self.flops_per_token, self.device, self.ranks.world),
                    )
                )
                log.info(
                    "[%s r%d] step %d (global %d) loss %.4f lr %.2e %.0f tok/s lease %d/%d blocks",
                    self.s.site,
                    round_no,
                    info.step,
                    info.global_step,
                    loss,
                    info.lr,
                    tokens_per_s,
                    beat.consumed,
                    beat.allowed_blocks,
                )

        def save(state: PhaseState) -> None:
            assert self.model is not None and self.optimizer is not None
            cursor = self._cursor(round_no, start, state, "training")
            checkpoint.save(self.state_dir, self.model, self.optimizer, cursor, self.ranks)

        tokens0 = state.tokens
        state = run_inner_phase(
            trainer,
            self.store.windows,
            windows,
            schedule=LRSchedule(**start["schedule"]),
            global_step=start["global_step"],
            state=state,
            window_limit=limit,
            on_step=on_step,
            checkpoint=save,
            checkpoint_every=self.s.checkpoint_every,
        )
        if self.ranks.main:
            log.info(
                "[%s r%d] trained %d steps on %d/%d windows, %d tokens in %.1fs",
                self.s.site,
                round_no,
                state.steps,
                state.windows,
                len(windows),
                state.tokens,
                state.compute_s,
            )
        return state

    def _send(self, pending: dict[str, Any], outcome: RoundOutcome) -> RoundOutcome:
        """Send the checkpointed delta; the reply commits its blocks (or rejects it as stale)."""
        path = Path(pending["delta"])
        inline = path.stat().st_size <= self.s.inline_max_bytes
        t0 = time.perf_counter()
        try:
            reply = self.client.submit_delta(
                pending["round"],
                path,
                inline=inline,
                key=pending.get("key"),  # digest computed while the file was written
                site=self.s.site,
                lease_id=pending["lease_id"],
                generation=pending["generation"],
                tokens=pending["tokens"],
                steps=pending["steps"],
                consumed=pending["consumed"],
                loss=pending["loss"],
                compute_s=pending["compute_s"],
            )
        except Refused as exc:
            if exc.status >= 500 or exc.status in (401, 403):
                raise
            outcome.status = "stale" if exc.code == "stale_generation" else "lease_lost"
            outcome.detail = f"{exc.code}: {exc.detail}"
            reply = None
        outcome.upload_s = time.perf_counter() - t0
        size_mb = path.stat().st_size / 1e6
        outcome.transport = "inline" if inline else "blob"
        outcome.overhead_s = outcome.download_s + outcome.upload_s + outcome.checkpoint_s
        residual = Path(pending["residual"]) if pending.get("residual") else None
        if reply is not None:
            outcome.blocks_committed = pending["consumed"]
            outcome.extra["already"] = reply.get("already", False)
            checkpoint.commit_residual(self.state_dir, residual)  # the next delta carries it
        elif residual is not None:  # not merged: the residual it came from is still owed
            residual.unlink(missing_ok=True)
        self.pending_path.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        log.info(
            "[%s r%d] delta %s (%s, %.1f MB): %s",
            self.s.site,
            pending["round"],
            outcome.status,
            outcome.transport,
            size_mb,
            outcome.detail or "blocks committed",
        )
        return outcome

    def _resume_pending(self, round_no: int) -> RoundOutcome | None:
        """A checkpointed but unsent delta from a killed job: send it again (idempotent)."""
        if not self.pending_path.exists():
            return None
        pending = json.loads(self.pending_path.read_text())
        if not Path(pending["delta"]).exists():
            self.pending_path.unlink()
            return None
        log.info(
            "[%s] resending checkpointed delta of round %d (lease %d)",
            self.s.site,
            pending["round"],
            pending["lease_id"],
        )
        outcome = RoundOutcome(
            self.s.site,
            pending["round"],
            "accepted",
            generation=pending["generation"],
            lease_id=pending["lease_id"],
            steps=pending["steps"],
            tokens=pending["tokens"],
            loss_mean=pending["loss"],
            compute_s=pending["compute_s"],
        )
        outcome = self._send(pending, outcome)
        outcome.extra["resumed"] = True
        if pending["round"] != round_no:
            return None
        return outcome


def out_of_time(stop_at: float | None, step_s: float | None) -> bool:
    """Whether another step of ``step_s`` seconds would end after ``stop_at`` (epoch s)."""
    return stop_at is not None and time.time() + (step_s or 0.0) > stop_at


def block_end(sizes: list[int], windows_done: int) -> int:
    """Windows up to the end of the block in progress after ``windows_done`` (block sizes in
    lease order): where a phase can stop without leaving a block half trained."""
    end = 0
    for size in sizes:
        if end >= windows_done:
            break
        end += size
    return end


def outcome_json(outcome: RoundOutcome) -> str:
    return json.dumps(asdict(outcome), indent=2)
