"""Crashes at every point of an overlapped round, against a real coordinator.

A site's chain job (``crossfed site run --through-round``, overlapped rounds) SIGKILLs itself
once at a crash point (crossfed.coordinator.faults) and is started again:

(a) ``site_mid_upload``: round 1's delta is about to be sent while round 2 would train;
(b) ``site_mid_fold``: round 1's merged model half folded into round 2's early phase;
(c) ``site_after_step``: after the first step of round 2's early phase, round 1 still open;
(d) ``site_awaiting_merge``: round 2's early phase checkpointed and waiting for round 1's
    merge (its lead spent), round 1 still open; the restarted job goes on with it at once;
(e) ``site_after_send``: round 1's delta accepted, its record not yet written; the restarted
    job records the round as the coordinator accepted it.

The crashing site is snellius, a subprocess. frontier is a real SiteRunner in this process
that leases each round at once but trains it only when the test lets it (``HeldBack``): its
live lease keeps the round open, so snellius is a round ahead when it dies, and round k
waits for snellius's restarted job to lease it. After the restart the run completes; the
restarted job, back within the leases' TTL, takes over the early lease its predecessor held
(trained or not) instead of letting it expire, so the crash loses no block; the resent
delta of (a) is accepted once, and no block is committed twice. In (a) and (c) the
restarted job does not wait for round 1 to close: its delta resent in the background (a) or
already in (c), it trains round 2's early lease at once from the weights of round 1's
end-of-phase checkpoint and folds round 1's merged model in when it arrives. In (d) the
restarted job goes on from the early phase's checkpoint instead of training the lease again,
round 1 still open: it folds round 1's merged model into its weights when it arrives, from
the weights it sent round 1's delta from (the end-of-phase checkpoint of round 1, kept for
that).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from crossfed.config import load_sites
from crossfed.coordinator.runspec import LeasePolicy
from crossfed.darl.ledger import COMMITTED_TABLE
from crossfed.site.job import site_settings
from crossfed.site.loop import ChainSettings, run_chain
from crossfed.site.records import PendingDelta
from crossfed.train import checkpoint
from tests.conftest import REPO, SITES, LiveCoordinator, tiny_spec
from tests.unit.test_site_overlap import HeldBack, overlap_config

pytestmark = pytest.mark.slow

ROUNDS = 3
SITE, OTHER = "snellius", "frontier"


class Crash:
    """One crash scenario: the run, the crashing site's jobs and the held-back site."""

    def __init__(
        self,
        coordinator: LiveCoordinator,
        data: Path,
        tmp_path: Path,
        point: str,
        ttl_s: float,
        checkpoint_every: int = 0,
    ) -> None:
        self.live, self.tmp = coordinator, tmp_path
        # a dead job's lease lives ttl_s: long enough for a restarted job to resend in time
        spec = tiny_spec(
            data,
            sites={name: 1 for name in SITES},
            leases=LeasePolicy(min_ttl_s=ttl_s, initial_ttl_s=ttl_s),
        )
        coordinator.client().init_run(spec.to_dict())
        # checkpoint_every 0: no mid-phase checkpoint, a killed phase is trained anew
        self.config = overlap_config(tmp_path, coordinator, data, checkpoint_every=checkpoint_every)
        self.config_path = tmp_path / "config.yaml"
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "CROSSFED_CRASH_AT": point,
            "CROSSFED_CRASH_ONCE": str(tmp_path / "crash-once"),
        }
        self.gates = {r: threading.Event() for r in range(1, ROUNDS + 1)}
        self.errors: list[BaseException] = []
        self.outcomes: dict[int, object] = {}
        self.jobs: list[subprocess.Popen] = []
        self.restarted = False  # frontier's rounds >= 2 wait for the restarted job
        self.dead: set[int] = set()  # the leases the killed job held
        self.admin = coordinator.client()
        self.other = threading.Thread(target=self._other_site, daemon=True)
        self.other.start()

    def _other_site(self) -> None:
        try:
            sites = load_sites(self.config)
            client = self.live.client(OTHER)
            runner = HeldBack(site_settings(self.config, OTHER, sites[OTHER]), client)
            runner.gates = self.gates
            run_chain(
                OTHER, runner, client, ChainSettings(through_round=ROUNDS),
                on_round=lambda o, s: self.outcomes.__setitem__(o.round, o),
            )  # fmt: skip
        except BaseException as exc:
            self.errors.append(exc)

    def start_job(self, name: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "crossfed", "site", "run", "--config", str(self.config_path)]
        cmd += ["--site", SITE, "--through-round", str(ROUNDS), "--until-walltime", "none"]
        cmd += ["--out", str(self.tmp / f"{name}.json")]
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115
        job = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.jobs.append(job)
        return job

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-4000:]

    def leases(self, site: str) -> list[dict]:
        return [x for x in self.admin.status()["active_leases"] if x["site"] == site]

    def delivered(self, round_no: int) -> bool:
        """Whether snellius has a delta in ``round_no``."""
        try:
            deltas = self.admin.round_info(round_no)["deltas"]
        except Exception:  # the round does not exist yet
            return False
        return any(d["site"] == SITE for d in deltas)

    def drive(self, done: Callable[[], bool], what: str, timeout_s: float = 300.0) -> None:
        """Poll until ``done()``. Once snellius's job has restarted, frontier trains round
        k >= 2 when that job holds (or has delivered) round k, or has ended. A round the
        restarted job missed fails at once (it would wait for frontier's gate forever)."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            assert not self.errors, self.errors
            if self.restarted:
                job = self.jobs[-1]
                held = {x["round"] for x in self.leases(SITE) if x["lease_id"] not in self.dead}
                for r in range(2, ROUNDS + 1):
                    if r in held or job.poll() is not None or self.delivered(r):
                        self.gates[r].set()
                    record = self.round_record(r)
                    assert record.get("status") != "missed", record
            time.sleep(0.1)

    def round_record(self, round_no: int) -> dict:
        """snellius's per-round record of ``round_no`` ({} while there is none)."""
        path = self.tmp / "results" / "rounds" / str(round_no) / "train" / f"{SITE}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def close(self) -> None:
        for gate in self.gates.values():
            gate.set()
        for job in self.jobs:
            if job.poll() is None:
                job.send_signal(signal.SIGKILL)
                job.wait(30)
        self.other.join(timeout=120)

    def first_job_dies(self, gate_one: Callable[[], bool]) -> list[dict]:
        """Start the crashing job; frontier trains round 1 once ``gate_one()``. The job must
        SIGKILL itself at its crash point; returns the leases it died holding."""
        job = self.start_job("first")

        def died() -> bool:
            if not self.gates[1].is_set() and gate_one():
                self.gates[1].set()
            return job.poll() is not None

        self.drive(died, "the crash point")
        assert job.returncode == -signal.SIGKILL, self.log("first")
        assert (self.tmp / "crash-once.0").exists()  # it died at the point, once
        held = self.leases(SITE)
        self.dead = {x["lease_id"] for x in held}
        return held

    def restart(self, trains: range, gate_one: Callable[[], bool] = lambda: True) -> dict:
        """Start the job again (same crash point, already spent) and let the run finish;
        frontier trains round 1 once ``gate_one()``. The restarted job must have trained
        the rounds ``trains``. Returns the chain job's outcome."""
        self.restarted = True
        job = self.start_job("second")

        def finished() -> bool:
            if not self.gates[1].is_set() and gate_one():
                self.gates[1].set()
            return job.poll() is not None

        self.drive(finished, "the restarted job", timeout_s=400)
        assert job.returncode == 0, self.log("second")
        self.other.join(timeout=120)
        assert not self.errors, self.errors
        chain = json.loads((self.tmp / "second.json").read_text())
        assert chain["stopped"] == "run_complete", chain
        # the jobs end once their last deltas are in; the coordinator then closes the round
        self.drive(lambda: self.admin.status()["round"] == ROUNDS + 1, "the last merge", 60)
        for round_no in trains:
            assert self.round_record(round_no).get("status") == "accepted", round_no
        return chain

    def check_exactly_once(self) -> list[dict]:
        """No block committed twice: the ledger, the audit table and the accepted deltas
        agree, each lease carried one delta. Returns the deltas (rows of the coordinator)."""
        state = self.live.state_dir / "state.sqlite"
        conn = sqlite3.connect(f"file:{state}?mode=ro", uri=True)
        conn.row_factory = sqlite3.Row
        try:
            deltas = [dict(r) for r in conn.execute("SELECT * FROM deltas")]
            committed = conn.execute(f"SELECT epoch, block FROM {COMMITTED_TABLE}").fetchall()
        finally:
            conn.close()
        rows = {row["site"]: row for row in self.admin.ledger()}
        status = self.admin.status()
        assert status["epoch"] == 0  # the tiny corpus outlasts the run: one epoch to count
        leases = [d["lease_id"] for d in deltas]
        assert len(leases) == len(set(leases))  # one delta per lease
        total = sum(d["consumed"] for d in deltas)
        assert rows["total"]["blocks_committed"] == total == status["blocks_committed_in_epoch"]
        assert len(committed) == len({tuple(c) for c in committed}) == total
        for site in (SITE, OTHER):
            mine = sum(d["consumed"] for d in deltas if d["site"] == site)
            assert rows[site]["blocks_committed"] == mine
        for round_no in range(1, ROUNDS + 1):  # every round from both sites
            sites = sorted(d["site"] for d in deltas if d["round_no"] == round_no)
            assert sites == [OTHER, SITE], (round_no, sites)
        return deltas


@pytest.fixture
def crash(request, coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path):
    scenario = Crash(coordinator, tiny_data, tmp_path, *request.param)
    try:
        yield scenario
    finally:
        scenario.close()


@pytest.mark.parametrize(
    "crash", [(f"site_mid_upload@{SITE}:1", 30.0)], indirect=True, ids=["mid_upload"]
)
def test_killed_mid_upload_of_round_r_resends_it_once(crash: Crash) -> None:
    held = crash.first_job_dies(lambda: False)
    folder = crash.tmp / "results" / "sites" / SITE
    record = PendingDelta.from_json((folder / "pending.json").read_text())
    assert record.round == 1 and not crash.delivered(1)  # checkpointed, never sent
    assert [x["lease_id"] for x in held if x["round"] == 1] == [record.lease_id]
    kept = shutil.copy(record.delta, crash.tmp / "delta-r1.safetensors")
    newest = checkpoint.latest(folder / "state")
    assert newest is not None and (newest["round"], newest["status"]) == (1, "done")
    ended = Path(newest["path"]).name
    # frontier trains round 1 once the restarted job has resent snellius's delta: the
    # restarted job resends it in the background and meanwhile trains round 2's early lease
    # from the weights that delta was made from (round 1's end-of-phase checkpoint), then
    # round 3 (restart checks every round accepted)
    crash.restart(range(1, ROUNDS + 1), gate_one=lambda: crash.delivered(1) and began_early(crash))
    first = crash.round_record(1)  # the restarted job's round 1: the resend, accepted
    assert first["extra"]["resumed"] is True and first["extra"]["already"] is False
    assert first["lease_id"] == record.lease_id
    said = (crash.tmp / "second.log").read_text(errors="replace")
    # from its first second the restarted job kept the lease of its unsent delta beating
    assert re.search(rf"kept lease\(s\) ([0-9]+, )*{record.lease_id}\b", said), said[-3000:]
    assert "folded in generation 1 at step" in said
    assert crash.round_record(2)["generation"] == 1  # measured against round 1's merge
    # from the weights round 1's delta was made from: its end-of-phase checkpoint
    assert f"the early phase starts from {ended}, the weights of round 1's delta" in said
    deltas = crash.check_exactly_once()
    (carried,) = [d for d in deltas if d["lease_id"] == record.lease_id]
    assert carried["round_no"] == 1 and carried["consumed"] == record.consumed
    row = {r["site"]: r for r in crash.admin.ledger()}[SITE]
    assert row["blocks_lost"] == 0  # the lease in flight was resent within its TTL
    # idempotent: the same request once more is answered "already" and changes nothing
    again = crash.live.client(SITE).submit_delta(
        record.round, Path(kept), inline=True, key=record.key, site=SITE,
        lease_id=record.lease_id, generation=record.generation, tokens=record.tokens,
        steps=record.steps, consumed=record.consumed, loss=record.loss,
        compute_s=record.compute_s,
    )  # fmt: skip
    assert again["accepted"] is True and again["already"] is True
    assert crash.check_exactly_once() == deltas


@pytest.mark.parametrize(
    "crash", [(f"site_after_send@{SITE}:1", 30.0)], indirect=True, ids=["after_send"]
)
def test_killed_after_its_delta_was_accepted_the_restarted_job_records_what_it_trained(
    crash: Crash,
) -> None:
    """Round 1's delta was accepted and the job died before it wrote the round's record: the
    restarted job, told the delta is in, records round 1 as the coordinator accepted it
    (its tokens, steps, blocks and compute seconds), not as a round of no work, and goes
    on to round 2 at once."""
    crash.first_job_dies(lambda: False)
    assert crash.delivered(1) and crash.round_record(1) == {}
    crash.restart(range(1, ROUNDS + 1), gate_one=lambda: began_early(crash))
    (sent,) = [d for d in crash.check_exactly_once() if d["round_no"] == 1 and d["site"] == SITE]
    first = crash.round_record(1)
    assert first["status"] == "accepted" and first["extra"]["already"] is True, first
    assert (first["tokens"], first["steps"], first["blocks_committed"]) == (
        sent["tokens"], sent["steps"], sent["consumed"],
    ), (first, sent)  # fmt: skip
    assert first["compute_s"] == pytest.approx(sent["compute_s"]) and first["compute_s"] > 0


def began_early(crash: Crash, how: str = "early lease") -> bool:
    """Whether snellius's restarted job began (``how``: "early lease") or resumed
    ("resuming") round 2's early phase while round 1 was open (frontier's lease keeps it
    open until the test lets it train)."""
    said = (crash.tmp / "second.log").read_text(errors="replace")
    return re.search(rf"\[{SITE} r2\] {how} .* while round 1 is merged", said) is not None


def early_lease(crash: Crash) -> bool:
    """Whether snellius holds a lease of round 2 while round 1 is open (its early lease)."""
    if crash.admin.status()["round"] != 1:
        return False
    return any(x["round"] == 2 for x in crash.leases(SITE))


def check_taken_over(crash: Crash, lease: dict) -> None:
    """The restarted job took over ``lease``, the early lease the killed job was training,
    within its TTL, and trained it from its first block: nothing lost, nothing expired, and
    that lease carried one delta, the restarted job's."""
    row = {r["site"]: r for r in crash.admin.ledger()}[SITE]
    assert (row["blocks_lost"], row["ttl_expiries"]) == (0, 0)
    deltas = crash.check_exactly_once()
    (carried,) = [d for d in deltas if d["lease_id"] == lease["lease_id"]]
    assert carried["round_no"] == lease["round"] and carried["site"] == SITE
    assert crash.round_record(lease["round"])["lease_id"] == lease["lease_id"]
    said = (crash.tmp / "second.log").read_text(errors="replace")
    assert f"took over lease {lease['lease_id']}" in said


@pytest.mark.parametrize(
    "crash", [(f"site_mid_fold@{SITE}:2", 20.0)], indirect=True, ids=["mid_fold"]
)
def test_killed_mid_fold_in_the_restarted_job_takes_the_early_lease_over(crash: Crash) -> None:
    # frontier trains round 1 once snellius trains round 2 early; round 1 closes, and
    # snellius dies folding its merged model in
    held = crash.first_job_dies(lambda: early_lease(crash))
    assert crash.delivered(1) and crash.admin.status()["round"] == 2
    (early,) = [x for x in held if x["round"] == 2]
    assert crash.round_record(2) == {}  # the phase never ended
    crash.restart(range(2, ROUNDS + 1))
    check_taken_over(crash, early)


@pytest.mark.parametrize(
    "crash", [(f"site_after_step@{SITE}:2", 20.0)], indirect=True, ids=["after_step"]
)
def test_killed_mid_phase_of_an_early_lease_the_restarted_job_takes_it_over(crash: Crash) -> None:
    # frontier trains round 1 only after snellius died: round 1 open, its merge not begun
    held = crash.first_job_dies(lambda: False)
    assert crash.admin.status()["round"] == 1
    (early,) = [x for x in held if x["round"] == 2]
    assert early["consumed"] == 0  # one step in: no block of it trained to the end
    # round 1's delta is in (or resent): the restarted job trains round 2 at once, taking
    # the early lease over, and frontier trains round 1 only once it has begun
    crash.restart(range(2, ROUNDS + 1), gate_one=lambda: began_early(crash))
    check_taken_over(crash, early)
    said = (crash.tmp / "second.log").read_text(errors="replace")
    assert "folded in generation 1 at step" in said
    # round 1's record says what was trained and accepted: the killed job's own, or the
    # resend's; a restarted job that found the delta in does not overwrite it ("missed")
    first = crash.round_record(1)
    assert first["status"] == "accepted" and first["compute_s"] > 0, first


@pytest.mark.parametrize(
    "crash", [(f"site_awaiting_merge@{SITE}:2", 20.0, 1)], indirect=True, ids=["awaiting_merge"]
)
def test_killed_awaiting_the_merge_the_restarted_job_resumes_the_early_phase(crash: Crash) -> None:
    # frontier trains round 1 only after snellius died: round 1 open, so snellius's early
    # phase of round 2 spent its lead (a quarter of the phase), checkpointed (after every
    # step) and waited
    held = crash.first_job_dies(lambda: False)
    assert crash.admin.status()["round"] == 1
    (early,) = [x for x in held if x["round"] == 2]
    state_dir = crash.tmp / "results" / "sites" / SITE / "state"
    cursor = checkpoint.latest(state_dir)
    assert cursor is not None and (cursor["round"], cursor["status"]) == (2, "training")
    assert cursor["generation"] == -1 and cursor["lease_id"] == early["lease_id"]
    leased = 8 * len(cursor["blocks"])  # blocks of 8 windows
    assert cursor["windows"] == 4 < leased  # one step of four windows in
    kept = state_dir / cursor["folds_from"]  # round 1's end: the weights it sent from
    assert kept.is_dir() and kept.name.startswith("ckpt-r00001-") and "done" in kept.name
    # the restarted job goes on with the early phase at once, round 1 still open; frontier
    # trains round 1 only once it has, and the merged model is folded in when it arrives
    crash.restart(range(2, ROUNDS + 1), gate_one=lambda: began_early(crash, "resuming"))
    record = crash.round_record(2)
    assert record["lease_id"] == early["lease_id"]
    assert record["extra"]["resumed_at_window"] == cursor["windows"]  # not trained again
    assert record["generation"] == 1  # measured against round 1's merged model
    assert record["windows"] == leased and record["steps"] == leased // 4
    said = (crash.tmp / "second.log").read_text(errors="replace")
    assert f"resuming the early phase of lease {early['lease_id']}" in said
    assert f"took over lease {early['lease_id']}" not in said
    row = {r["site"]: r for r in crash.admin.ledger()}[SITE]
    assert (row["blocks_lost"], row["ttl_expiries"]) == (0, 0)
    deltas = crash.check_exactly_once()
    (carried,) = [d for d in deltas if d["lease_id"] == early["lease_id"]]
    assert carried["round_no"] == 2 and carried["steps"] == leased // 4
    assert not kept.exists()  # once folded in, its weights are no longer kept
