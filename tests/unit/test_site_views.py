"""What a site's workflow sees of the run, against a real coordinator process.

Every site keeps the coordinator's round records (``merge.json``) and builds its metrics
from them, so each site's report describes the whole run: who contributed, and the round's
compute time, shared as ``compute_s`` while each delta's own figures stay private. A site
job for a round the coordinator has closed ends at once, before torch is imported, a site
that joins a run before its own data are prepared starts its workflow, and a coordinator
told to keep every round's global model serves them to a site that starts late.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yaml

from crossfed.coordinator.blobs import BlobStore
from crossfed.report import contributions, round_table
from crossfed.wire.digests import digest_file
from tests.conftest import LiveCoordinator, coordinator_keeping_every_model, tiny_spec
from tests.unit.test_coordinator_http import (
    delta_file,
    global_model,
    join_and_lease,
    submit,
    wait_round_closed,
)
from tests.unit.test_security import cli_config

BIN = Path(sys.executable).parent


def close_round_one(run: LiveCoordinator, data: Path, tmp: Path) -> None:
    """snellius (12.5 s of compute) and lumi (7 s) both contribute to round 1."""
    g0 = global_model(run, 0, tmp)
    leases = {site: join_and_lease(run, site, data) for site in ("snellius", "lumi")}
    for seed, (site, compute_s) in enumerate((("snellius", 12.5), ("lumi", 7.0))):
        lease = leases[site]
        run.client(site).submit_delta(
            1, delta_file(tmp, g0, seed=seed, name=site), inline=False, site=site,
            lease_id=lease["lease_id"], generation=0, tokens=256, steps=4,
            consumed=lease["n_blocks"], loss=3.0, compute_s=compute_s,
        )  # fmt: skip
    wait_round_closed(run, 1)


def test_every_site_sees_the_rounds_contributors_and_compute_time(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    close_round_one(run, tiny_data, tmp_path)
    for who in ("admin", "lumi", "snellius"):
        assert run.client(who).round_info(1)["compute_s"] == 12.5, who
    # the deltas' own figures stay private to their site
    assert [d["site"] for d in run.client("lumi").round_info(1)["deltas"]] == ["lumi"]

    # lumi's workflow: the coordinator's record of round 1 and lumi's own train record only
    results = tmp_path / "lumi-results"
    (results / "rounds" / "1" / "train").mkdir(parents=True)
    record = run.client("lumi").round_info(1)
    (results / "rounds" / "1" / "merge.json").write_text(json.dumps(record))
    own = {"round": 1, "site": "lumi", "status": "accepted", "compute_s": 7.0,
           "download_s": 0.1, "upload_s": 0.2, "checkpoint_s": 0.3}  # fmt: skip
    (results / "rounds" / "1" / "train" / "lumi.json").write_text(json.dumps(own))
    sites = pd.DataFrame([own])
    table = round_table(results, sites)
    assert table["compute_s"].tolist() == [12.5]  # the run's slowest site, not lumi's 7 s
    assert table["contributors"].tolist() == ["snellius+lumi"]
    assert contributions(results, ["snellius", "lumi", "frontier"]) == {
        "snellius": 1, "lumi": 1, "frontier": 0,
    }  # fmt: skip


def test_a_job_for_a_closed_round_ends_without_torch(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    close_round_one(run, tiny_data, tmp_path)
    config = cli_config(run, tiny_data, tmp_path)
    out = tmp_path / "outcome.json"
    done = subprocess.run(
        [str(BIN / "python"), "-X", "importtime", "-m", "crossfed", "site", "run", "--config",
         str(config), "--site", "lumi", "--round", "1", "--out", str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(out.read_text())
    assert outcome["status"] == "missed" and outcome["round"] == 1
    assert "coordinator is at round 2" in outcome["detail"]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    assert "crossfed.cli" in imported and "torch" not in imported


def test_resume_only_waits_for_a_joining_sites_data(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    config = cli_config(run, tiny_data, tmp_path)
    conf = yaml.safe_load(config.read_text())
    conf["data"]["dir"] = str(tmp_path / "not-prepared")
    config.write_text(yaml.safe_dump(conf))
    done = subprocess.run(
        [str(BIN / "crossfed"), "run", "init", "--config", str(config), "--resume-only"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "data are not prepared yet" in done.stdout
    assert run.client().status()["round"] == 1  # the run is as it was


def test_keep_deltas_keeps_every_merged_delta_and_the_first_master(
    tiny_data: Path, tmp_path: Path
) -> None:
    """``coordinator serve --keep-deltas``: an auditor can replay the run from generation 0
    (its master and every merged delta stay); without it both go (the test beside)."""
    state = tmp_path / "state"
    sent = []
    with coordinator_keeping_every_model(state, ("--keep-deltas",)) as live:
        live.client().init_run(tiny_spec(tiny_data).to_dict())
        for r in range(1, 6):
            model = global_model(live, r - 1, tmp_path)
            lease = join_and_lease(live, "lumi", tiny_data, round_no=r)
            sent.append(delta_file(tmp_path, model, seed=r, name=f"delta-{r}"))
            submit(live, "lumi", lease, sent[-1], generation=r - 1, round_no=r)
            wait_round_closed(live, r)
        masters = sorted(p.name for p in (state / "models").glob("master-*.safetensors"))
        assert masters == [f"master-{g:06d}.safetensors" for g in (0, 3, 4, 5)]
        kept = BlobStore(state / "blobs").keys()
        assert {digest_file(path) for path in sent} <= set(kept)


def test_keep_models_keeps_every_rounds_global_model_for_a_late_site(
    tiny_data: Path, tmp_path: Path
) -> None:
    """``coordinator serve --keep-models 0``: every generation stays downloadable (a site
    that starts rounds late secures them all); the fp32 masters keep the last three."""
    state = tmp_path / "state"
    with coordinator_keeping_every_model(state) as live:
        live.client().init_run(tiny_spec(tiny_data).to_dict())
        for r in range(1, 6):
            model = global_model(live, r - 1, tmp_path)
            lease = join_and_lease(live, "lumi", tiny_data, round_no=r)
            path = delta_file(tmp_path, model, seed=r, name=f"delta-{r}")
            submit(live, "lumi", lease, path, generation=r - 1, round_no=r)
            wait_round_closed(live, r)
        late = live.client("snellius")
        for generation in range(6):  # a site joining now still gets round 1's model
            late.download_model(generation, tmp_path / "late" / f"global-{generation}.st")
        masters = sorted(p.name for p in (state / "models").glob("master-*.safetensors"))
        assert masters == [f"master-{g:06d}.safetensors" for g in (3, 4, 5)]
