"""Early rounds end to end: the local workflow with ``inner.early_rounds`` trains its first
rounds at ``inner.early_steps`` and the rest at ``inner.steps``, every site sizing each
phase by its round's H, and the run's LR schedule spanning both."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import yaml

from tests.helpers.workflow import check_ledger, finish, snakemake, workdir

pytestmark = pytest.mark.slow


def test_the_first_rounds_train_their_own_h(tmp_path: Path) -> None:
    cwd = workdir(tmp_path, rounds=3)
    config_path = cwd / "config" / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["inner"].update(steps=6, early_rounds=2, early_steps=2)
    config_path.write_text(yaml.safe_dump(config))
    finish(snakemake(cwd), timeout_s=1200)

    results = cwd / "results"
    check_ledger(results)
    with sqlite3.connect(results / "coordinator" / "state.sqlite") as conn:
        steps = dict(conn.execute("SELECT round_no, MAX(steps) FROM deltas GROUP BY round_no"))
        (spec,) = conn.execute("SELECT value FROM meta WHERE key = 'spec'").fetchone()
    assert set(steps) == {1, 2, 3}, steps
    assert steps[1] <= 2 and steps[2] <= 2, steps  # a phase of 2 steps (or a probe's share)
    assert steps[3] > 2, steps  # the run's H from round 3 on
    stored = json.loads(spec)
    assert (stored["early_rounds"], stored["early_steps"], stored["inner_steps"]) == (2, 2, 6)
    assert stored["schedule"]["total_steps"] == 2 * 2 + 6
