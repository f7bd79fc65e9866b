"""End to end: the Snakemake workflow on the local profile, with real processes throughout.

Three simulated sites train torchtitan's Qwen3 (tiny flavour) against a real coordinator;
one site job is SIGKILLed mid-round (its retry takes its lease over), and later the whole
workflow is killed and resumed. Checks the outputs, perplexity, and the ledger's exactly-once
identities.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from crossfed.coordinator.faults import ENV, ONCE_ENV
from tests.helpers.workflow import (
    check_ledger,
    finish,
    kill_workflow,
    log_has_steps,
    snakemake,
    wait_for,
    workdir,
)

pytestmark = pytest.mark.slow


def test_three_sites_train_through_a_killed_site_job_and_a_killed_workflow(
    tmp_path: Path,
) -> None:
    """One run, two crashes: a site job SIGKILLed mid-round 2 (the others carry on), then
    the whole workflow SIGKILLed mid-round 3 and run again (it resumes)."""
    cwd = workdir(tmp_path)
    # leases outlive a job's restart however busy the machine (the small run's TTL of a few
    # seconds may not), so that the retry finds its predecessor's lease live and takes it over
    config = yaml.safe_load((cwd / "config" / "config.yaml").read_text())
    config["darl"].update(min_ttl_s=60, initial_ttl_s=60)
    (cwd / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    results = cwd / "results"
    # lumi's site job SIGKILLs itself after its first inner step of round 2, once (as a node failure
    # would; Snakemake's retry then runs): killed from outside instead, a short phase (the
    # planner gives a slow site few steps) could have sent its delta before the signal came
    crashed = tmp_path / "lumi-crashed"
    proc = snakemake(cwd, env={ENV: "site_after_step@lumi:2", ONCE_ENV: str(crashed)})
    wait_for(
        lambda: "died with <Signals.SIGKILL: 9>" in proc.log_path.read_text(),  # type: ignore[attr-defined]
        600,
        "lumi's site job to die in round 2",
    )
    assert "site run --config results/.crossfed/config.yaml --site lumi --through-round 3" in (
        proc.log_path.read_text()  # type: ignore[attr-defined]
    )

    # the workflow carries on without lumi's round-2 lease; in round 3 it is killed whole
    # (the site loops may run a round ahead of the workflow's merge jobs, and with overlapped
    # rounds train round 3 before round 2 is merged: round 2's merge job is waited for until
    # Snakemake has finished it, which its evaluation starting shows; a job killed while
    # Snakemake finishes it would rightly be rerun)
    log = results / "logs" / "train" / "snellius-through-3.log"
    evaluated = results / "rounds" / "2" / "eval.json"
    wait_for(lambda: log_has_steps(log, 3) and evaluated.exists(), 600, "round 3 training")
    assert proc.poll() is None, proc.log_path.read_text()[-6000:]  # type: ignore[attr-defined]
    merged_before = {
        r: (results / "rounds" / str(r) / "merge.json").stat().st_mtime_ns for r in (1, 2)
    }
    kill_workflow(proc, cwd)
    # as after any killed Snakemake run: release its lock, then run again
    finish(snakemake(cwd, "--unlock", name="unlock"))
    out = finish(snakemake(cwd, name="resume"))
    for r, mtime in merged_before.items():  # closed rounds were not redone
        assert (results / "rounds" / str(r) / "merge.json").stat().st_mtime_ns == mtime

    final = json.loads((results / "metrics" / "final.json").read_text())
    assert final["rounds"] == 3 and final["sites"] == ["snellius", "lumi", "frontier"]
    for key in ("val_perplexity", "val_loss", "tokens", "wall_s"):
        assert key in final
    initial = json.loads((results / "rounds" / "0" / "eval.json").read_text())
    assert 1.0 < final["val_perplexity"] < initial["val_perplexity"]
    assert initial["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # eval: auto
    ledger = check_ledger(results)
    lumi = ledger[ledger["site"] == "lumi"].iloc[0]
    assert (tmp_path / "lumi-crashed.0").exists()  # the site job did die after a step of round 2
    # the retry took over the lease the killed job held, and trained it: the kill cost nothing
    took_over = "lumi took over its lease"
    coordinator_log = (results / "coordinator" / "coordinator.log").read_text()
    assert any(took_over in line and "of round 2" in line for line in coordinator_log.splitlines())
    assert lumi["ttl_expiries"] == 0 and lumi["blocks_lost"] == 0
    assert ledger["blocks_lost"].iloc[-1] == 0  # nor did the workflow's kill: its jobs' leases too
    rounds = pd.read_csv(results / "metrics" / "rounds.csv")
    assert {"round", "train_loss", "tokens", "compute_s", "overhead_s"} <= set(rounds.columns)
    assert (results / "plots" / "perplexity.png").stat().st_size > 1000
    assert "lumi" in out

    # a finished run reruns nothing
    again = finish(snakemake(cwd, name="rerun"))
    assert "Nothing to be done" in again
