"""Rank 0's round in flight: the delta's upload and commit, then the merged model's arrival.

With overlapped rounds (crossfed.train.overlap) a site trains its next lease while this runs
in the background: ``InFlight`` sends the checkpointed delta (``Control.send``; the round's
heartbeat keeps its lease alive until the coordinator answers), then waits for the round to
close and downloads the merged model. The step loop only asks ``arrived`` between steps, so
it never blocks on the network or on the coordinator's merge, checkpoint or evaluation; at
the end of its phase it waits for the merged model (a site is at most one round ahead), and
that wait is idle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from crossfed.backoff import Backoff
from crossfed.client.http import STATUS_WAIT_S
from crossfed.coordinator.faults import crash_point
from crossfed.progress import site_prefix
from crossfed.site.control import Control, Heartbeat
from crossfed.site.records import PendingDelta, RoundOutcome

log = logging.getLogger("crossfed.site")


class InFlight:
    """One sent round: its send, then the wait for the merge and the merged model's download.

    ``pending``: the delta to send (None: the coordinator holds it already, sent by a killed
    job of this site; ``outcome`` is then the round's as it stands); ``beat``: the round's
    lease heartbeat, stopped once the delta is answered (None: a restarted job's, whose
    round's beat died with the killed job); ``fresh``: the delta was written by this job and
    never sent (a resend asks whether it is held already).
    """

    def __init__(
        self,
        control: Control,
        pending: PendingDelta | None,
        outcome: RoundOutcome,
        beat: Heartbeat | None,
        state_dir: Path,
        *,
        fresh: bool = True,
        on_sent: Callable[[RoundOutcome], None] = lambda _outcome: None,
        poll_s: float = 0.5,
        wait_s: float = STATUS_WAIT_S,
    ) -> None:
        self.control, self.pending, self.outcome = control, pending, outcome
        self.on_sent = on_sent
        self.beat, self.state_dir, self.poll_s, self.wait_s = beat, state_dir, poll_s, wait_s
        self.round, self.fresh = outcome.round, fresh
        self.sent = threading.Event()  # the coordinator answered the delta
        self.arrived = threading.Event()  # the merged model is on disk and in memory
        self.error: BaseException | None = None
        self.send_error: BaseException | None = None
        self.merged: dict[str, torch.Tensor] | None = None
        self.merged_path: Path | None = None
        self.generation: int | None = None
        self.global_step: int | None = None
        self.current_round: int | None = None  # the coordinator's round when it arrived
        self.download_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"in-flight-{control.site}-{self.round}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            if self.pending is not None:
                self._send(self.pending)
            try:  # the round's record is written now, whatever happens to the next phase
                self.on_sent(self.outcome)
            except Exception:
                log.exception("%s recording round %d", site_prefix(self.control.site), self.round)
            self.sent.set()
            status = self._await_close()
            if status is None:
                return
            t0 = time.perf_counter()
            path = self.control.download(int(status["generation"]), status.get("model"))
            self.merged = load_file(path)
            self.download_s = time.perf_counter() - t0
            self.merged_path, self.generation = path, int(status["generation"])
            self.global_step, self.current_round = int(status["global_step"]), int(status["round"])
            log.info(
                "%s merged model of generation %d arrived (download %.1fs)",
                site_prefix(self.control.site, self.round), self.generation, self.download_s,
            )  # fmt: skip
        except BaseException as exc:  # handed to the training thread by wait()
            self.error = exc
        finally:
            self.sent.set()
            self.arrived.set()

    def _send(self, pending: PendingDelta) -> None:
        try:
            crash_point("site_mid_upload", f"{self.control.site}:{self.round}")  # tests only
            self.outcome = self.control.send(
                pending, self.outcome, self.state_dir, fresh=self.fresh
            )
            crash_point("site_after_send", f"{self.control.site}:{self.round}")  # tests only
            self.outcome.comms_hidden_s += self.outcome.upload_s  # beside the next phase
        except BaseException as exc:
            self.send_error = exc
            raise
        finally:
            # the lease is committed (or refused): a beat still retrying does not hold up
            # the wait for the merge
            if self.beat is not None:
                self.beat.stop(wait=False)

    def _await_close(self) -> dict[str, Any] | None:
        """The coordinator's status once round ``self.round`` has closed (None: stopped)."""
        # a coordinator that does not hold the request is asked again every poll_s
        backoff = Backoff(self.poll_s, self.poll_s, sleep=self._stop.wait)
        while not self._stop.is_set():
            status = self.control.client.status(self.round, wait_s=self.wait_s)
            if int(status["round"]) > self.round:
                return status
            backoff.wait()
        return None

    def wait_sent(self) -> RoundOutcome:
        """The round's outcome once the coordinator answered its delta."""
        self.sent.wait()
        if self.send_error is not None:
            raise self.send_error
        return self.outcome

    def wait_arrived(self) -> float:
        """Block until the merged model is here; the seconds waited (idle)."""
        t0 = time.perf_counter()
        self.arrived.wait()
        if self.error is not None:
            raise self.error
        return time.perf_counter() - t0

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop waiting for the merge (the job ends); the send, if running, finishes first, and
        so does a download already under way: the thread has ended when this returns. (A
        daemon thread still inside torch or safetensors when the interpreter exits aborts
        the process: "terminate called without an active exception".)"""
        self._stop.set()
        self.sent.wait()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("%s in-flight thread still running %.0fs after the job's end",
                        site_prefix(self.control.site, self.round), timeout_s)  # fmt: skip
