"""The loop a site job runs for one outer round.

join (digest checked) -> fetch the global model -> lease blocks -> train H inner steps while a
heartbeat keeps the lease alive -> checkpoint -> send the bf16 delta, which commits the blocks
in the same coordinator transaction. A job killed after its checkpoint resends the same delta
when it restarts (the coordinator answers idempotently per lease); one killed before it loses
only its lease, which expires and returns to the pool.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from crossfed.coordinator.client import CoordinatorClient, Refused
from crossfed.darl.blockspace import BlockSpace
from crossfed.darl.leases import lease_blocks
from crossfed.train.inner import (
    InnerConfig,
    PhaseResult,
    StepInfo,
    make_optimizer,
    run_inner_phase,
)
from crossfed.train.model import build_model, load_parameters, parameters_of
from crossfed.train.schedule import LRSchedule
from crossfed.train.windows import WindowStore
from crossfed.transport import delta_of, save_atomic

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
    device: str = "cpu"
    log_every: int = 5
    lease_wait_s: float = 60.0


@dataclass
class RoundOutcome:
    """What one site did in one round (written as the train job's JSON output)."""

    site: str
    round: int
    status: str  # accepted | missed | no_data | lease_lost | stale
    detail: str = ""
    generation: int | None = None
    lease_id: int | None = None
    blocks_leased: int = 0
    blocks_committed: int = 0
    steps: int = 0
    tokens: int = 0
    loss_mean: float | None = None
    loss_last: float | None = None
    compute_s: float = 0.0
    overhead_s: float = 0.0
    download_s: float = 0.0
    upload_s: float = 0.0
    checkpoint_s: float = 0.0
    tokens_per_s: float = 0.0
    step_s: float = 0.0
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
        while not self._stop.wait(self.interval_s):
            try:
                reply = self.client.heartbeat(
                    self.lease_id, self.site, self.consumed, self.t_step_s
                )
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


class SiteRunner:
    """One site's state across rounds: model, inner optimiser, local checkpoints."""

    def __init__(self, settings: SiteSettings, client: CoordinatorClient) -> None:
        self.s = settings
        self.client = client
        self.store = WindowStore.open(settings.data_dir, "train")
        self.space = BlockSpace(self.store.n_windows, settings.block_size, settings.data_seed)
        self.dir = settings.work_dir / settings.site
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    # ---------------------------------------------------------------- local checkpoint
    @property
    def pending_path(self) -> Path:
        return self.dir / "pending.json"

    def _save_state(self) -> None:
        """Inner optimiser state survives across rounds and restarts (DiLoCo keeps it)."""
        assert self.optimizer is not None
        tmp = self.dir / f".optimizer.{os.getpid()}.tmp"
        torch.save(self.optimizer.state_dict(), tmp)
        os.replace(tmp, self.dir / "optimizer.pt")

    def _load_state(self) -> None:
        path = self.dir / "optimizer.pt"
        if path.exists() and self.optimizer is not None:
            self.optimizer.load_state_dict(torch.load(path, weights_only=True))

    def _write_pending(self, pending: dict[str, Any]) -> None:
        tmp = self.pending_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(pending))
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, self.pending_path)

    # ---------------------------------------------------------------- one round
    def run_round(self, round_no: int) -> RoundOutcome:
        rtt = self.client.rtt_ms()
        joined = self.client.register(self.s.site, self.space.digest(), self.s.inner.ranks, rtt)
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
        schedule = LRSchedule(**joined["schedule"])
        t0 = time.perf_counter()
        global_params = self._adopt(generation, joined)
        download_s = time.perf_counter() - t0
        want = lease_blocks(
            joined["inner_steps"],
            self.s.inner.micro_batch,
            self.s.inner.ranks,
            self.s.inner.accumulation,
            self.s.block_size,
        )
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
            "[%s r%d] lease %d: %d blocks (asked %d), generation %d, global step %d",
            self.s.site,
            round_no,
            lease["lease_id"],
            lease["n_blocks"],
            want,
            generation,
            joined["global_step"],
        )
        # the heartbeat runs until the delta is in: a commit needs a live lease
        with Heartbeat(self.client, self.s.site, lease, self.s.heartbeat_s) as beat:
            result = self._train(lease, beat, schedule, joined["global_step"], round_no)
            outcome = RoundOutcome(
                self.s.site,
                round_no,
                "accepted",
                generation=generation,
                lease_id=lease["lease_id"],
                blocks_leased=lease["n_blocks"],
                steps=result.steps,
                tokens=result.tokens,
                loss_mean=result.loss_mean,
                loss_last=result.loss_last,
                compute_s=result.compute_s,
                download_s=download_s,
                step_s=result.step_s,
                rtt_ms=rtt,
                tokens_per_s=result.tokens / result.compute_s if result.compute_s else 0.0,
            )
            if beat.lost is not None or result.steps == 0:
                outcome.status, outcome.detail = "lease_lost", beat.lost or "lease empty"
                return outcome
            pending = self._checkpoint(round_no, lease, generation, result, global_params, outcome)
            return self._send(pending, outcome)

    def _checkpoint(
        self,
        round_no: int,
        lease: dict,
        generation: int,
        result: PhaseResult,
        global_params: dict[str, torch.Tensor],
        outcome: RoundOutcome,
    ) -> dict:
        """Write the delta, optimiser state and the pending record before any commit."""
        t1 = time.perf_counter()
        assert self.model is not None
        delta = delta_of(parameters_of(self.model), global_params)
        delta_path = self.dir / f"delta-r{round_no:05d}.safetensors"
        save_atomic(delta, delta_path, {"site": self.s.site, "round": str(round_no)})
        self._save_state()
        pending = {
            "round": round_no,
            "lease_id": lease["lease_id"],
            "generation": generation,
            "tokens": result.tokens,
            "steps": result.steps,
            "consumed": self._blocks_covered(lease, result.windows),
            "loss": result.loss_mean,
            "compute_s": result.compute_s,
            "delta": str(delta_path),
        }
        self._write_pending(pending)
        outcome.checkpoint_s = time.perf_counter() - t1
        return pending

    def _adopt(self, generation: int, joined: dict) -> dict[str, torch.Tensor]:
        """Load the current global model (a joiner adopts it like everyone else)."""
        path = self.dir / "models" / f"global-{generation:06d}.safetensors"
        self.client.download_model(generation, path)
        tensors = load_file(str(path))
        if self.model is None:
            self.model = build_model(
                joined["flavour"], vocab_size=joined["vocab_size"], device=self.s.device
            )
            self.optimizer = make_optimizer(self.model, self.s.inner, lr=0.0)
            self._load_state()
        load_parameters(self.model, tensors)
        for old in path.parent.glob("global-*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
        return {k: v.to(self.s.device) for k, v in tensors.items()}

    def _lease(self, round_no: int, want: int, rtt: float) -> dict | str | None:
        """A lease, None when no data turned up in time, or "missed" when the round closed.

        A restarted job whose previous incarnation still holds a lease waits for that lease's
        TTL to return it to the pool (the crash costs exactly that lease), then leases anew.
        """
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
        self, lease: dict, beat: Heartbeat, schedule: LRSchedule, global_step: int, round_no: int
    ) -> PhaseResult:
        assert self.model is not None and self.optimizer is not None
        ranges = self._ranges(lease["blocks"])
        sizes = [stop - start for start, stop in ranges]
        started = time.perf_counter()

        def limit() -> int:
            if beat.lost is not None:
                return 0
            return sum(sizes[: beat.allowed_blocks])

        def on_step(info: StepInfo) -> None:
            beat.consumed = self._blocks_covered(lease, info.windows_done)
            beat.t_step_s = info.step_s
            if info.step % self.s.log_every == 0 or info.windows_done >= limit():
                log.info(
                    "[%s r%d] step %d (global %d) loss %.4f lr %.2e %.0f tok/s lease %d/%d blocks",
                    self.s.site,
                    round_no,
                    info.step,
                    info.global_step,
                    info.loss,
                    info.lr,
                    info.tokens / max(1e-9, time.perf_counter() - started),
                    beat.consumed,
                    beat.allowed_blocks,
                )

        result = run_inner_phase(
            self.model,
            self.optimizer,
            self.store.windows,
            ranges,
            config=self.s.inner,
            schedule=schedule,
            global_step=global_step,
            window_limit=limit,
            on_step=on_step,
            device=self.s.device,
        )
        log.info(
            "[%s r%d] trained %d steps on %d/%d windows, %d tokens in %.1fs",
            self.s.site,
            round_no,
            result.steps,
            result.windows,
            sum(sizes),
            result.tokens,
            result.compute_s,
        )
        return result

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
        if reply is not None:
            outcome.blocks_committed = pending["consumed"]
            outcome.extra["already"] = reply.get("already", False)
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


def outcome_json(outcome: RoundOutcome) -> str:
    return json.dumps(asdict(outcome), indent=2)
