"""End to end: the Snakemake workflow on the local profile, with real processes throughout.

Three simulated sites train torchtitan's Qwen3 (tiny flavour) against a real coordinator;
one site job is SIGKILLed mid-round, and later the whole workflow is killed and resumed.
Checks the outputs, perplexity, and the ledger's exactly-once identities.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from crossfed.coordinator.faults import ENV, ONCE_ENV
from crossfed.darl.ledger import COMMITTED_TABLE

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def workdir(tmp_path: Path, rounds: int = 3) -> Path:
    """A run directory with a small config: short rounds, tiny windows."""
    (tmp_path / "config").mkdir()
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config.update(rounds=rounds)
    config["data"].update(vocab_size=512, seq_len=32, block_size=4)
    config["inner"].update(steps=6, warmup_steps=2)
    config["eval"].update(max_windows=64)
    config["round_policy"].update(join_window_s=8)
    config["darl"].update(min_ttl_s=4, initial_ttl_s=8, heartbeat_s=0.5)
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    sites = yaml.safe_load((REPO / "config" / "sites.yaml").read_text())
    for site in sites["sites"].values():
        site["slowdown"] = min(site["slowdown"], 1.5)
    # slow enough to be killed mid-round on any machine: the step-5 log line comes >= 1 s
    # before the last step ends
    sites["sites"]["lumi"].update(slowdown=3.0, min_step_s=1.0)
    (tmp_path / "config" / "sites.yaml").write_text(yaml.safe_dump(sites, sort_keys=False))
    return tmp_path


def snakemake(
    cwd: Path, *extra: str, name: str = "snakemake", env: dict[str, str] | None = None
) -> subprocess.Popen:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", **(env or {})}
    cmd = [
        str(BIN / "snakemake"),
        "-s",
        str(REPO / "Snakefile"),
        "--profile",
        str(REPO / "profiles" / "local"),
        "--cores",
        "4",
        *extra,
    ]
    log = open(cwd / f"{name}.out", "wb")
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    proc.log_path = cwd / f"{name}.out"  # type: ignore[attr-defined]
    STARTED.append((proc, cwd))
    return proc


#: every workflow a test started, with its directory: reaped when the test ends
STARTED: list[tuple[subprocess.Popen, Path]] = []


def reap_workflows() -> None:
    """SIGKILL what a test left running (it failed or timed out mid-run): each workflow's
    process group, then whatever still works in its folder (site jobs, the embedded
    coordinator, which runs in a session of its own)."""
    while STARTED:
        proc, cwd = STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for entry in Path("/proc").iterdir():  # anything else still working in its folder
            try:
                inside = Path(os.readlink(entry / "cwd")).is_relative_to(cwd)
                if entry.name.isdigit() and inside and int(entry.name) != os.getpid():
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass


def finish(proc: subprocess.Popen, cwd: Path, timeout_s: float = 900) -> str:
    rc = proc.wait(timeout=timeout_s)
    out = proc.log_path.read_text()  # type: ignore[attr-defined]
    assert rc == 0, out[-6000:]
    return out


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def site_pids(site: str) -> list[int]:
    """The site's loop job (one for the run, every round back to back)."""
    found = subprocess.run(
        ["pgrep", "-f", f"site run .*--site {site} --through-round "],
        capture_output=True,
        text=True,
    )
    return [int(p) for p in found.stdout.split()]


def log_has_steps(path: Path, round_no: int) -> bool:
    """The site's own step lines ("[lumi r2] step 5 (global ...") show it is mid-phase."""
    site = path.name.split("-")[0]
    return path.exists() and f"[{site} r{round_no}] step " in path.read_text()


def check_ledger(cwd: Path) -> pd.DataFrame:
    ledger = pd.read_csv(cwd / "results" / "ledger.csv")
    assert list(ledger.columns) == [
        "site",
        "ranks",
        "rtt_ms",
        "entries",
        "grants",
        "blocks_granted",
        "blocks_committed",
        "blocks_lost",
        "ttl_expiries",
    ]
    assert ledger["site"].iloc[-1] == "total"
    per_site, total = ledger.iloc[:-1], ledger.iloc[-1]
    for column in ("grants", "blocks_granted", "blocks_committed", "blocks_lost"):
        assert per_site[column].sum() == total[column], column
    with sqlite3.connect(cwd / "results" / "coordinator" / "state.sqlite") as conn:
        rows = conn.execute(f"SELECT epoch, block FROM {COMMITTED_TABLE}").fetchall()
    assert len(rows) == len(set(rows)) == total["blocks_committed"] > 0
    return ledger


def kill_workflow(proc: subprocess.Popen, cwd: Path) -> None:
    """SIGKILL the whole workflow, its site jobs and the embedded coordinator (a crash)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    for site in ("lumi", "snellius", "frontier"):
        for pid in site_pids(site):
            os.kill(pid, signal.SIGKILL)
    endpoint = cwd / "results" / "coordinator" / "endpoint.json"
    if endpoint.exists():  # the embedded coordinator was killed with it or is orphaned
        pid = json.loads(endpoint.read_text())["pid"]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_three_sites_train_through_a_killed_site_job_and_a_killed_workflow(
    tmp_path: Path,
) -> None:
    """One run, two crashes: a site job SIGKILLed mid-round 2 (the others carry on), then
    the whole workflow SIGKILLed mid-round 3 and run again (it resumes)."""
    cwd = workdir(tmp_path)
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
    # (the site loops may run a round ahead of the workflow's merge jobs: round 2's is waited for)
    log = results / "logs" / "train" / "snellius-through-3.log"
    merged = results / "rounds" / "2" / "merge.json"
    wait_for(lambda: log_has_steps(log, 3) and merged.exists(), 600, "round 3 training")
    assert proc.poll() is None, proc.log_path.read_text()[-6000:]  # type: ignore[attr-defined]
    merged_before = {
        r: (results / "rounds" / str(r) / "merge.json").stat().st_mtime_ns for r in (1, 2)
    }
    kill_workflow(proc, cwd)
    # as after any killed Snakemake run: release its lock, then run again
    finish(snakemake(cwd, "--unlock", name="unlock"), cwd)
    out = finish(snakemake(cwd, name="resume"), cwd)
    for r, mtime in merged_before.items():  # closed rounds were not redone
        assert (results / "rounds" / str(r) / "merge.json").stat().st_mtime_ns == mtime

    final = json.loads((results / "metrics" / "final.json").read_text())
    assert final["rounds"] == 3 and final["sites"] == ["snellius", "lumi", "frontier"]
    for key in ("val_perplexity", "val_loss", "tokens", "wall_s"):
        assert key in final
    initial = json.loads((results / "rounds" / "0" / "eval.json").read_text())
    assert 1.0 < final["val_perplexity"] < initial["val_perplexity"]
    assert initial["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # eval: auto
    ledger = check_ledger(cwd)
    lumi = ledger[ledger["site"] == "lumi"].iloc[0]
    assert (tmp_path / "lumi-crashed.0").exists()  # the site job did die after a step of round 2
    assert lumi["ttl_expiries"] >= 1 and lumi["blocks_lost"] >= 1  # the kill cost one lease
    rounds = pd.read_csv(results / "metrics" / "rounds.csv")
    assert {"round", "train_loss", "tokens", "compute_s", "overhead_s"} <= set(rounds.columns)
    assert (results / "plots" / "perplexity.png").stat().st_size > 1000
    assert "lumi" in out

    # a finished run reruns nothing
    again = finish(snakemake(cwd, name="rerun"), cwd)
    assert "Nothing to be done" in again
