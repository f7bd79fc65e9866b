"""A site whose workflow starts rounds late: it skips the closed rounds and trains the open one.

A real coordinator process runs the run another site (lumi, driven from the test over the
HTTP API) has carried to round ``LATE``: rounds before it are closed, round ``LATE`` is held
open by lumi's live lease and heartbeats. snellius's own Snakemake (local profile,
``here=[snellius]``, its token only) then starts: its site loop trains round ``LATE``, the
open one, and no earlier round; every probe and plan of a closed round ends without planning.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import yaml
from safetensors.torch import load_file

from crossfed.catchup import OPEN
from crossfed.darl.blockspace import BlockSpace
from crossfed.sched.planner import read_plan
from crossfed.sched.probe import PROBE_COLUMNS
from tests.conftest import LiveCoordinator, coordinator_keeping_every_model
from tests.helpers.workflow import BIN, crossfed_cli, finish, snakemake, wait_for, workdir
from tests.unit.test_coordinator_http import delta_file, global_model, wait_round_closed
from tests.unit.test_security import cli_config
from tests.unit.test_site_views import close_round_one

LATE = 4  # the round the coordinator is at when snellius's workflow starts
ROUNDS = LATE  # the run ends with the round snellius joins


class Lumi:
    """The other site, from the test: leases, heartbeats and deltas over the HTTP API."""

    def __init__(self, live: LiveCoordinator, tmp: Path) -> None:
        self.live, self.tmp, self.client = live, tmp, live.client("lumi")
        status = self.client.status()
        self.client.register("lumi", status["digest"], 1, 1.0)
        self.beating: threading.Event | None = None

    def lease(self, round_no: int) -> dict:
        lease = self.client.lease("lumi", round_no, 2, None, 1.0)["lease"]
        assert lease is not None
        return lease

    def deliver(self, round_no: int, lease: dict) -> None:
        model = global_model(self.live, round_no - 1, self.tmp)
        path = delta_file(self.tmp, model, seed=round_no, name=f"lumi-{round_no}")
        self.client.submit_delta(
            round_no, path, inline=False, site="lumi", lease_id=lease["lease_id"],
            # within what the lease holds (4 windows of 32 tokens a block): its first is a probe
            generation=round_no - 1, tokens=64 * lease["n_blocks"], steps=4,
            consumed=lease["n_blocks"],
            loss=3.0, compute_s=1.0,
        )  # fmt: skip

    def hold_open(self, lease: dict) -> threading.Thread:
        """Heartbeat ``lease`` every half second (the round stays open) until stopped."""
        self.beating = threading.Event()
        client = self.live.client("lumi")

        def beat() -> None:
            assert self.beating is not None
            while not self.beating.wait(0.5):
                client.heartbeat(lease["lease_id"], "lumi", 0, 1.0)

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        return thread


def site_workdir(tmp: Path, live: LiveCoordinator) -> Path:
    """snellius's clone: the run's config, pointing at the standalone coordinator."""
    tmp.mkdir()
    cwd = workdir(tmp, rounds=ROUNDS)
    path = cwd / "config" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["coordinator"].update(url=live.url, secrets=str(cwd / "no-secrets-here.yaml"))
    path.write_text(yaml.safe_dump(config))
    return cwd


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveCoordinator]:
    """A standalone coordinator that keeps every global model (`--keep-models 0`, as a run
    that sites may join late is served): the late site secures generations 0..LATE-1."""
    with coordinator_keeping_every_model(tmp_path / "coordinator") as live:
        yield live


@pytest.mark.slow
def test_a_late_site_skips_closed_rounds_and_trains_the_open_one(
    live: LiveCoordinator, tmp_path: Path
) -> None:
    tokens = live.secrets
    cwd = site_workdir(tmp_path / "snellius", live)
    # the operator creates the run from the same config; snellius's data are prepared
    crossfed_cli(cwd, "data", "prepare", "--config", "config/config.yaml", token=tokens["admin"])
    crossfed_cli(cwd, "run", "init", "--config", "config/config.yaml", token=tokens["admin"])
    meta = json.loads((cwd / "results" / "data" / "meta.json").read_text())
    assert live.client().status()["digest"] == BlockSpace(meta["n_windows"], 4, 1234).digest()

    lumi = Lumi(live, tmp_path)
    for r in range(1, LATE):
        lumi.deliver(r, lumi.lease(r))
        wait_round_closed(live, r)
    held = lumi.lease(LATE)
    beats = lumi.hold_open(held)
    started = time.time()
    proc = snakemake(cwd, "--config", "here=[snellius]",
                     env={"CROSSFED_TOKEN": tokens["sites"]["snellius"]})  # fmt: skip
    results = cwd / "results"
    leased_at: list[float] = []

    def snellius_trains() -> bool:
        """snellius leased round LATE (or already sent its delta): its catch-up is over."""
        if not leased_at and any(
            lease["site"] == "snellius" for lease in live.client().status()["active_leases"]
        ):
            leased_at.append(time.time())
        # and the workflow planned the open round: lumi holds it open until then, so the
        # plan job, however late a busy machine starts it, plans an open round
        round_dir = results / "rounds" / str(LATE)
        return (round_dir / "train" / "snellius.json").exists() and (
            round_dir / "plan.json"
        ).exists()

    try:
        wait_for(snellius_trains, 600, f"snellius's round-{LATE} record", [proc])
        assert live.client().round_info(LATE)["status"] == "open"  # lumi held it open
    finally:
        assert lumi.beating is not None
        lumi.beating.set()
        beats.join(timeout=10)
    lumi.deliver(LATE, held)
    finish(proc)
    if leased_at:  # the catch-up's length, for the eye (bench/multisite.py measures it)
        print(f"late join: snellius leased round {LATE} {leased_at[0] - started:.1f} s after "
              f"its workflow started, rounds 1-{LATE - 1} closed")  # fmt: skip

    logs = results / "logs"
    (train_log,) = (logs / "train").glob("snellius-*.log")  # the site loop's one job
    train_text = train_log.read_text()
    for r in range(1, LATE):  # closed: nothing probed, planned, leased or trained
        assert not (results / "rounds" / str(r) / "train" / "snellius.json").exists()
        assert f"[snellius r{r}]" not in train_text and f"round {r}: starting" not in train_text
        plan = json.loads((results / "rounds" / str(r) / "plan.json").read_text())
        assert plan["mode"] == "closed" and plan["sites"] == {}, plan
        assert "not planned" in plan["detail"] and "barrier" not in plan
        assert "job log" not in (logs / "plan" / f"{r}.log").read_text()  # no planner ran
        assert pd.read_csv(results / "rounds" / str(r) / "probe.csv").empty
        # the round's record and global model, as every site keeps them
        assert json.loads((results / "rounds" / str(r) / "merge.json").read_text())["round_no"] == r
        assert (results / "checkpoints" / f"global-{r}.safetensors").stat().st_size > 0
    # the open round: probed, planned (the barrier filled), trained, as any site's round
    record = json.loads((results / "rounds" / str(LATE) / "train" / "snellius.json").read_text())
    assert record["status"] == "accepted" and record["steps"] > 0 and record["compute_s"] > 0
    assert f"[snellius r{LATE}] step " in train_text
    assert f"[snellius] round {LATE}: starting" in train_text
    plan = json.loads((results / "rounds" / str(LATE) / "plan.json").read_text())
    assert plan["mode"] != "closed" and plan["sites"]["snellius"]["submit"] and "barrier" in plan
    assert "job log" in (logs / "plan" / f"{LATE}.log").read_text()
    assert set(pd.read_csv(results / "rounds" / str(LATE) / "probe.csv")["site"]) == {"snellius"}
    info = live.client().round_info(LATE)
    assert sorted(info["report"]["contributors"]) == ["lumi", "snellius"]
    final = json.loads((results / "metrics" / "final.json").read_text())
    assert final["contributions"]["snellius"] == 1 and final["contributions"]["lumi"] == LATE
    plans = pd.read_csv(results / "metrics" / "plans.csv")
    assert plans["plan"].tolist() == [f"round {LATE}"] * 3  # the planned round's three sites
    rounds = pd.read_csv(results / "metrics" / "rounds.csv")
    assert rounds["round"].tolist() == list(range(1, ROUNDS + 1))


def catchup(config: Path, what: str, round_no: int, out: Path) -> subprocess.CompletedProcess:
    """``python -m crossfed.catchup`` as a rule runs it, with import times on stderr."""
    return subprocess.run(
        [str(BIN / "python"), "-X", "importtime", "-m", "crossfed.catchup", what, "--config",
         str(config), "--round", str(round_no), "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def imported(stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines()}


def test_closed_round_jobs_write_their_records_without_torch_or_pandas(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """Round 1 closed, round 2 open: the catch-up commands write round 1's plan and probe
    records; for round 2 they exit 1 and write nothing (the rule then plans and probes);
    round 1's merge job secures its model without importing torch or pandas."""
    close_round_one(run, tiny_data, tmp_path)
    config = cli_config(run, tiny_data, tmp_path)
    plan, probe = tmp_path / "plan.json", tmp_path / "probe.csv"
    for what, out in (("plan", plan), ("probe", probe)):
        done = catchup(config, what, 1, out)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "round 1 closed; coordinator is at round 2" in done.stdout
        assert not {"torch", "pandas", "crossfed.cli"} & imported(done.stderr)
        open_round = catchup(config, what, 2, tmp_path / f"open-{out.name}")
        assert open_round.returncode == OPEN and not (tmp_path / f"open-{out.name}").exists()
    record = read_plan(plan)  # a plan as the planner's, of no site
    assert record.mode == "closed" and record.round == 0 and record.sites == {}
    assert list(pd.read_csv(probe).columns) == list(PROBE_COLUMNS) and pd.read_csv(probe).empty

    model = tmp_path / "results" / "checkpoints" / "global-1.safetensors"
    done = subprocess.run(
        [str(BIN / "python"), "-X", "importtime", "-m", "crossfed", "round", "wait", "--config",
         str(config), "--round", "1", "--out", str(tmp_path / "merge.json"), "--model-out",
         str(model)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not {"torch", "pandas"} & imported(done.stderr)
    assert load_file(str(model)).keys() == global_model(run, 1, tmp_path).keys()
