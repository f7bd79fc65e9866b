"""A restarted site job keeps its site's leases alive while it starts.

A site job spends seconds (tens, on a shared filesystem) importing torch and torchtitan and
building its model before its runner says a word to the coordinator. A job killed while it
held leases (a phase mid-way, a delta checkpointed but not yet sent, an early lease of the
next round) leaves them beating no more: they expire one TTL after the kill (10 s at the
least), and a round with nothing else to wait for is merged without them, so a delta the
restarted job then resends is stale and its phase is trained for nothing.

So a job, once it holds its site's folder (no other job of the site runs), heartbeats every
lease its site holds, at the progress the coordinator's status shows, from its first second
until its runner decides what each lease becomes (``SiteRunner`` stops the keeper before
its first request: adopted, confirmed from a checkpoint, resent, or let go). Never after: a
beat landing after an adoption would report the dead job's progress on a lease the new job
trains from its first block. A beat carries no step time (the job has taken none), so
the lease's TTL becomes the run's ``darl.initial_ttl_s``, as a new job's first lease's is:
the runner takes it over within that, or it returns to the pool then. Light on purpose: no
torch, so it starts before the imports.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from crossfed.client.http import Refused, Unreachable
from crossfed.launchenv import talks_to_coordinator
from crossfed.progress import site_prefix

if TYPE_CHECKING:
    from crossfed.client.http import CoordinatorClient
    from crossfed.config import RunConfig

log = logging.getLogger("crossfed.site")

#: seconds between two beats: a few within the shortest TTL a lease gets (10 s)
EVERY_S = 2.0
#: a keeper never runs longer than this (a runner that never starts lets the leases go)
LIMIT_S = 600.0
#: a keeper's requests: timeout and retry budget (``stop`` waits for the one in flight)
REQUEST_S = 3.0


class LeaseKeeper:
    """Heartbeats every lease ``site`` holds, in a thread, until ``stop``.

    ``client``: one of its own, with a short timeout and retry budget (``stop`` waits for
    the request in flight).
    """

    def __init__(
        self, client: CoordinatorClient, site: str, *, every_s: float = EVERY_S,
        limit_s: float = LIMIT_S,
    ) -> None:  # fmt: skip
        self.client, self.site = client, site
        self.every_s, self.limit_s = every_s, limit_s
        self.kept: set[int] = set()  # the leases it beat at least once
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="crossfed-keeper", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating; returns once no beat of this keeper can still reach the coordinator."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.client.close()
        if self.kept:
            log.info(
                "%s kept lease(s) %s alive while this job started (%d beats)",
                site_prefix(self.site), ", ".join(map(str, sorted(self.kept))), self.beats,
            )  # fmt: skip

    def _run(self) -> None:
        waited = 0.0
        while not self._stop.is_set() and waited <= self.limit_s:
            self.beat_once()
            if self._stop.wait(self.every_s):
                return
            waited += self.every_s

    def beat_once(self) -> None:
        """One heartbeat for each lease the status shows the site holding; refusals (the
        lease ended meanwhile) and an unreachable coordinator are left to the runner."""
        try:
            leases = self.client.status()["active_leases"]
        except (Refused, Unreachable, OSError, KeyError):
            return
        for lease in leases:
            if lease.get("site") != self.site or self._stop.is_set():
                continue
            lease_id = int(lease["lease_id"])
            try:
                self.client.heartbeat(lease_id, self.site, int(lease["consumed"]), None)
            except (Refused, Unreachable, OSError):
                continue
            self.kept.add(lease_id)
            self.beats += 1


def keep_site_leases(config: RunConfig, site: str) -> LeaseKeeper | None:
    """A site job's first step, before its imports (``keep_leases``; None in a process that
    is not rank 0, or that relaunches itself under torchrun: the rank 0 it starts keeps
    them)."""
    if not talks_to_coordinator(config.launcher.kind):
        return None
    from crossfed.client.reach import client_for

    client = client_for(config, site, timeout_s=REQUEST_S, retry_budget_s=REQUEST_S)
    return keep_leases(Path(config.results) / "sites" / site, client, site)


def keep_leases(
    folder: Path, client: CoordinatorClient, site: str, every_s: float = EVERY_S
) -> LeaseKeeper:
    """Hold the site's ``folder`` (waiting for another job of the site to end), then keep
    the leases the site holds beating with ``client`` (a short timeout and retry budget:
    ``REQUEST_S``) every ``every_s`` until the runner stops it."""
    from crossfed.site.lock import hold_site_folder

    hold_site_folder(folder)
    return LeaseKeeper(client, site, every_s=every_s).start()
