"""One job per site folder: a second process waits for the holder, then names it; the kernel
frees the lock when the holder dies; a process takes its own lock again for free."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crossfed.site.lock import LOCK_NAME, SiteBusy, hold_site_folder

REPO = Path(__file__).resolve().parents[2]
HOLD = (
    "import sys, time; from pathlib import Path; from crossfed.site.lock import hold_site_folder;"
    "hold_site_folder(Path(sys.argv[1]), wait_s=float(sys.argv[2])); print('held', flush=True);"
    "time.sleep(float(sys.argv[3]))"
)


def _holder(folder: Path, wait_s: float = 0.0, hold_s: float = 120.0) -> subprocess.Popen:
    """A real process that takes the folder's lock, says so, and keeps it for ``hold_s``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder), str(wait_s), str(hold_s)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "SLURM_JOB_ID": "4242"},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_job_waits_then_names_the_holder(tmp_path: Path) -> None:
    folder = tmp_path / "lumi"
    first = _holder(folder)
    try:
        slept: list[float] = []
        now = [0.0]

        def sleep(s: float) -> None:
            slept.append(s)
            now[0] += s

        with pytest.raises(SiteBusy) as caught:
            hold_site_folder(folder, wait_s=3.0, sleep=sleep, clock=lambda: now[0])
        assert len(slept) == 3  # it waited the whole bound before giving up
        message = str(caught.value)
        assert f"pid {first.pid}" in message and "Slurm job 4242" in message, message
        assert str(folder) in message
    finally:
        first.kill()
        first.wait()


def test_the_lock_is_freed_when_its_holder_is_killed(tmp_path: Path) -> None:
    folder = tmp_path / "snellius"
    first = _holder(folder)
    second = subprocess.Popen(  # waits up to 60 s for the folder
        [sys.executable, "-c", HOLD, str(folder), "60", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    assert second.poll() is None  # still waiting while the first holds it
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert second.stdout is not None and second.stdout.readline().strip() == "held"
    assert second.wait(timeout=30) == 0
    assert f'"pid": {second.pid}' in (folder / LOCK_NAME).read_text()


def test_a_process_takes_its_own_lock_again(tmp_path: Path) -> None:
    folder = tmp_path / "frontier"
    hold_site_folder(folder, wait_s=0.0)
    hold_site_folder(folder, wait_s=0.0)  # a chain's next round in the same process
    other = subprocess.run(
        [sys.executable, "-c", HOLD, str(folder), "0", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert other.returncode != 0 and "SiteBusy" in other.stderr and "in use" in other.stderr
