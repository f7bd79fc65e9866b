"""A site whose workflow starts rounds late: its site loop trains the open round first.

The real multi-site shape: a coordinator process serves over TLS (a certificate made here,
``--keep-models 0``), and another site (lumi, driven from the test over HTTPS) has carried
the run to round ``LATE``: rounds before it are closed, round ``LATE`` is held open by
lumi's live lease and heartbeats. snellius then starts its own Snakemake in its own copy of
the checkout (local profile, ``here=[snellius]``), with its own copy of the certificate
(``SSL_CERT_FILE``) and its token only, on one core: every job waits for that core in
Snakemake's queue. Its site loop needs only the run and goes first; it leases in the round
it registered in and trains round ``LATE``, the open one, and no earlier round. The jobs
of the closed rounds run after it, each probe and plan ending without planning, and every
record the report needs is there at the end.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
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
from crossfed.darl.ledger import EVENTS_TABLE
from crossfed.sched.planner import read_plan
from crossfed.sched.probe import PROBE_COLUMNS
from crossfed.testing.tls import self_signed
from tests.conftest import LiveCoordinator, coordinator_keeping_every_model
from tests.helpers.workflow import (
    BIN,
    checkout,
    crossfed_cli,
    finish,
    job_times,
    snakemake,
    wait_for,
    workdir,
)
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


def site_clone(tmp: Path, live: LiveCoordinator) -> Path:
    """snellius's own copy of the checkout: the run's config, the coordinator's HTTPS URL,
    its own copy of the certificate, no secrets file (its token comes from the environment)."""
    cwd = workdir(checkout(tmp), rounds=ROUNDS)
    path = cwd / "config" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["coordinator"].update(url=live.url, secrets=str(cwd / "no-secrets-here.yaml"))
    config["round_policy"]["join_window_s"] = 2  # lumi's rounds close 2 s after its lease
    path.write_text(yaml.safe_dump(config))
    shutil.copy2(live.state_dir / "cert.pem", cwd / "ca.pem")
    return cwd


def first_lease(state: Path, site: str) -> tuple[int, int]:
    """The round that was open when ``site`` first registered, and the round of its first
    lease, from the coordinator's ledger (its DARL events) and round table."""
    with sqlite3.connect(state / "state.sqlite") as conn:
        events = conn.execute(f"SELECT op, args FROM {EVENTS_TABLE} ORDER BY seq").fetchall()
        rounds = conn.execute("SELECT round_no, opened_at, closed_at FROM rounds").fetchall()
    mine = [(op, args) for op, args in ((op, json.loads(a)) for op, a in events)
            if args.get("site") == site]  # fmt: skip
    registered = next(args["now"] for op, args in mine if op == "register")
    leased = next(args["round_no"] for op, args in mine if op in ("grant", "steal"))
    (open_then,) = [
        r for r, opened, closed in rounds
        if opened <= registered and (closed is None or registered < closed)
    ]  # fmt: skip
    return open_then, leased


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveCoordinator]:
    """The coordinator VM: a standalone coordinator over TLS that keeps every global model
    (`--keep-models 0`, as a run that sites may join late is served): the late site secures
    generations 0..LATE-1. The test (the operator, lumi) trusts its certificate."""
    state = tmp_path / "coordinator"
    state.mkdir()
    certificate = self_signed(state)
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))
    with coordinator_keeping_every_model(state, certificate=certificate) as live:
        yield live


@pytest.mark.slow
def test_a_late_site_trains_first_and_records_the_closed_rounds_beside_it(
    live: LiveCoordinator, tmp_path: Path
) -> None:
    tokens = live.secrets
    assert live.url.startswith("https://")
    cwd = site_clone(tmp_path / "snellius", live)
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
    proc = snakemake(cwd, "--config", "here=[snellius]", repo=cwd, cores=1,
                     env={"CROSSFED_TOKEN": tokens["sites"]["snellius"],
                          "SSL_CERT_FILE": str(cwd / "ca.pem")})  # fmt: skip
    results = cwd / "results"
    leased_at: list[float] = []

    def snellius_trains() -> bool:
        """snellius trained round LATE (its lease's time noted) and planned it."""
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

    # the site loop went first: no job of a closed round was started before it, though
    # they were ready with it and one core serves them all
    times = job_times(cwd)
    loop_log = f"results/logs/train/snellius-through-{ROUNDS}.log"
    loop_started = times[loop_log][0]
    closed_jobs = {
        log: when for log, when in times.items()
        if re.fullmatch(rf"results/logs/(probe|plan|merge)/[1-{LATE - 1}]\.log", log)
    }  # fmt: skip
    assert len(closed_jobs) == 3 * (LATE - 1), sorted(times)
    first_closed = min(start for start, _ in closed_jobs.values())
    assert loop_started < first_closed, (loop_started, sorted(closed_jobs.items()))
    # and it leased in the round it registered in: the open round, no round later
    registered_in, leased_in = first_lease(live.state_dir, "snellius")
    assert registered_in == LATE and leased_in <= registered_in + 1, (registered_in, leased_in)
    print(f"late join: snellius's site loop started {loop_started - started:.1f} s after its "
          f"workflow, leased round {leased_in} at {(leased_at or [float('nan')])[0] - started:.1f}"
          f" s; the jobs of rounds 1-{LATE - 1} ran from {first_closed - started:.1f} s to "
          f"{max(end for _, end in closed_jobs.values()) - started:.1f} s")  # fmt: skip

    logs = results / "logs"
    train_text = (cwd / loop_log).read_text()  # the site loop's one job
    assert list((logs / "train").glob("snellius-*.log")) == [cwd / loop_log]
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
    for generation in range(ROUNDS + 1):  # every generation evaluated, the older ones too
        assert json.loads((results / "rounds" / str(generation) / "eval.json").read_text())
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
