"""The loop a site job runs for one outer round.

prepare (rank 0: join, adopt the global model, lease or resume) -> train H inner steps while a
heartbeat keeps the lease alive -> checkpoint (model, optimiser, cursor, delta, pending
record) -> send the delta, which commits the blocks in the same coordinator transaction.

Crash safety, in order of where a job dies:

* mid-phase: every ``checkpoint_every`` steps the model, inner AdamW state and data cursor
  are checkpointed (DCP, atomic, written in the background while the next steps train). A
  restarted job in the same round whose lease is still alive continues it from the cursor:
  no window is retrained or skipped. If the lease has expired its blocks went back to the
  pool, so the checkpoint's weights and cursor are dropped and the job leases anew.
* after the end of the phase: the end-of-phase checkpoint is written in the background while
  the delta is (the state copied first, as mid-phase), and published before the delta's
  pending record is written; from then on a restarted job sends the delta (again: the
  coordinator answers idempotently per lease) without training the phase again. With
  overlapped rounds it sends it in the background (or, already answered, only waits for the
  round's merge) and trains the next round's early lease meanwhile from that checkpoint's
  weights, as the killed job would have (``_go_ahead``).

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
coordinator (:class:`crossfed.site.control.Control`) and broadcasts the round's start, the
lease and every step's window limit.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from crossfed import moments, rowcounts
from crossfed.client.http import CoordinatorClient, Refused, Unreachable
from crossfed.coordinator.faults import crash_armed, crash_point
from crossfed.darl.blockspace import BlockSpace
from crossfed.darl.leases import lease_blocks
from crossfed.data.windows import WindowStore
from crossfed.fileio import write_atomic
from crossfed.progress import CONSOLE, site_prefix, step_line
from crossfed.site.control import Control, EarlyAsk, FollowerBeat, Heartbeat, RoundClosed
from crossfed.site.inflight import InFlight
from crossfed.site.keepalive import LeaseKeeper
from crossfed.site.lock import hold_site_folder
from crossfed.site.records import (
    Cursor,
    PendingDelta,
    RoundOutcome,
    RoundStart,
    SiteSettings,
)
from crossfed.train import checkpoint
from crossfed.train.distributed import (
    DistributedError,
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
    LeaseWindows,
    PhaseResult,
    PhaseState,
    StepInfo,
    Trainer,
    make_optimizer,
    run_inner_phase,
)
from crossfed.train.model import build_model, flops_per_token, parameters_of
from crossfed.train.overlap import MergeWaits, StaleBudget, fold_in
from crossfed.train.schedule import LRSchedule, round_steps
from crossfed.wire.codecs import save_delta
from crossfed.wire.tensors import open_tensors

log = logging.getLogger("crossfed.site")

Beat = Heartbeat | FollowerBeat


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
        self.control: Control | None = None
        if self.ranks.main:  # a second job of this site waits for this one to end
            assert client is not None
            hold_site_folder(self.dir)
            self.control = Control(client, settings, self.space, self.dir)
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.flops_per_token: float | None = None
        self._restored = False
        self._saving: checkpoint.BackgroundSave | None = None  # a checkpoint being written
        # overlapped rounds: the round in flight (rank 0), the weights its delta was made
        # from (every rank), the outcomes its sends came to, the last phase's start
        self._inflight: InFlight | None = None
        self._sent: dict[str, torch.Tensor] | None = None
        #: the end-of-phase checkpoint holding ``_sent`` (its folder's name): an early phase's
        #: mid-phase checkpoints name it, so a job killed before the fold-in can fold in
        self._sent_checkpoint: str | None = None
        self._settled: list[RoundOutcome] = []
        #: called (from the sending thread) with each background send's outcome as soon as
        #: the coordinator answers it; unset, ``settled()`` hands the outcomes over
        self.on_settled: Callable[[RoundOutcome], None] | None = None
        self.chained = False
        self._merge_waits = MergeWaits(settings.overlap.max_stale)  # long ones: said once
        #: how far the next early phase may train before it waits for the merge
        self._stale_budget = StaleBudget(settings.overlap.max_stale, settings.overlap.stale_burst)
        #: the last round the driving loop trains (None: the run's last)
        self.through_round: int | None = None
        self._last_start: RoundStart | None = None
        #: the run's H per round (the coordinator's ``inner_schedule``), from the last join
        self._inner_schedule: dict[str, int] = {}
        #: the next round's early lease asked during a phase's last step, and the heartbeat
        #: of one granted, kept running for the phase that trains it (rank 0)
        self._ask: EarlyAsk | None = None
        self._early_beat: Heartbeat | None = None
        #: phases that trained a lease asked during the phase before (no wait for it)
        self.early_asks_taken = 0
        #: the accumulation the latest plan gives (None: the settings'), rank 0
        self._plan_a: int | None = None
        #: rank 0 of a restarted job: the checkpoint the next round's early phase starts
        #: from (the end of the killed job's phase, whose round is in flight again) or goes
        #: on from (the killed job's early phase), ``_go_ahead``
        self._restart_base: Cursor | None = None
        #: rank 0: what kept the site's leases beating while this job started
        #: (crossfed.site.keepalive), stopped before the runner's first request
        self.keeper: LeaseKeeper | None = None

    @property
    def overlapped(self) -> bool:
        """Whether rounds overlap: run_round returns once the delta's send has started. Only
        for a driver that trains the next round at once and takes the outcomes as they come
        (``chained``: the site loop sets it); one round on its own is sent before it returns."""
        return self.s.overlap.enabled and self.chained

    @property
    def in_flight(self) -> bool:
        """Whether a round's delta is being sent or merged (rank 0): the next round's phase
        may start now, on an early lease."""
        return self._inflight is not None

    @property
    def pending_path(self) -> Path:
        return self.dir / "pending.json"

    # ---------------------------------------------------------------- one round
    def run_round(self, round_no: int, accumulation: int | None = None) -> RoundOutcome:
        """Train one round; every rank calls this, rank 0's outcome is the one to report.

        ``accumulation`` (rank 0's, from the round's plan) replaces the settings' A for this
        round and the ones after it; a phase resumed from its checkpoint keeps the A it began
        with, and one on an early lease asked before the plan came the A it was asked at (the
        plan's A then from the next round on).
        """
        if self.ranks.main:
            self._plan_a = int(accumulation) if accumulation else self._plan_a
            if self._plan_a:
                self._use_accumulation(self._plan_a)
        start = self._prepare_round(round_no) if self.ranks.main else None
        start = broadcast_object(start, self.ranks)
        if isinstance(start, RoundOutcome):
            return start
        assert isinstance(start, RoundStart)
        self._use_accumulation(start.accumulation)
        self._last_start = start
        return self._run_phase(round_no, start)

    def settled(self) -> list[RoundOutcome]:
        """Outcomes of rounds whose delta was sent in the background since the last call
        (none when ``on_settled`` takes them)."""
        out, self._settled = self._settled, []
        return out

    def finish(self) -> list[RoundOutcome]:
        """The job ends: wait for the send in flight (not for its merge); every outcome left.
        An early lease asked for a phase that will not run goes back to the pool."""
        self.stop_keeper()
        if self._ask is not None:
            self._ask.drop()
            self._ask = None
        if self._inflight is not None:
            self._inflight.stop()
            self._inflight.wait_sent()
            self._inflight = None
        return self.settled()

    def leased_ahead(self) -> int | None:
        """Rank 0: the round of the early lease asked during the last phase's last step, once
        it is granted (None: none asked, or none given). The chain then knows the round it
        trains next without asking the coordinator's status (a round trip a phase change)."""
        ask = self._ask
        return ask.round_no if ask is not None and ask.granted_lease() else None

    def stop_keeper(self) -> None:
        """The runner takes the site's leases on from here (or lets them go)."""
        keeper, self.keeper = self.keeper, None
        if keeper is not None:
            keeper.stop()

    def _send_answered(self, outcome: RoundOutcome) -> None:
        """A background send was answered (the sending thread calls this)."""
        if self.on_settled is not None:
            self.on_settled(outcome)
        else:
            self._settled.append(outcome)

    def _settle_inflight(self) -> InFlight | None:
        """Rank 0: wait for the round in flight to be merged and its model to arrive."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return None
        inflight.wait_arrived()
        inflight.wait_sent()
        return inflight

    def _prepare_round(self, round_no: int) -> RoundOutcome | RoundStart:
        """Rank 0: an early lease while the previous round is in flight, else the round's
        ordinary start (once the previous round's merged model is here)."""
        self.stop_keeper()
        inflight = self._inflight
        ask, self._ask = self._ask, None
        base, self._restart_base = self._restart_base, None
        if inflight is not None and not inflight.arrived.is_set():
            early = self._prepare_early(round_no, inflight, ask, base)
            if early is not None:
                return early
        elif ask is not None:  # the merged model is here: the round starts ordinarily
            ask.drop()
        self._settle_inflight()
        return self._prepare(round_no)

    def _prepare_early(
        self, round_no: int, inflight: InFlight, ask: EarlyAsk | None, base: Cursor | None
    ) -> RoundStart | None:
        """Rank 0: lease the next round while the previous one is merged (None: no lease
        now, so the phase waits for the merge). The phase trains from the site's own weights,
        from the global step the coordinator forecasts; its generation, reference model and
        exact global step are known once the merge arrives. ``ask``: the lease asked during
        the last phase's last step, taken if it was granted (else asked now); ``base``: a
        restarted job's (``_go_ahead``), the checkpoint its first phase starts or goes on
        from."""
        prev = self._last_start
        assert self.control is not None
        own = self._sent is not None or base is not None
        usable = prev is not None and round_no == inflight.round + 1 and own
        taken = None
        if ask is not None:
            if usable and ask.round_no == round_no:
                taken = ask.take()
            else:
                ask.drop()
        if not usable:
            return None
        assert prev is not None
        if base is not None and base.round == round_no:
            return self._resume_early(round_no, inflight, prev, base)
        accumulation = self.s.inner.accumulation
        if taken is not None:
            lease, global_step, self._early_beat = taken
            self.early_asks_taken += 1
            if ask is not None and ask.accumulation != accumulation:
                # the lease holds a phase at the A it was asked at: trained at that A, not
                # given back (the plan's A from the next round on)
                log.info(
                    "%s trains its early lease at A=%d, the A it was asked at; the plan's "
                    "A=%d from the next round", site_prefix(self.s.site, round_no),
                    ask.accumulation, accumulation,
                )  # fmt: skip
                accumulation = ask.accumulation
        else:
            granted = self.control.early_lease(round_no, self._lease_want(round_no), prev.rtt_ms)
            if granted is None:
                return None
            lease, global_step = granted
        want = self._lease_want(round_no, accumulation)
        log.info(
            "%s early lease %d: %d blocks (asked %d) while round %d is merged",
            site_prefix(self.s.site, round_no), lease["lease_id"], lease["n_blocks"], want,
            inflight.round,
        )  # fmt: skip
        return replace(
            prev, generation=-1, global_step=global_step, lease=lease,
            model_path="", cursor=None, download_s=0.0, accumulation=accumulation,
            early=True, sent_from=base,
        )  # fmt: skip

    def _resume_early(
        self, round_no: int, inflight: InFlight, prev: RoundStart, cursor: Cursor
    ) -> RoundStart | None:
        """Rank 0 of a restarted job: go on with the killed job's early phase from its
        mid-phase checkpoint while the round it waits for is merged (its fold-in comes when
        the merged model arrives); None when the checkpoint's lease is gone (the phase then
        waits for the merge, and the round starts as without overlap)."""
        assert self.control is not None
        lease = self.control.confirm(cursor, self.control.client.status())
        if lease is None:
            return None
        log.info(
            "%s resuming the early phase of lease %d at window %d while round %d is merged",
            site_prefix(self.s.site, round_no), cursor.lease_id, cursor.phase.windows,
            inflight.round,
        )  # fmt: skip
        return replace(
            prev, generation=-1, global_step=cursor.global_step, lease=lease, model_path="",
            cursor=cursor, download_s=0.0,
            accumulation=cursor.accumulation or self.s.inner.accumulation, early=True,
        )  # fmt: skip

    def _lease_want(self, round_no: int, accumulation: int | None = None) -> int:
        """The blocks of one phase of round ``round_no`` (its H: the run's, or the early
        rounds') at this shape, or at ``accumulation``."""
        inner = self.s.inner
        return lease_blocks(
            round_steps(self._inner_schedule, round_no), inner.micro_batch, inner.ranks,
            accumulation or inner.accumulation, self.s.block_size,
        )  # fmt: skip

    def _ask_early(self, round_no: int, start: RoundStart, windows_left: int) -> None:
        """Rank 0, after each step: once the next step is the phase's last, ask the next
        round's early lease in the background (overlapped rounds; not after the run's last
        round, nor in a job about to stop for its walltime)."""
        last = min((r for r in (self.s.rounds, self.through_round) if r), default=None)
        if (
            self._ask is not None
            or self.control is None
            or not self.overlapped
            or windows_left > self.s.inner.windows_per_step
            or (last is not None and round_no >= last)
            or out_of_time(self.s.stop_training_at, 60.0)
        ):
            return
        accumulation = self._plan_a or self.s.inner.accumulation  # the plan's, not the phase's
        self._ask = EarlyAsk(
            self.control, round_no + 1, self._lease_want(round_no + 1, accumulation),
            start.rtt_ms, accumulation,
        )  # fmt: skip

    def _use_accumulation(self, accumulation: int) -> None:
        if accumulation != self.s.inner.accumulation:
            self.s = replace(self.s, inner=replace(self.s.inner, accumulation=accumulation))

    def _as_accepted(self, outcome: RoundOutcome) -> None:
        """Fill ``outcome``, a round whose delta a killed job sent, with what the coordinator
        accepted of it (tokens, steps, blocks, loss, compute seconds): the killed job may have
        died before it recorded the round, and its record is the round's in the metrics.
        Left as it is when the coordinator cannot say."""
        assert self.control is not None
        try:
            info = self.control.client.round_info(outcome.round)
        except (Refused, Unreachable):
            return
        for delta in info.get("deltas", []):
            if delta["site"] == self.s.site:  # one delta a site and round
                outcome.tokens, outcome.steps = int(delta["tokens"]), int(delta["steps"])
                outcome.blocks_committed = int(delta["consumed"])
                outcome.loss_mean = outcome.loss_last = delta["loss"]
                outcome.compute_s = float(delta["compute_s"] or 0.0)

    def _prepare(self, round_no: int) -> RoundOutcome | RoundStart:
        """Rank 0: join, resend a checkpointed delta, adopt the global model, lease or resume."""
        control = self.control
        assert control is not None
        joined, rtt = control.join(round_no)
        # a coordinator from before early rounds says only the run's H
        self._inner_schedule = joined.get("inner_schedule") or {"steps": int(joined["inner_steps"])}
        resumed = self._resume_pending(round_no, joined, rtt)
        if resumed is not None:
            return resumed
        if joined["round"] != round_no:
            detail = f"round {round_no} closed; coordinator is at round {joined['round']}"
            return RoundOutcome(self.s.site, round_no, "missed", rtt_ms=rtt, detail=detail)
        generation = joined["generation"]
        t0 = time.perf_counter()
        model_path = control.download(generation, joined.get("model"))
        download_s = time.perf_counter() - t0
        cursor, lease = self._resumable(round_no, generation, joined)
        if cursor is not None and cursor.accumulation:
            self._use_accumulation(cursor.accumulation)  # the phase's own A
        want = self._lease_want(round_no)
        if lease is None:
            try:
                lease = control.lease(round_no, want, rtt)
            except RoundClosed as exc:
                detail = f"round {round_no} closed before this job could lease ({exc.code})"
                missed = RoundOutcome(
                    self.s.site, round_no, "missed", generation=generation, rtt_ms=rtt,
                    detail=detail,
                )  # fmt: skip
                if exc.code == "already_contributed":  # a killed job's delta of it is in
                    held = RoundOutcome(
                        self.s.site, round_no, "accepted", generation=generation, rtt_ms=rtt,
                        detail="its delta, a previous job's, was accepted before this job",
                    )  # fmt: skip
                    held.extra["already"] = True  # as a resend the coordinator held already
                    self._as_accepted(held)
                    ahead = self._go_ahead(None, held, joined, rtt)
                    if ahead is not None:
                        return ahead
                return missed
        if lease is None:
            detail = "no blocks to lease or steal before the round closed"
            return RoundOutcome(
                self.s.site, round_no, "no_data", generation=generation, rtt_ms=rtt, detail=detail
            )
        log.info(
            "%s lease %d: %d blocks (asked %d), generation %d, global step %d%s",
            site_prefix(self.s.site, round_no), lease["lease_id"], lease["n_blocks"], want,
            generation, joined["global_step"],
            f", resuming at window {cursor.phase.windows}" if cursor else "",
        )  # fmt: skip
        folds = cursor is not None and cursor.before_fold_in  # it takes the round's step
        return RoundStart(
            generation=generation,
            global_step=cursor.global_step if cursor and not folds else joined["global_step"],
            schedule=joined["schedule"],
            flavour=joined["flavour"],
            vocab_size=joined["vocab_size"],
            lease=lease,
            model_path=str(model_path),
            cursor=cursor,
            download_s=download_s,
            rtt_ms=rtt,
            accumulation=self.s.inner.accumulation,
        )

    def _resumable(
        self, round_no: int, generation: int, joined: dict
    ) -> tuple[Cursor | None, dict | None]:
        """A checkpoint this job can continue: same round and generation, and the lease it
        trained is still alive (a heartbeat confirms it). A "done" one (killed between the
        end-of-phase checkpoint and the delta) trains nothing more and goes on to the delta.
        Otherwise the checkpoint's weights and cursor are dropped (its blocks return to the
        pool on the lease's TTL)."""
        found = checkpoint.latest(self.state_dir)
        if found is None or found.get("status") not in ("training", "done"):
            return None, None
        cursor = Cursor.from_dict(found)
        early = self._early_resumable(cursor, round_no)
        if cursor.round != round_no or (cursor.generation != generation and not early):
            if cursor.status == "training" and cursor.round <= round_no:
                log.info(
                    "%s dropping the mid-phase checkpoint of round %d (now round %d)",
                    site_prefix(self.s.site), cursor.round, round_no,
                )  # fmt: skip
            return None, None
        assert self.control is not None
        lease = self.control.confirm(cursor, joined)
        if lease is not None and early:
            log.info(
                "%s resuming the early phase of lease %d at window %d: folding in generation %d",
                site_prefix(self.s.site, round_no), cursor.lease_id, cursor.phase.windows,
                generation,
            )  # fmt: skip
        return (cursor, lease) if lease is not None else (None, None)

    def _early_resumable(self, cursor: Cursor, round_no: int) -> bool:
        """Whether ``cursor`` is a mid-phase checkpoint of an early phase of ``round_no``
        (trained from the site's own weights, killed before its fold-in) whose fold-in
        weights are still on disk: the open round's generation is the merged model that
        phase was waiting for, so the job folds it in and goes on."""
        return (
            cursor.round == round_no
            and cursor.status == "training"
            and cursor.before_fold_in
            and bool(cursor.folds_from)
            and (self.state_dir / str(cursor.folds_from)).is_dir()
        )

    def _resume_pending(
        self, round_no: int, joined: dict[str, Any], rtt: float
    ) -> RoundOutcome | None:
        """A checkpointed but unsent delta from a killed job: send it again (idempotent).
        Of the open round, with overlapped rounds: in the background (``_go_ahead``)."""
        if not self.pending_path.exists():
            return None
        pending = PendingDelta.from_json(self.pending_path.read_text())
        if not Path(pending.delta).exists():
            self.pending_path.unlink()
            return None
        log.info(
            "%s resending checkpointed delta of round %d (lease %d)",
            site_prefix(self.s.site), pending.round, pending.lease_id,
        )  # fmt: skip
        outcome = RoundOutcome(
            self.s.site, pending.round, "accepted", generation=pending.generation,
            lease_id=pending.lease_id, steps=pending.steps, tokens=pending.tokens,
            loss_mean=pending.loss, compute_s=pending.compute_s,
        )  # fmt: skip
        outcome.extra["resumed"] = True
        assert self.control is not None
        # its lease beats while the delta goes up again, as a sending job's does, from now:
        # the killed job's beat stopped with it, and the lease's TTL may be near its end
        lease = {"lease_id": pending.lease_id, "n_blocks": pending.consumed}
        beat = self.control.heartbeat(lease, at_once=True)
        beat.consumed = pending.consumed
        beat.__enter__()
        if pending.round == round_no:
            ahead = self._go_ahead(pending, outcome, joined, rtt, beat)
            if ahead is not None:
                return ahead
        try:
            outcome = self._send(pending, outcome, fresh=False)
        finally:
            beat.stop(wait=False)
        return outcome if pending.round == round_no else None

    def _go_ahead(
        self,
        pending: PendingDelta | None,
        outcome: RoundOutcome,
        joined: dict[str, Any],
        rtt: float,
        beat: Heartbeat | None = None,
    ) -> RoundOutcome | None:
        """Rank 0 of a restarted job (overlapped rounds) whose killed job ended the open
        round's phase: its delta, ``pending`` (None: the coordinator holds it already), is
        resent in the background as this job's round in flight (``beat`` keeping its lease
        alive until it is answered), and the next round's phase starts at once instead of
        after the round closes, as the killed job's did: from the
        weights that delta was made from (the newest checkpoint is the phase's end), or on
        from the killed job's early phase (the newest is a mid-phase checkpoint of it, before
        its fold-in). Either folds the merged model in when it arrives. Returns the round's
        outcome as "sending"; None when the newest checkpoint is neither, and the round goes
        on as without overlap."""
        assert self.control is not None
        found = checkpoint.latest(self.state_dir) if self.overlapped else None
        base = Cursor.from_dict(found) if found is not None else None
        if base is None:
            return None
        early = self._early_resumable(base, outcome.round + 1)
        ended = (base.status, base.round) == ("done", outcome.round) and (
            pending is None or pending.lease_id == base.lease_id
        )
        if not (early or ended):
            return None
        self._inflight = InFlight(
            self.control, pending, outcome, beat, self.state_dir, fresh=False,
            on_sent=self._send_answered,
        )  # fmt: skip
        self._restart_base = base
        self._last_start = RoundStart(
            generation=base.generation, global_step=int(joined["global_step"]),
            schedule=joined["schedule"], flavour=joined["flavour"],
            vocab_size=joined["vocab_size"],
            lease={"lease_id": base.lease_id, "n_blocks": len(base.blocks),
                   "blocks": list(base.blocks), "round": base.round},
            model_path="", cursor=None, download_s=0.0, rtt_ms=rtt,
            accumulation=base.accumulation or self.s.inner.accumulation,
        )  # fmt: skip
        return replace(outcome, status="sending")

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

    def _restore_sent(self, done: Cursor) -> None:
        """A restarted job's first early phase (``RoundStart.sent_from``): every rank takes
        the weights and optimiser state of the end-of-phase checkpoint its resent delta was
        made from; those weights are also what the phase folds from."""
        assert self.model is not None and self.optimizer is not None
        checkpoint.load(done.to_dict(), self.model, self.optimizer, weights=True)
        self._restored = True
        self._sent = full_parameters(self.model)
        self._sent_checkpoint = checkpoint.path_of(self.state_dir, done.to_dict()).name
        if self.ranks.main:
            log.info(
                "%s the early phase starts from %s, the weights of round %d's delta",
                site_prefix(self.s.site), self._sent_checkpoint, done.round,
            )  # fmt: skip

    def _restore(self, cursor: Cursor | None) -> None:
        """Resuming ``cursor``: its weights and optimiser state. A fresh process: the inner
        optimiser state of the newest checkpoint (kept across rounds, as DiLoCo does)."""
        assert self.model is not None and self.optimizer is not None
        if cursor is not None:
            checkpoint.load(cursor.to_dict(), self.model, self.optimizer, weights=True)
        elif not self._restored:
            newest = checkpoint.latest(self.state_dir)
            if newest is not None:
                checkpoint.load(newest, self.model, self.optimizer, weights=False)
        self._restored = True

    def _keep_sent(self, cursor: Cursor) -> None:
        """An early phase resumed before its merge arrived (its cursor's weights restored):
        every rank reads the weights the killed job sent its last delta from (the checkpoint
        the cursor ``folds_from``), for the fold-in to come."""
        assert self.model is not None
        theta = full_parameters(self.model)
        checkpoint.load_weights(self.state_dir / str(cursor.folds_from), self.model)
        self._sent = full_parameters(self.model)
        self._sent_checkpoint = cursor.folds_from
        load_full_parameters(self.model, theta)
        del theta

    def _fold_on_resume(self, start: RoundStart) -> dict[str, torch.Tensor]:
        """A resumed early phase (its cursor's weights restored): fold in the merged model as
        the killed job would have, from the weights it sent its last delta from (read from
        the checkpoint its cursor ``folds_from``). Collective; returns the merged moments."""
        assert self.model is not None and start.cursor is not None
        theta = full_parameters(self.model)
        checkpoint.load_weights(self.state_dir / str(start.cursor.folds_from), self.model)
        sent = full_parameters(self.model)
        tensors = load_file(start.model_path)
        folded = fold_in(theta, sent, moments.without_moments(tensors), self.s.overlap)
        load_full_parameters(self.model, folded)
        del theta, sent, folded
        return moments.only_moments(tensors)

    def adopt_moments(self, merged: dict[str, torch.Tensor]) -> None:
        """Rescale the AdamW second moment to the merged factors a global model carries
        (``inner.second_moment: shared``; none: nothing to do). Collective."""
        if merged:
            assert self.model is not None and self.optimizer is not None
            changed = moments.adopt(parameters_of(self.model), self.optimizer, merged)
            log.debug("%s adopted the merged second moment of %d tensors",
                      site_prefix(self.s.site), changed)  # fmt: skip

    def _run_phase(self, round_no: int, start: RoundStart) -> RoundOutcome:
        """Train the lease, then checkpoint and send (rank 0) what was trained."""
        self._ensure_model(start.flavour, start.vocab_size)
        assert self.model is not None
        merged_moments: dict[str, torch.Tensor] = {}
        if start.cursor is None and not start.early:
            tensors = load_file(start.model_path)
            load_full_parameters(self.model, moments.without_moments(tensors))
            merged_moments = moments.only_moments(tensors)
            del tensors
        if start.sent_from is not None:
            self._restore_sent(start.sent_from)
        self._restore(start.cursor)
        state = start.cursor.phase if start.cursor else PhaseState()
        if start.cursor is not None and start.cursor.before_fold_in:
            if start.early:  # resumed before the merge: it is folded in when it arrives
                self._keep_sent(start.cursor)
            else:
                merged_moments = self._fold_on_resume(start)
                state.counted_from = state.windows
        self.adopt_moments(merged_moments)  # after the optimiser state is restored
        resumed_at = state.windows
        beat: Beat
        early_beat, self._early_beat = self._early_beat, None
        if self.control is None:
            beat = FollowerBeat(start.lease)
        elif early_beat is not None and early_beat.lease_id == start.lease["lease_id"]:
            beat = early_beat  # asked during the last phase: beating since its grant
        else:
            beat = self.control.heartbeat(start.lease)
        beat.consumed = max(beat.consumed, start.lease.get("consumed", 0))
        fold = _Fold(self, start)
        handed_over = False  # the heartbeat runs until the delta is in: a commit needs a live
        beat.__enter__()  # lease; with overlap the send (and its beat) go on in the background
        try:
            state = self._train(round_no, fold, state, beat)
            start = fold.finish(state)
            self._stale_budget.spend(fold.stale_share(state.steps))
            outcome = self._outcome(round_no, start, state)
            fold.account(outcome)
            if self.ranks.main:  # rank 0 alone waits for the merge
                advice = self._merge_waits.advice(outcome.merge_wait_s, outcome.compute_s)
                if advice:
                    log.warning("%s %s", site_prefix(self.s.site, round_no), advice)
            if resumed_at:
                outcome.extra["resumed_at_window"] = resumed_at
            lost = broadcast_object(beat.lost, self.ranks)
            # rank 0 alone knows the walltime (Slurm's end time): its verdict holds for all
            timed_out = broadcast_object(
                state.stopped_early and out_of_time(self.s.stop_training_at, None), self.ranks
            )
            if lost is None and state.steps == 0 and timed_out:
                if self.control:  # nothing trained: its blocks go back to the pool now
                    self.control.release(start.lease_id)
                outcome.status, outcome.detail = "walltime", "the walltime came before a step"
                return outcome
            if lost is not None or state.steps == 0:
                outcome.status, outcome.detail = "lease_lost", lost or "lease empty"
                return outcome
            if timed_out:
                outcome.detail = f"stopped for the walltime after {outcome.windows} windows"
            pending = self._checkpoint(round_no, start, state, outcome)
            if pending is None:  # not rank 0
                return outcome
            if self.overlapped and isinstance(beat, Heartbeat):
                assert self.control is not None
                self._inflight = InFlight(
                    self.control,
                    pending,
                    outcome,
                    beat,
                    self.state_dir,
                    on_sent=self._send_answered,
                )
                handed_over = True
                return replace(outcome, status="sending")
            outcome = self._send(pending, outcome, fresh=True)
            outcome.comms_exposed_s = outcome.download_s + outcome.upload_s
            return outcome
        finally:
            if not handed_over:
                beat.__exit__(None, None, None)
            self._saved()  # every rank: a phase ends with its checkpoints written

    def _outcome(self, round_no: int, start: RoundStart, state: PhaseState) -> RoundOutcome:
        """The round's outcome as trained (accepted until the send says otherwise)."""
        result = PhaseResult.of(state)
        tokens_per_s = state.tokens / state.compute_s if state.compute_s else 0.0
        return RoundOutcome(
            self.s.site, round_no, "accepted", generation=start.generation,
            lease_id=start.lease_id, blocks_leased=start.lease["n_blocks"], steps=state.steps,
            tokens=state.tokens, windows=state.windows, loss_mean=result.loss_mean,
            loss_last=result.loss_last, compute_s=state.compute_s, download_s=start.download_s,
            step_s=result.step_s, rtt_ms=start.rtt_ms, tokens_per_s=tokens_per_s,
            accumulation=self.s.inner.accumulation, ranks=self.s.inner.ranks,
            micro_batch=self.s.inner.micro_batch, launcher=self.s.launcher,
            mfu=mfu(tokens_per_s, self.flops_per_token, self.device, self.ranks.world),
        )  # fmt: skip

    def _cursor(self, round_no: int, start: RoundStart, state: PhaseState, status: str) -> Cursor:
        return Cursor(
            round=round_no, status=status, lease_id=start.lease_id,
            blocks=list(start.lease["blocks"]), generation=start.generation,
            global_step=start.global_step, site=self.s.site,
            accumulation=self.s.inner.accumulation, phase=state,
            folds_from=self._sent_checkpoint if start.early else None,
        )  # fmt: skip

    def _write_checkpoint(self, cursor: Cursor) -> None:
        """A checkpoint (mid-phase, or the phase's end): the state is copied and training,
        or the delta's writing and sending, go on while it is written (the one before it
        published first). With ``checkpoint_background`` off, written before returning."""
        assert self.model is not None and self.optimizer is not None
        self._saved()
        args = (self.state_dir, self.model, self.optimizer, cursor.to_dict(), self.ranks)
        if self.s.checkpoint_background:
            self._saving = checkpoint.save_in_background(*args)
        else:
            checkpoint.save(*args)

    def _saved(self) -> None:
        """Wait for the checkpoint being written in the background, if any, to be published."""
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.wait()

    def _checkpoint(
        self, round_no: int, start: RoundStart, state: PhaseState, outcome: RoundOutcome
    ) -> PendingDelta | None:
        """Model, optimiser and cursor (DCP, written in the background while the delta is),
        then the pending record: all before the commit. Collective; rank 0 returns the
        pending record."""
        assert self.model is not None
        t1 = time.perf_counter()
        params = full_parameters(self.model)
        assert self.optimizer is not None  # the factors travel with the delta (collective)
        factors = moments.state_factors(parameters_of(self.model), self.optimizer)
        done = self._cursor(round_no, start, state, "done")
        self._write_checkpoint(done)
        pending = None
        if self.ranks.main:
            delta_path = self.dir / f"delta-r{round_no:05d}.safetensors"
            residual_path = None
            with ExitStack() as files:  # the reference and the residual: tensor by tensor
                reference = files.enter_context(open_tensors(Path(start.model_path)))
                carried = None
                if self.s.error_feedback:
                    residual_path = self.dir / f"residual-r{round_no:05d}.safetensors"
                    path, decision = checkpoint.carried_residual(self.state_dir, start.generation)
                    outcome.extra["residual"] = decision
                    if path is not None:
                        carried = files.enter_context(open_tensors(path))
                key = save_delta(
                    params, reference, delta_path, {"site": self.s.site, "round": str(round_no)},
                    codec=self.s.compress, residual_in=carried, residual_out=residual_path,
                    residual_metadata=checkpoint.residual_metadata(round_no, start.generation),
                    extra={**factors, **self._row_counts(start, state)},
                )  # fmt: skip
            pending = PendingDelta(
                round=round_no, lease_id=start.lease_id, generation=start.generation,
                tokens=state.tokens, steps=state.steps,
                consumed=self._blocks_covered(start.lease, state.windows),
                loss=PhaseResult.of(state).loss_mean, compute_s=state.compute_s,
                delta=str(delta_path), key=key,
                residual=str(residual_path) if residual_path else None,
                idle_s=outcome.merge_wait_s,
            )  # fmt: skip
            self._saved()  # published before the delta's record: a job killed from here on
            self._write_pending(pending)  # sends the delta without training the phase again
        self._sent = params if self.overlapped else None  # what the next phase folds from
        self._sent_checkpoint = (
            checkpoint.path_of(self.state_dir, done.to_dict()).name if self.overlapped else None
        )
        del params
        outcome.checkpoint_s = state.checkpoint_s + time.perf_counter() - t1
        return pending

    def _row_counts(self, start: RoundStart, state: PhaseState) -> dict[str, torch.Tensor]:
        """How often each token was an input of the windows the phase trained after its
        fold-in (all of them in a phase without one), for the coordinator to weight the
        embedding's rows by (:mod:`crossfed.rowcounts`; every rank's windows, read again
        from the store a block at a time)."""
        assert self.model is not None
        embedding = parameters_of(self.model).get(rowcounts.EMBEDDING)
        if embedding is None:
            return {}
        vocab = embedding.shape[0]
        total = torch.zeros(vocab)
        windows = LeaseWindows.of(self._ranges(start.lease["blocks"]))
        for begin, stop in windows.spans(state.counted_from, state.windows):
            total += rowcounts.token_counts(self.store.windows(begin, stop), vocab)
        return {rowcounts.count_key(rowcounts.EMBEDDING): total}

    def _write_pending(self, pending: PendingDelta) -> None:
        write_atomic(self.pending_path, pending.to_json())

    def _send(self, pending: PendingDelta, outcome: RoundOutcome, *, fresh: bool) -> RoundOutcome:
        """Send the checkpointed delta (rank 0): crossfed.site.control.Control.send."""
        assert self.control is not None
        return self.control.send(pending, outcome, self.state_dir, fresh=fresh)

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

    def _train(self, round_no: int, fold: _Fold, state: PhaseState, beat: Beat) -> PhaseState:
        """The inner phase on the lease's windows: each step's window limit follows the lease
        (steals shrink it) and the walltime; progress lines and mid-phase checkpoints; the
        merged model folded in between steps when it arrives (an early lease)."""
        assert self.model is not None and self.optimizer is not None
        start = fold.start
        windows = LeaseWindows.of(self._ranges(start.lease["blocks"]))
        sizes = [stop - begin for begin, stop in windows.ranges]
        trainer = Trainer(
            self.model, self.optimizer, self.s.inner, device=self.device, rank=self.ranks.rank,
            world=self.ranks.world, autocast=uses_autocast(self.device, self.ranks),
            reduce_loss=lambda loss: sum_over_ranks(loss, self.ranks),
        )  # fmt: skip
        progress = _Progress(self, round_no, state.tokens, len(windows), start.lease)
        fold.limit(progress.steps)
        done = [state.windows]
        timed = [0, 0.0]  # this job's steps of the phase and their compute seconds

        def limit() -> int:
            allowed = 0 if beat.lost is not None else sum(sizes[: beat.allowed_blocks])
            if out_of_time(self.s.stop_training_at, beat.t_step_s):
                allowed = min(allowed, block_end(sizes, done[0]))
            return broadcast_int(allowed, self.ranks)

        def on_step(info: StepInfo) -> None:
            crash_point("site_after_step", f"{self.s.site}:{round_no}")  # tests only
            done[0] = info.windows_done
            beat.consumed = max(beat.consumed, self._blocks_covered(start.lease, done[0]))
            timed[0], timed[1] = timed[0] + 1, timed[1] + info.step_s
            beat.t_step_s = timed[1] / timed[0]  # the mean: grants are sized by it
            progress.step(info, beat)
            if self.ranks.main:
                self._ask_early(round_no, fold.start, len(windows) - info.windows_done)

        state = run_inner_phase(
            trainer, self.store.windows, windows, schedule=fold.schedule,
            global_step=start.global_step, state=state, window_limit=limit, on_step=on_step,
            checkpoint=lambda s: self._write_checkpoint(
                self._cursor(round_no, fold.start, s, "training")
            ),
            checkpoint_every=self.s.checkpoint_every,
            before_step=fold.between_steps if start.early else None,
        )  # fmt: skip
        if self.ranks.main:
            log.info(
                "%s trained %d steps on %d/%d windows, %d tokens in %.1fs",
                site_prefix(self.s.site, round_no), state.steps, state.windows, len(windows),
                state.tokens, state.compute_s,
            )  # fmt: skip
        return state


class _Fold:
    """One phase's start, and (on an early lease) the fold-in of the merged model.

    An early phase starts from the site's own weights. Between steps rank 0 checks whether
    the merged model of the previous round has arrived, and tells every rank; they then fold
    it in (crossfed.train.overlap) and the phase's generation, reference model and global
    step become the merged ones, so its delta is measured against them. No more of the
    phase's steps run before the fold-in than the site's stale budget allows
    (``overlap.max_stale``, and up to ``overlap.stale_burst`` more out of what earlier
    phases left unused): if the merged model has not arrived by then (or by the phase's
    end), the phase waits for it (idle), folds it in and goes on.
    """

    def __init__(self, runner: SiteRunner, start: RoundStart) -> None:
        self.r, self.start = runner, start
        self.schedule = _ShiftedSchedule(LRSchedule(**start.schedule))
        self.step: int | None = None  # the phase's step at which it folded (0: before any)
        self.stale_steps: int | None = None  # steps allowed before the fold-in (None: all)
        self.phase_steps = 0
        self.wait_s = 0.0
        self.download_s = 0.0

    def limit(self, phase_steps: int) -> None:
        """The phase has ``phase_steps`` steps: at most the share the site's stale budget
        allows (``max_stale``, more when earlier phases folded sooner) before it folds."""
        self.phase_steps = phase_steps
        share = self.r._stale_budget.allowed()
        self.stale_steps = max(1, math.ceil(share * phase_steps)) if share < 1 else None

    def stale_share(self, steps: int) -> float:
        """The share of the phase's steps taken before the fold-in (0: none, or an
        ordinary phase); ``steps``, the steps it took, when it folded at its end."""
        folded_at = self.step if self.step is not None else 0
        return min(1.0, folded_at / max(1, self.phase_steps, steps))

    def between_steps(self, state: PhaseState) -> None:
        if not self.start.early:
            return
        if self.stale_steps is not None and state.steps >= self.stale_steps:
            self._wait_and_apply(state)  # the lead is spent: wait for the merge here
            return
        inflight = self.r._inflight
        ready = inflight is not None and inflight.arrived.is_set() if self.r.ranks.main else None
        if broadcast_object(ready, self.r.ranks):
            self._apply(state)

    def finish(self, state: PhaseState) -> RoundStart:
        """The phase's start as its delta is measured: after the fold-in (waited for)."""
        if self.start.early:
            self._wait_and_apply(state)
        return self.start

    def _wait_and_apply(self, state: PhaseState) -> None:
        if crash_armed("site_awaiting_merge"):  # tests only: once its checkpoint is out
            self.r._saved()
            crash_point("site_awaiting_merge", f"{self.r.s.site}:{self.start.lease['round']}")
        if self.r.ranks.main:
            assert self.r._inflight is not None
            self.wait_s += self.r._inflight.wait_arrived()
        self._apply(state)

    def _apply(self, state: PhaseState) -> None:
        """Fold the merged model in after ``state``'s steps; the row counts start here."""
        r, steps = self.r, state.steps
        state.counted_from = state.windows
        assert r.model is not None
        info = None
        if r.ranks.main:
            inflight = r._settle_inflight()
            assert inflight is not None and inflight.merged_path is not None
            self.download_s = inflight.download_s
            info = (str(inflight.merged_path), inflight.generation, inflight.global_step)
        path, generation, global_step = broadcast_object(info, r.ranks)
        tensors = inflight.merged if r.ranks.main else load_file(path)
        assert tensors is not None
        merged = moments.without_moments(tensors)
        if steps == 0:  # arrived before the first step: the phase is an ordinary one
            load_full_parameters(r.model, merged)
        else:
            assert r._sent is not None
            theta = full_parameters(r.model)
            folded = fold_in(theta, r._sent, merged, r.s.overlap)
            crash_point("site_mid_fold", f"{r.s.site}:{self.start.lease['round']}")  # tests only
            load_full_parameters(r.model, folded)
            del theta
        r.adopt_moments(moments.only_moments(tensors))
        del tensors
        if r.ranks.main:
            inflight.merged = None
        r._sent = None
        self.schedule.shift = global_step - self.start.global_step
        self.start = replace(
            self.start, generation=generation, model_path=path, global_step=global_step,
            early=False,
        )  # fmt: skip
        self.step = steps
        log.info(
            "%s folded in generation %d at step %d (%s)",
            site_prefix(r.s.site), generation, steps, r.s.overlap.rule,
        )  # fmt: skip

    def account(self, outcome: RoundOutcome) -> None:
        """The fold-in's figures in the round's outcome."""
        if self.step is None:
            return
        outcome.fold_step = self.step or None
        outcome.merge_wait_s = self.wait_s
        exposed = min(self.download_s, self.wait_s)
        outcome.download_s = self.download_s
        outcome.comms_exposed_s = exposed
        outcome.comms_hidden_s = self.download_s - exposed


class _ShiftedSchedule:
    """An LR schedule whose step index moves when an early phase learns its global step."""

    def __init__(self, base: LRSchedule) -> None:
        self.base, self.shift = base, 0

    def lr_at(self, step: int) -> float:
        return self.base.lr_at(step + self.shift)


class _Progress:
    """A phase's progress lines (rank 0): the terminal's every ``log_every`` steps, the log's."""

    def __init__(
        self, runner: SiteRunner, round_no: int, tokens0: int, windows: int, lease: dict
    ) -> None:
        self.r, self.round_no, self.tokens0, self.windows = runner, round_no, tokens0, windows
        self.steps = -(-windows // runner.s.inner.windows_per_step)  # this phase's steps
        self.started = time.perf_counter()

    def step(self, info: StepInfo, beat: Beat) -> None:
        r = self.r
        if not r.ranks.main:
            return
        if info.step % r.s.log_every and info.windows_done < self.windows:
            return
        elapsed = max(1e-9, time.perf_counter() - self.started)
        tokens_per_s = (info.tokens - self.tokens0) / elapsed
        rate = mfu(tokens_per_s, r.flops_per_token, r.device, r.ranks.world)
        CONSOLE.info(
            step_line(
                r.s.site,
                self.round_no,
                r.s.rounds,
                info.step,
                self.steps,
                info.loss,
                tokens_per_s,
                rate,
            )  # fmt: skip
        )
        log.info(
            "%s step %d (global %d) loss %.4f lr %.2e %.0f tok/s lease %d/%d blocks",
            site_prefix(r.s.site, self.round_no), info.step, info.global_step, info.loss, info.lr,
            tokens_per_s, beat.consumed, beat.allowed_blocks,
        )  # fmt: skip


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
