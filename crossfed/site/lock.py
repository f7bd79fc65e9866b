"""One job at a time per site folder: an advisory lock held for the job's lifetime.

A site's folder holds its checkpoints, its data cursor and the delta it is sending; two jobs
of one site must not write it at once. That happens when a job outlives its workflow (a
Ctrl-C that lands while the Slurm executor's ``sbatch`` runs leaves that job unknown to
Snakemake) and a resumed workflow starts the same site again. The second job waits for the
first to end (it gives up on a lost coordinator after its retry budget), then fails with an
error naming the holder. The lock is ``flock`` on ``<folder>/site.lock``: the kernel drops it
when its holder dies, however it dies. A filesystem without ``flock`` (Lustre mounted
without ``-o flock``) gets a warning and no lock.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from crossfed.backoff import Backoff

log = logging.getLogger("crossfed.site")

LOCK_NAME = "site.lock"
#: how long a second job of a site waits for the first to end (orphans give up after 120 s)
WAIT_S = 300.0
POLL_S = 1.0

_held: dict[Path, int] = {}  # lock files this process holds: taken again for free


class SiteBusy(RuntimeError):
    """Another job of the same site holds the site's folder."""


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "a job that has not said who it is"
    job = f", Slurm job {info['slurm_job_id']}" if info.get("slurm_job_id") else ""
    return f"pid {info.get('pid')} on {info.get('host')}{job}, since {info.get('since')}"


def hold_site_folder(
    folder: Path,
    *,
    wait_s: float = WAIT_S,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Hold ``folder``'s lock until this process ends; wait up to ``wait_s`` for another
    holder, then raise ``SiteBusy`` naming it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = (folder / LOCK_NAME).resolve()
    if path in _held:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    backoff, announced = Backoff(POLL_S, POLL_S, budget_s=wait_s, sleep=sleep, clock=clock), False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if backoff.expired():
                os.close(fd)
                raise SiteBusy(
                    f"{folder} is in use by another job of this site ({_holder(path)}) after "
                    f"waiting {wait_s:.0f}s: let it end or cancel it (scancel), then retry"
                ) from None
            if not announced:
                log.warning("waiting for %s: in use by %s", folder, _holder(path))
                announced = True
            backoff.wait()
        except OSError as exc:  # ENOLCK, EOPNOTSUPP: no flock on this filesystem
            os.close(fd)
            log.warning(
                "cannot lock %s (%s): make sure no two jobs of this site run at once", folder, exc
            )
            return
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    _held[path] = fd
