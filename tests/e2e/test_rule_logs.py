"""The workflow, run for real, says why it fails: at read time, or in the failing rule's log.

Each test runs Snakemake with the local profile in a temporary run directory on a config
made wrong in one way, and checks where the reason appears: a bad flavour or a site-key typo
before any job starts; a missing data input in prepare_data.log; a coordinator's refusal in
init_run.log; a failing `round wait` in the merge log.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, LiveCoordinator

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def workdir(tmp_path: Path, **sections: dict) -> Path:
    """A run directory with the repo's config and sites; ``sections`` update config sections."""
    (tmp_path / "config").mkdir()
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    sites = (REPO / "config" / "sites.yaml").read_text()
    (tmp_path / "config" / "sites.yaml").write_text(sites)
    return tmp_path


def live_sections(live: LiveCoordinator, data: Path) -> dict:
    """Config sections for a workflow that talks to ``live`` and reads the prepared ``data``."""
    return {
        "coordinator": {"url": live.url, "secrets": str(live.state_dir / "secrets.yaml")},
        # as tests/conftest.py's tiny_data was prepared, so the rerun check accepts it
        "data": {"dir": str(data), "vocab_size": 512, "seq_len": 32, "shards": 2},
    }


def snakemake(cwd: Path, *extra: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", **env_vars}
    cmd = [str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "--profile",
           str(REPO / "profiles" / "local"), "--cores", "1", *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_a_bad_flavour_stops_the_workflow_at_read_naming_it(tmp_path: Path) -> None:
    cwd = workdir(tmp_path, model={"flavour": "0.6b"})
    done = snakemake(cwd, "-n")
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "model/flavour: unknown model flavour '0.6b' (did you mean '0.6B'?)" in out
    assert not (cwd / "results" / "logs").exists()  # no job ran


def test_a_site_key_typo_stops_the_workflow_at_read(tmp_path: Path) -> None:
    cwd = workdir(tmp_path)
    sites = yaml.safe_load((cwd / "config" / "sites.yaml").read_text())
    sites["sites"]["lumi"]["rank"] = sites["sites"]["lumi"].pop("ranks")
    sites["sites"]["frontier"]["scheduler"] = "slrum"
    (cwd / "config" / "sites.yaml").write_text(yaml.safe_dump(sites, sort_keys=False))
    done = snakemake(cwd, "-n")
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "sites/lumi: unknown key 'rank' (did you mean 'ranks'?)" in out
    assert "sites/frontier/scheduler: 'slrum' is not one of none, slurm" in out
    assert not (cwd / "results" / "logs").exists()


def test_a_missing_data_input_is_named_in_prepare_data_log(tmp_path: Path) -> None:
    missing = tmp_path / "corpus" / "c4-train.00000-of-01024.json.gz"
    cwd = workdir(tmp_path, data={"inputs": [str(missing)]})
    done = snakemake(cwd, "results/data/meta.json")
    assert done.returncode != 0, done.stdout[-3000:]
    log = (cwd / "results" / "logs" / "prepare_data.log").read_text()
    assert str(missing) in log and "no such file or directory" in log


def test_a_coordinator_refusal_is_in_init_run_log(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    # a site's login node (its own token) before the operator has created the run
    cwd = workdir(tmp_path, **live_sections(coordinator, tiny_data))
    token = coordinator.secrets["sites"]["lumi"]
    done = snakemake(cwd, "results/run.json", "--allowed-rules", "init_run", CROSSFED_TOKEN=token)
    assert done.returncode != 0, done.stdout[-3000:]
    log = (cwd / "results" / "logs" / "init_run.log").read_text()
    assert re.search(r"crossfed: 4\d\d no_run: no run initialised", log), log
    assert not (cwd / "results" / "run.json").exists()


def test_a_failing_round_wait_is_in_the_merge_log(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    # the coordinator has no run, so waiting for round 1 is refused
    cwd = workdir(tmp_path, **live_sections(coordinator, tiny_data))
    plan = cwd / "results" / "rounds" / "1" / "plan.json"
    plan.parent.mkdir(parents=True)
    plan.write_text(json.dumps({"sites": {}}))
    done = snakemake(cwd, "results/rounds/1/merge.json", "--allowed-rules", "merge")
    assert done.returncode != 0, done.stdout[-3000:]
    log = (cwd / "results" / "logs" / "merge" / "1.log").read_text()
    assert re.search(r"crossfed: 4\d\d no_run: no run initialised", log), log
    assert not (cwd / "results" / "rounds" / "1" / "merge.json").exists()
