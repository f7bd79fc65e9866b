"""Fixtures of the end-to-end tests: runs that several test files judge."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SoakRun:
    """``bench/soak.py --preset ci``: its last-line JSON and what it left on disk."""

    result: dict[str, Any]
    run_dir: Path

    @property
    def state(self) -> Path:
        return self.run_dir / "coordinator"

    @property
    def model(self) -> Path:
        return Path(self.result["model"])


@pytest.fixture(scope="session")
def soak_ci(tmp_path_factory: pytest.TempPathFactory) -> SoakRun:
    """The soak's CI preset, once a session: test_soak judges its figures, test_soak_check
    checks (and damages copies of) the state it leaves."""
    workdir = tmp_path_factory.mktemp("soak")
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "soak.py"), "--preset", "ci"]
        + ["--workdir", str(workdir), "--seed", "1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return SoakRun(result, Path(result["run_dir"]))


#: the test files that run on one xdist worker, in turn (``make test`` runs the e2e tests
#: on two): those on a Slurm test cluster (the shared one owns /etc/slurm/slurm.conf, so two
#: workers cannot each start one) and those judging one soak run (a session fixture)
GROUPS = {
    "test_multisite.py": "slurm",
    "test_real_site_commands.py": "slurm",
    "test_sched_slurm_live.py": "slurm",
    "test_slurm_cluster.py": "slurm",
    "test_slurm_workflow.py": "slurm",
    "test_soak.py": "soak",
    "test_soak_check.py": "soak",
}


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its group, else its file (module fixtures are
    built once)."""
    path = nodeid.split("::", 1)[0]
    return GROUPS.get(Path(path).name, path)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Slurm tests first: they wait on job walltimes more than they compute, and are the
    longest unit, so the other worker trains beside them from the start."""
    items.sort(key=lambda item: GROUPS.get(item.path.name) != "slurm")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``-n N``: whole work units (``work_unit``) to the workers. (``--dist
    loadgroup`` with marks added at collection no longer groups on this pytest.)"""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnits(config, log)
