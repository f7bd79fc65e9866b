"""A coordinator whose disk fills up refuses what it cannot keep with 507 ``storage_full``,
keeps everything it had accepted, and takes the same requests once space is back.

The state directory lives on a real 64 MiB tmpfs (mounting one needs root, as CI has), filled
by a file written until the kernel says ENOSPC: no write is faked.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from crossfed.coordinator.embedded import ensure_secrets, free_port
from crossfed.darl.ledger import EVENTS_TABLE
from crossfed.wire.digests import digest_file
from tests.conftest import SITES, LiveCoordinator, start_process, stop, tiny_spec
from tests.unit.test_coordinator_http import delta_file, global_model, join_and_lease

MiB = 1 << 20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs mounted for the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.fixture
def run_on_small_disk(small_disk: Path, tiny_data: Path) -> Iterator[LiveCoordinator]:
    state = small_disk / "coordinator"
    state.mkdir()
    secrets = ensure_secrets(state / "secrets.yaml", SITES)
    port = free_port("127.0.0.1")
    live = LiveCoordinator(
        f"http://127.0.0.1:{port}", state, secrets, start_process(state, port), port
    )
    try:
        live.client().init_run(tiny_spec(tiny_data).to_dict())
        yield live
    finally:
        stop(live.process)


def fill(disk: Path) -> Path:
    """Write zeros into ``disk`` until the kernel refuses a single byte more."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (MiB, 4096, 1):
            while True:
                try:
                    os.write(fd, bytes(size))
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    finally:
        os.close(fd)
    return filler


def ledger_events(live: LiveCoordinator) -> int:
    with sqlite3.connect(live.state_dir / "state.sqlite") as conn:
        return conn.execute(f"SELECT COUNT(*) FROM {EVENTS_TABLE}").fetchone()[0]


def test_a_full_disk_refuses_with_507_keeps_what_it_had_and_recovers(
    run_on_small_disk: LiveCoordinator, small_disk: Path, tiny_data: Path, tmp_path: Path
) -> None:
    live = run_on_small_disk
    delta = delta_file(tmp_path, global_model(live, 0, tmp_path))
    lease = join_and_lease(live, "lumi", tiny_data)
    before = live.client().ledger()
    events = ledger_events(live)
    filler = fill(small_disk)

    lumi = live.client("lumi", retry_budget_s=0.5)
    part = lumi.http.put(
        f"/v1/blobs/{digest_file(delta)}",
        params={"offset": 0, "total": delta.stat().st_size},
        content=delta.read_bytes(),
    )
    assert part.status_code == 507, part.text
    assert part.json()["error"] == "storage_full" and part.headers["Retry-After"]
    # what the coordinator had accepted is all there and unchanged
    assert live.client().ledger() == before and ledger_events(live) == events

    # a site sending while the disk is full keeps trying (507 is "send it again later") and
    # gets through once space is back
    replies: list[dict] = []
    patient = live.client("lumi", retry_budget_s=60.0)
    sender = threading.Thread(
        target=lambda: replies.append(
            patient.submit_delta(
                1,
                delta,
                inline=False,
                fresh=True,
                site="lumi",
                lease_id=lease["lease_id"],
                generation=0,
                tokens=256,
                steps=4,
                consumed=lease["n_blocks"],
                loss=3.0,
            )  # fmt: skip
        )
    )
    sender.start()
    sender.join(3.0)
    assert sender.is_alive() and not replies  # refused so far, still trying
    filler.unlink()
    sender.join(60.0)
    assert replies and replies[0]["accepted"], replies
    log = (live.state_dir / "coordinator.log").read_text()
    assert "status=507" in log and "status=500" not in log
    assert "Traceback" not in log
