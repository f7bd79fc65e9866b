"""The benches that start whole Snakemake workflows run (bench/overlap.py: the local
three-site workflow twice, overlapped rounds off and on; bench/wan_goodput.py: behind an
emulated long link on N streams), each with its smallest arguments,
as tests/unit/test_bench_smoke.py runs the others: exit 0 and a last line of JSON holding
the keys the bench documents."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_bench_smoke import WORKFLOW_SMOKES, Smoke, run_smoke

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
@pytest.mark.parametrize("smoke", WORKFLOW_SMOKES, ids=[s.name for s in WORKFLOW_SMOKES])
def test_workflow_bench_runs_with_its_smallest_arguments(smoke: Smoke, tmp_path: Path) -> None:
    result = run_smoke(smoke, tmp_path, timeout_s=870)
    runs = result.get("runs", result)  # the runs each bench compares
    rounds = [run["rounds"] for run in runs.values() if isinstance(run, dict) and "rounds" in run]
    assert rounds and set(rounds) == {1}
