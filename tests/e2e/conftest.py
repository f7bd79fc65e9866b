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
