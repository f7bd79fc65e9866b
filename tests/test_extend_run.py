"""End to end: a finished run is extended, changed and mistyped, as a user would rerun it.

The local profile trains one round; `--config rounds=2` then adds round 2 and leaves every
file of round 1 and the coordinator's ledger as they were, byte for byte. Reruns that would
change what round 1 means (other data, a mistyped input, other sites) are refused when the
workflow is read, with a message, and change nothing at all.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
from pathlib import Path

import pytest
import yaml
from test_workflow_e2e import BIN, REPO, finish, snakemake, workdir

from crossfed.darl.ledger import COMMITTED_TABLE, EVENTS_TABLE

pytestmark = pytest.mark.slow


def fingerprint(results: Path) -> dict[str, str]:
    """Digest of every file the run's finished rounds left (models, records, data)."""
    keep = ("checkpoints", "rounds", "data", ".crossfed/models")
    files = [p for part in keep for p in (results / part).rglob("*") if p.is_file()]
    files.append(results / "run.json")
    return {str(p.relative_to(results)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def ledger_rows(results: Path) -> tuple[list, list]:
    with sqlite3.connect(results / "coordinator" / "state.sqlite") as conn:
        events = conn.execute(f"SELECT seq, op, args FROM {EVENTS_TABLE} ORDER BY seq").fetchall()
        committed = conn.execute(f"SELECT * FROM {COMMITTED_TABLE}").fetchall()
    return events, committed


def refused(cwd: Path, *config: str) -> str:
    """A rerun that must stop when the workflow is read; returns what it printed."""
    proc = snakemake(cwd, "--config", *config, name="refused")
    rc = proc.wait(timeout=300)
    out = proc.log_path.read_text()  # type: ignore[attr-defined]
    assert rc != 0, out[-4000:]
    assert "Nothing was changed" in out, out[-4000:]
    return out


def test_extend_change_and_mistype_a_finished_run(tmp_path: Path) -> None:
    cwd = workdir(tmp_path, rounds=1)
    results = cwd / "results"
    finish(snakemake(cwd), cwd)
    before = fingerprint(results)
    events_before, committed_before = ledger_rows(results)
    assert (results / ".crossfed" / "models" / "global-1.safetensors").exists()

    # Snakemake's own rerun triggers (params, code, input, mtime) see nothing finished to
    # redo: no finished job's parameters hold the run's length
    dry = subprocess.run(
        [str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "--profile",
         str(REPO / "profiles" / "local"), "--config", "rounds=2", "-n",
         "--rerun-triggers", "mtime", "params", "input", "software-env", "code"],
        cwd=cwd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr[-4000:]
    planned = dry.stdout + dry.stderr
    assert "rounds/2/plan.json" in planned
    for finished in ("rounds/1/plan.json", "rounds/1/merge.json", "global-1.safetensors",
                     "rounds/0/eval.json", "data/meta.json", "run.json"):  # fmt: skip
        assert f"Missing output files: results/{finished}" not in planned
        assert f"output: results/{finished}" not in planned, finished
    assert fingerprint(results) == before

    # 1. more rounds: round 2 is added, nothing of round 1 changes
    out = finish(snakemake(cwd, "--config", "rounds=2", name="extend"), cwd)
    assert "run extended" in out
    after = fingerprint(results)
    assert {k: after[k] for k in before} == before
    assert "checkpoints/global-2.safetensors" in after
    events, committed = ledger_rows(results)
    assert events[: len(events_before)] == events_before
    assert set(committed_before) < set(committed)  # round 1's commits kept, round 2's added
    with sqlite3.connect(results / "coordinator" / "state.sqlite") as conn:
        spec = json.loads(conn.execute("SELECT value FROM meta WHERE key = 'spec'").fetchone()[0])
    config = yaml.safe_load((cwd / "config" / "config.yaml").read_text())
    assert spec["schedule"]["total_steps"] == 2 * config["inner"]["steps"]
    final = json.loads((results / "metrics" / "final.json").read_text())
    assert final["rounds"] == 2
    merge2 = json.loads((results / "rounds" / "2" / "merge.json").read_text())
    assert merge2["report"]["generation"] == 2

    # 2. changes that would give round 1 another meaning are refused, and touch nothing
    before = fingerprint(results)
    events_before, _ = ledger_rows(results)
    shard = cwd / "shards" / "c4-train.00000-of-00001.json"
    shard.parent.mkdir()
    shard.write_text(json.dumps({"text": "other data " * 50}) + "\n")
    assert "data.inputs" in refused(cwd, f"data={{'inputs': ['{shard}']}}")
    assert "no such file" in refused(cwd, f"data={{'inputs': ['{shard}.typo']}}")
    sites = yaml.safe_load((cwd / "config" / "sites.yaml").read_text())
    del sites["sites"]["frontier"]
    (cwd / "config" / "two-sites.yaml").write_text(yaml.safe_dump(sites))
    assert "sites.frontier" in refused(cwd, "rounds=2", "sites_file=config/two-sites.yaml")
    assert "closed 2 rounds" in refused(cwd, "rounds=1")
    assert fingerprint(results) == before
    assert ledger_rows(results)[0] == events_before

    # 3. the run's own config again: nothing to do
    again = finish(snakemake(cwd, "--config", "rounds=2", name="again"), cwd)
    assert "Nothing to be done" in again
    assert fingerprint(results) == before
