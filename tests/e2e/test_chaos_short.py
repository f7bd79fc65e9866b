"""The chaos campaign (bench/chaos.py), short: exactly-once and no 5xx under injected faults.

Real processes throughout: a coordinator SIGKILLed and restarted, three training site
processes of which two depart and rejoin, all traffic through a proxy that refuses, delays
and kills connections. The run must finish its rounds with every block of a finished epoch
merged exactly once, nothing a site was told is committed missing, and no 5xx. Plain
rounds only: the soak (tests/e2e/test_soak.py) runs overlapped rounds under many more faults
with the same checks.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("overlap", [False], ids=["plain"])
def test_short_chaos_campaign_keeps_exactly_once(tmp_path: Path, overlap: bool) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "chaos.py"), "--short", "--no-reference"]
        + ["--workdir", str(tmp_path), "--seed", "3"]
        + (["--overlap"] if overlap else []),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=1500,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["overlap"] is overlap
    assert (result["early_leases"] > 0) is overlap  # leases granted before their round opened
    assert result["faults"]["coordinator_sigkill"] == 1
    assert result["faults"]["site_departures"] == result["faults"]["site_rejoins"] == 2
    assert result["faults_injected"] >= 5
    assert result["blocks_lost"] == 0
    assert result["blocks_duplicated"] == 0
    assert result["blocks_misattributed"] == 0
    assert result["http_5xx"] == 0
    assert result["worker_crashes"] == 0
    assert result["deltas_accepted"] >= result["rounds"]
    assert result["blocks_committed"] > 0 and 0.0 <= result["reclaimed_fraction"] < 1.0
    assert result["final_val_perplexity"] < 512  # trained: better than uniform over the vocab
    # no token in any log the campaign wrote: coordinator, site processes, journals
    (run_dir,) = tmp_path.glob("chaos-*")
    secrets = yaml.safe_load((run_dir / "coordinator" / "secrets.yaml").read_text())
    tokens = [secrets["admin"], *secrets["sites"].values()]
    # every site with an accepted delta kept a journal (a site killed while it started up,
    # before its first request, has none), and all three sites and the coordinator logged
    with sqlite3.connect(run_dir / "coordinator" / "state.sqlite") as conn:
        merged = {site for (site,) in conn.execute("SELECT DISTINCT site FROM deltas")}
    journals = sorted(run_dir.glob("journal-*.jsonl"))
    assert merged and merged <= {path.stem.removeprefix("journal-") for path in journals}
    site_logs = sorted(run_dir.glob("*.log"))
    assert {path.stem for path in site_logs} == {"snellius", "lumi", "frontier"}
    logs = [*site_logs, *journals, run_dir / "coordinator" / "coordinator.log"]
    for log in logs:
        text = log.read_text(errors="replace")
        assert not any(token in text for token in tokens), f"a token appears in {log.name}"
    assert not any(token in done.stdout + done.stderr for token in tokens)
