"""Rank 0's traffic with the coordinator, behind one seam.

Under torchrun rank 0 alone talks to the coordinator: it joins, fetches the global model,
leases (or confirms the lease of a checkpoint it resumes), keeps the lease alive, sends the
delta or releases the lease. ``Control`` is all of that for one site; the runner calls it on
rank 0 only and broadcasts what the other ranks need. ``Heartbeat`` is the background beat
of one lease; ``FollowerBeat`` stands in for it on the other ranks.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from crossfed.backoff import Backoff
from crossfed.client.http import CoordinatorClient, Refused, Unreachable
from crossfed.darl.blockspace import BlockSpace
from crossfed.fileio import keep_global_model
from crossfed.progress import site_prefix
from crossfed.site.records import Cursor, PendingDelta, RoundOutcome, SiteSettings
from crossfed.train import checkpoint
from crossfed.wire.digests import digest_file

log = logging.getLogger("crossfed.site")
#: how long an early lease asked before the round before it opened waits for that round
OPEN_WAIT_S = 20.0
#: the names of the threads a site's Control starts begin with these: a lease's heartbeat,
#: and the next round's early lease
HEARTBEAT_THREAD, EARLY_ASK_THREAD = "heartbeat-", "early-"


class RoundClosed(Exception):
    """The round closed (or this site already contributed) before the site could lease:
    ``code`` is the coordinator's, ``round_closed`` or ``already_contributed``."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class Heartbeat:
    """Background thread: refreshes the lease, reports progress, learns of steals and expiry."""

    def __init__(
        self,
        client: CoordinatorClient,
        site: str,
        lease: dict,
        interval_s: float,
        at_once: bool = False,
    ) -> None:
        """``at_once``: the first beat goes out as the thread starts, not an interval later
        (a lease whose last beat came from a killed job may be near the end of its TTL)."""
        self.client, self.site, self.interval_s = client, site, interval_s
        self.at_once = at_once
        self.lease_id = lease["lease_id"]
        self.allowed_blocks = lease["n_blocks"]
        self.consumed = 0
        self.t_step_s: float | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"{HEARTBEAT_THREAD}{site}", daemon=True
        )

    def __enter__(self) -> Heartbeat:
        if not self._thread.is_alive() and not self._stop.is_set():  # once: a beat started
            self._thread.start()  # for an early lease is entered again by its phase
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, wait: bool = True) -> None:
        """No more beats. ``wait``: until a beat under way is answered (or 30 s); without,
        at once, for a lease that is committed or refused already, whose last beat may be
        retrying through a failing network for seconds and no longer matters (it is refused
        when it lands)."""
        self._stop.set()
        if wait:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        echo, received = None, 0.0  # the last reply's nonce, for the coordinator's RTT
        wait = 0.0 if self.at_once else self.interval_s
        while not self._stop.wait(wait):
            wait = self.interval_s
            try:
                held = time.perf_counter() - received if echo is not None else None
                reply = self.client.heartbeat(
                    self.lease_id, self.site, self.consumed, self.t_step_s, echo, held,
                    bounded=True,
                )  # fmt: skip
                echo, received = reply.get("echo"), time.perf_counter()
            except Refused as exc:
                self.lost = f"{exc.code}: {exc.detail}"
                return
            except Exception as exc:  # transient: the TTL covers a few missed beats
                log.warning("%s heartbeat failed: %s", site_prefix(self.site), exc)
                continue
            shrunk = reply["lease"]["n_blocks"]
            if shrunk < self.allowed_blocks:
                log.info(
                    "%s lease %d: %d blocks stolen",
                    site_prefix(self.site),
                    self.lease_id,
                    self.allowed_blocks - shrunk,
                )
            self.allowed_blocks = shrunk


class EarlyAsk:
    """The next round's early lease, asked in the background while a phase's last step
    trains, so that an overlapped site does not wait a round trip for it once the phase
    ends. A granted lease's heartbeat starts at once: the phase that trains it begins only
    after this phase's checkpoint, which may outlast the lease's TTL."""

    def __init__(
        self, control: Control, round_no: int, want: int, rtt: float, accumulation: int
    ) -> None:
        """``want`` blocks, a phase at ``accumulation`` (the phase that trains the lease
        keeps that A, whatever a newer plan says)."""
        self.control, self.round_no, self.want = control, round_no, want
        self.accumulation = accumulation
        self.granted: tuple[dict, int] | None = None
        self.beat: Heartbeat | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(want, rtt),
            name=f"{EARLY_ASK_THREAD}{control.site}",
            daemon=True,
        )
        self._thread.start()

    def _run(self, want: int, rtt: float) -> None:
        try:
            self.granted = self.control.early_lease(self.round_no, want, rtt)
            if self.granted is not None:
                self.beat = self.control.heartbeat(self.granted[0]).__enter__()
        except BaseException as exc:  # raised by take() in the training thread
            self.error = exc
        finally:
            self._done.set()

    def granted_lease(self) -> bool:
        """Whether the lease was granted (waits for the answer); an error is raised by
        ``take``."""
        self._done.wait()
        return self.error is None and self.granted is not None and self.beat is not None

    def take(self) -> tuple[dict, int, Heartbeat] | None:
        """The granted lease, its global step and its running heartbeat (None: no lease)."""
        self._done.wait()
        if self.error is not None:
            raise self.error
        if self.granted is None or self.beat is None:
            return None
        return self.granted[0], self.granted[1], self.beat

    def drop(self) -> None:
        """Not used after all (the phase ended otherwise, the job ends): its blocks go back
        to the pool now rather than at its TTL's end."""
        self._done.wait()
        if self.beat is not None:
            self.beat.__exit__(None, None, None)
        if self.granted is not None:
            try:
                self.control.release(self.granted[0]["lease_id"])
            except Exception as exc:  # the TTL returns them instead
                log.warning("%s releasing an unused early lease: %s",
                            site_prefix(self.control.site), exc)  # fmt: skip


class FollowerBeat:
    """Stand-in for the heartbeat on ranks other than 0 (rank 0 alone talks to the coordinator)."""

    def __init__(self, lease: dict) -> None:
        self.allowed_blocks = lease["n_blocks"]
        self.consumed = lease.get("consumed", 0)
        self.t_step_s: float | None = None
        self.lost: str | None = None

    def __enter__(self) -> FollowerBeat:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class Control:
    """One site's requests to the coordinator (rank 0), and the files they leave behind."""

    def __init__(
        self, client: CoordinatorClient, settings: SiteSettings, space: BlockSpace, folder: Path
    ) -> None:
        self.client, self.s, self.space, self.dir = client, settings, space, folder

    @property
    def site(self) -> str:
        return self.s.site

    def join(self, round_no: int) -> tuple[dict[str, Any], float]:
        """Register for ``round_no`` (the block space's digest checked): the reply and the RTT."""
        rtt = self.client.rtt_ms()
        joined = self.client.register(
            self.site, self.space.digest(), self.s.inner.ranks, rtt, round_no
        )
        return joined, rtt

    def download(self, generation: int, known: dict[str, Any] | None = None) -> Path:
        """The global model of ``generation`` on local disk (older ones removed); the run
        folder keeps it too, for the workflow's merge jobs. ``known``: the status's
        ``model`` (its size and digest), so that the download need not ask for them."""
        path = self.dir / "models" / f"global-{generation:06d}.safetensors"
        self.client.download_model(generation, path, known)  # one already here is not fetched
        keep_global_model(path, self.s.work_dir.parent, generation)
        for old in path.parent.glob("global-*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
        return path

    def take_over(self, round_no: int, rtt: float) -> dict | None:
        """The grant's reply for the live lease of ``round_no`` that a dead job of this site
        still holds, taken over to train it from its first block (``adopt``); None when
        there is none or the coordinator refuses (the lease expired meanwhile, or another
        job of this site took it first)."""
        here = site_prefix(self.site, round_no)
        for look in range(2):
            mine = [
                lease
                for lease in self.client.status()["active_leases"]
                if lease["site"] == self.site and lease["round"] == round_no
            ]
            if not mine:
                return None
            lease = mine[0]
            try:
                reply = self.client.adopt(lease["lease_id"], self.site, lease["consumed"], rtt)
                break
            except Refused as exc:
                if exc.status >= 500 or exc.status in (401, 403):
                    raise
                if exc.code == "bad_progress" and look == 0:
                    # the progress moved since the status: most likely this job's own
                    # adoption, whose reply was lost and whose retry carried the old
                    # progress; look again (what a job starting now would do)
                    continue
                log.info("%s could not take over lease %d: %s", here, lease["lease_id"], exc.code)
                return None
        else:
            return None
        log.info(
            "%s took over lease %d (%d blocks), held by a previous job",
            here, lease["lease_id"], reply["lease"]["n_blocks"],
        )  # fmt: skip
        return reply

    def early_lease(
        self, round_no: int, want: int, rtt: float, wait_open: bool = True
    ) -> tuple[dict, int] | None:
        """A lease of the round after the open one (overlapped rounds), asked once, and the
        global step the coordinator forecasts that round to start at; None when it has no
        lease to give now. A live one a previous job of this site held is taken over.

        Asked while the round before ``round_no`` has not opened yet (the site trained that
        round's phase early, and the merge before it is still running: ``round_not_open``),
        it waits for that round to open, up to ``OPEN_WAIT_S``, and asks once more: else the
        site would idle through that whole round's merge instead of a merge's seconds."""
        try:
            reply = self.client.lease(self.site, round_no, want, None, rtt)
        except Refused as exc:
            if exc.status >= 500 or exc.status in (401, 403):
                raise
            if exc.code == "round_not_open" and wait_open and self._opened(round_no - 1):
                return self.early_lease(round_no, want, rtt, wait_open=False)
            taken = self.take_over(round_no, rtt) if exc.code == "already_holding" else None
            if taken is None:
                log.info("%s no early lease: %s", site_prefix(self.site, round_no), exc.code)
                return None
            reply = taken
        if reply["lease"] is None:
            return None
        return reply["lease"], int(reply["global_step"])

    def _opened(self, round_no: int) -> bool:
        """Whether ``round_no`` is the open round once it has opened: a long poll of the
        status up to ``OPEN_WAIT_S``. False when the wait ran out, the status could not be
        read, or a later round is open already (nothing left to ask early for)."""
        here = site_prefix(self.site, round_no + 1)
        log.info("%s round %d has not opened yet: waiting for it to ask again", here, round_no)
        try:
            status = self.client.status(after_round=round_no - 1, wait_s=OPEN_WAIT_S)
        except Refused:
            return False
        return int(status["round"]) == round_no

    def lease(self, round_no: int, want: int, rtt: float) -> dict | None:
        """A lease of up to ``want`` blocks; None when no data turned up in time.

        Raises RoundClosed when the round closed first. A restarted job whose previous
        incarnation still holds a live lease of this round takes it over (``take_over``) and
        trains it from its first block; one it cannot take over (of another round) it waits
        for, until its TTL returns it to the pool, then leases anew.
        """
        backoff = Backoff(0.5, 5.0, budget_s=self.s.lease_wait_s)
        while True:
            try:
                reply = self.client.lease(self.site, round_no, want, None, rtt)
            except Refused as exc:
                if exc.code in ("round_closed", "already_contributed"):
                    raise RoundClosed(exc.code) from exc
                if exc.code != "already_holding":
                    raise
                reply = self.take_over(round_no, rtt) or {"lease": None}
                if reply["lease"] is None:
                    log.info(
                        "%s a previous job still holds a lease; waiting for its TTL",
                        site_prefix(self.site, round_no),
                    )
            if reply["lease"] is not None:
                return reply["lease"]
            if not backoff.wait():
                return None

    def confirm(self, cursor: Cursor, joined: dict[str, Any]) -> dict | None:
        """The live lease a checkpoint trained, confirmed by a heartbeat; None if it is gone
        (its blocks return to the pool on its TTL, and the checkpoint is dropped). A lease
        whose TTL ran out while the job restarted lives again if no other lease took its
        blocks meanwhile (the coordinator revives it on the heartbeat)."""
        here = site_prefix(self.site, cursor.round)
        live = [
            lease
            for lease in joined.get("active_leases", [])
            if lease["lease_id"] == cursor.lease_id and lease["site"] == self.site
        ]
        consumed = live[0]["consumed"] if live else 0  # 0: the coordinator keeps its own
        try:
            reply = self.client.heartbeat(cursor.lease_id, self.site, consumed, None)
        except Refused as exc:
            log.info(
                "%s lease %d of the checkpoint is no longer live (%s); leasing anew",
                here, cursor.lease_id, exc.code,
            )  # fmt: skip
            return None
        lease = reply["lease"]
        if not live:
            log.info("%s lease %d of the checkpoint lived again after its TTL",
                     here, cursor.lease_id)  # fmt: skip
        if list(lease["blocks"]) != list(cursor.blocks)[: len(lease["blocks"])]:
            raise checkpoint.CheckpointError(
                f"lease {lease['lease_id']}: blocks differ from the checkpoint's record"
            )
        held = sum(len(self.space.block_windows(block)) for block in lease["blocks"])
        if cursor.phase.windows > held:
            # a steal took blocks this checkpoint had already trained (it raced the step
            # loop): its delta would claim more than the lease holds and be refused, on
            # every retry. The lease is lost (the one the paper allows): its blocks go back
            # to the pool now, and the round is trained anew.
            log.info(
                "%s lease %d: the checkpoint trained %d windows, the lease holds %d after a "
                "steal; releasing it and training anew",
                here, lease["lease_id"], cursor.phase.windows, held,
            )  # fmt: skip
            self.release(lease["lease_id"])
            return None
        return lease

    def heartbeat(self, lease: dict, at_once: bool = False) -> Heartbeat:
        return Heartbeat(self.client, self.site, lease, self.s.heartbeat_s, at_once)

    def release(self, lease_id: int) -> None:
        self.client.release(lease_id, self.site)

    def _release_refused(self, pending: PendingDelta) -> None:
        """The lease of a refused delta can carry no other (its delta file goes, and e.g. a
        steal that raced the step loop left it smaller than what was trained): its blocks
        go back to the pool now rather than at its TTL, which its round would wait for. A
        lease already gone returns nothing; an unreachable coordinator leaves it to its TTL."""
        try:
            returned = self.client.release(pending.lease_id, self.site).get("returned", 0)
        except (Refused, Unreachable) as exc:
            log.info("%s lease %d not released: %s", site_prefix(self.site, pending.round),
                     pending.lease_id, getattr(exc, "code", exc))  # fmt: skip
            return
        if returned:
            log.info("%s lease %d released: %d blocks back to the pool",
                     site_prefix(self.site, pending.round), pending.lease_id, returned)  # fmt: skip

    def send(
        self, pending: PendingDelta, outcome: RoundOutcome, state_dir: Path, *, fresh: bool
    ) -> RoundOutcome:
        """Send the written delta; the reply commits its blocks (or rejects it as stale).
        ``fresh``: written by this job and not sent yet (no need to ask whether the
        coordinator holds it already).

        The pending record and the delta file go once answered; an accepted delta's residual
        becomes the site's (error feedback), a refused one's is dropped.
        """
        path = Path(pending.delta)
        size = path.stat().st_size
        streams = self.client.streams_for(size)
        inline = size <= self.s.inline_max_bytes
        t0 = time.perf_counter()
        try:
            # a pending record kept before deltas were hashed as written has no key
            claim = pending.claim(self.site, pending.key or digest_file(path))
            reply = self.client.submit_delta(
                claim.round_no, path, inline=inline, key=claim.blob, fresh=fresh, **claim.sent()
            )
        except Refused as exc:
            if exc.status >= 500 or exc.status in (401, 403):
                raise
            outcome.status = "stale" if exc.code == "stale_generation" else "lease_lost"
            outcome.detail = f"{exc.code}: {exc.detail}"
            reply = None
            if exc.code != "stale_generation":  # a stale delta's lease the coordinator freed
                self._release_refused(pending)
        outcome.upload_s = time.perf_counter() - t0
        size_mb = size / 1e6
        outcome.transport = f"{streams} parts" if streams > 1 else "inline" if inline else "blob"
        outcome.overhead_s = outcome.download_s + outcome.upload_s + outcome.checkpoint_s
        residual = Path(pending.residual) if pending.residual else None
        if reply is not None:
            outcome.blocks_committed = pending.consumed
            outcome.extra["already"] = reply.get("already", False)
            checkpoint.commit_residual(state_dir, residual)  # the next delta carries it
        elif residual is not None:  # not merged: the residual it came from is still owed
            residual.unlink(missing_ok=True)
        (self.dir / "pending.json").unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        log.info(
            "%s delta %s (%s, %.1f MB): %s",
            site_prefix(self.site, pending.round),
            outcome.status,
            outcome.transport,
            size_mb,
            outcome.detail or "blocks committed",
        )
        return outcome
