"""A starting site job keeps its site's leases alive (crossfed.site.keepalive), against a
real coordinator."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from crossfed.coordinator.runspec import LeasePolicy
from crossfed.launchenv import talks_to_coordinator
from crossfed.site.keepalive import REQUEST_S, keep_leases
from crossfed.site.lock import LOCK_NAME
from tests.conftest import LiveCoordinator, tiny_spec
from tests.unit.test_darl_coordinator import active, block_size_of, join, lease, ledger


@pytest.fixture
def darl(coordinator: LiveCoordinator, tiny_data: Path) -> LiveCoordinator:
    """The tiny corpus in 14 blocks; a lease's TTL is 2 s, 3 s before a step time is known
    (a starting job's beats carry none)."""
    leases = LeasePolicy(min_ttl_s=2.0, initial_ttl_s=3.0, probe_share=1.0)
    spec = tiny_spec(tiny_data, block_size=block_size_of(tiny_data), leases=leases)
    coordinator.client().init_run(spec.to_dict())
    return coordinator


def test_a_starting_job_keeps_only_its_sites_leases_alive_and_not_past_its_stop(
    darl: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """snellius's dead job left a lease at progress 1 (TTL 2 s, beaten by nobody since);
    the restarted job's keeper beats it at that progress while lumi's lease, not its site's,
    expires. Once stopped, the keeper sends nothing more and the lease expires within the
    run's initial TTL (a beat without a step time gives it that, as a new job's lease)."""
    join(darl, "snellius", tiny_data)
    join(darl, "lumi", tiny_data)
    dead = lease(darl, "snellius", 3, t_step=0.4)  # TTL 2 s
    darl.client("snellius").heartbeat(dead["lease_id"], "snellius", 1, 0.4)
    other = lease(darl, "lumi", 2, t_step=0.4)  # TTL 2 s, lumi's own affair
    folder = tmp_path / "sites" / "snellius"
    client = darl.client("snellius", timeout_s=REQUEST_S, retry_budget_s=REQUEST_S)
    keeper = keep_leases(folder, client, "snellius", every_s=0.4)
    try:
        assert json.loads((folder / LOCK_NAME).read_text())["pid"] == os.getpid()
        deadline = time.monotonic() + 30
        while ledger(darl)["lumi"]["ttl_expiries"] == 0:
            assert time.monotonic() < deadline, "lumi's lease never expired"
            time.sleep(0.2)
        time.sleep(3.0)  # past snellius's TTL too: alive only through the keeper
        leases = active(darl)
        assert other["lease_id"] not in leases
        assert leases[dead["lease_id"]]["consumed"] == 1  # the dead job's progress, kept
        assert ledger(darl)["snellius"]["ttl_expiries"] == 0
        assert leases[dead["lease_id"]]["ttl_s"] == pytest.approx(3.0)
    finally:
        keeper.stop()
    assert keeper.kept == {dead["lease_id"]} and keeper.beats >= 5
    beats = keeper.beats
    deadline = time.monotonic() + 30
    while ledger(darl)["snellius"]["ttl_expiries"] == 0:
        assert time.monotonic() < deadline, "the lease outlived its keeper"
        time.sleep(0.2)
    assert keeper.beats == beats and dead["lease_id"] not in active(darl)


@pytest.mark.parametrize(
    ("env", "launcher", "talks"),
    [
        ({}, "local", True),  # one process: it is rank 0
        ({}, "torchrun", False),  # it relaunches itself as the ranks: their rank 0 talks
        ({"TORCHELASTIC_RUN_ID": "j", "RANK": "0"}, "torchrun", True),
        ({"TORCHELASTIC_RUN_ID": "j", "RANK": "3"}, "torchrun", False),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "1", "RANK": "1"}, "torchrun", False),
    ],
)
def test_only_the_process_that_becomes_rank_0_keeps_leases(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], launcher: str, talks: bool
) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert talks_to_coordinator(launcher) is talks


def test_a_site_job_imports_no_more_than_it_needs_before_it_trains() -> None:
    """A restarted job's keeper beats before the job imports torch, and the job's runner
    leaves pandas alone (only the coordinator's reports make tables): every second of a
    restart's imports is a second the site does not train."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "import crossfed.site.keepalive\n"
        "early = sorted(m for m in ('torch', 'pandas') if m in sys.modules)\n"
        "import crossfed.site.runner\n"
        "print(early, 'pandas' in sys.modules, 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.split("\n")[-2] == "[] False True", done.stdout + done.stderr
