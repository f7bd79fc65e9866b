"""A site's inner phase against a real coordinator: one round in-process, a job SIGKILLed
mid-phase that resumes from its checkpoint (same lease, no window retrained or skipped), and
a torchrun site whose rank 0 talks to the coordinator."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from crossfed import rowcounts
from crossfed.client.http import CoordinatorClient
from crossfed.config import load_run_config, load_sites
from crossfed.coordinator.runspec import LeasePolicy
from crossfed.darl.blockspace import BlockSpace
from crossfed.data.windows import WindowStore, read_meta
from crossfed.site import SiteRunner, block_end, out_of_time
from crossfed.site.control import Control
from crossfed.site.job import site_settings
from crossfed.train import checkpoint
from crossfed.wire.codecs import open_delta
from tests.conftest import REPO, SITES, LiveCoordinator, tiny_spec, write_yaml
from tests.helpers.lost_reply import LostReply


def site_config(tmp_path: Path, live: LiveCoordinator, data: Path, **inner) -> Path:
    """A run config and sites file for ``live`` (block space of ``tiny_spec``)."""
    sites = yaml.safe_load((REPO / "config" / "sites.yaml").read_text())
    for name, site in sites["sites"].items():
        site.update(ranks=2 if name == "lumi" else 1, micro_batch=4, accumulation=1)
        site.update(slowdown=1.0)
    sites["sites"]["lumi"]["slowdown"] = inner.pop("slowdown", 1.0)
    write_yaml(tmp_path / "sites.yaml", sites)
    config = {
        "results": str(tmp_path / "results"),
        "sites_file": str(tmp_path / "sites.yaml"),
        "data": {"dir": str(data), "block_size": 8, "seed": 7},
        "inner": {"checkpoint_every": 1, **inner},
        "darl": {"heartbeat_s": 0.3, "initial_ttl_s": 5},
        "round_policy": {"join_window_s": 0.5},
        "coordinator": {"url": live.url, "secrets": str(live.state_dir / "secrets.yaml")},
    }
    return write_yaml(tmp_path / "config.yaml", config)


def init(live: LiveCoordinator, data: Path) -> None:
    spec = tiny_spec(
        data,
        sites={name: 2 if name == "lumi" else 1 for name in SITES},
        # the phases as asked: these tests pin step counts (the probe has tests of its own)
        leases=LeasePolicy(min_ttl_s=120.0, initial_ttl_s=120.0, probe_share=1.0),
    )
    live.client().init_run(spec.to_dict())


def ledger_row(live: LiveCoordinator, site: str) -> dict:
    return {row["site"]: row for row in live.client().ledger()}[site]


def test_a_site_round_trains_its_lease_and_commits_it(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    init(coordinator, tiny_data)
    config = load_run_config(site_config(tmp_path, coordinator, tiny_data))
    sites = load_sites(config)
    runner = SiteRunner(site_settings(config, "lumi", sites["lumi"]), coordinator.client("lumi"))
    outcome = runner.run_round(1)
    assert outcome.status == "accepted", outcome.detail
    # H=4 steps of W*A*B = 2*1*4 windows: 4 blocks of 8 windows, trained once each
    assert outcome.steps == 4 and outcome.windows == 32 and outcome.blocks_committed == 4
    assert outcome.tokens == 32 * 32 and outcome.ranks == 2 and outcome.launcher == "simulate"
    assert outcome.mfu is None and outcome.tokens_per_s > 0 and outcome.checkpoint_s > 0
    cursor = checkpoint.latest(tmp_path / "results" / "sites" / "lumi" / "state")
    assert cursor is not None and cursor["status"] == "done" and cursor["windows"] == 32
    row = ledger_row(coordinator, "lumi")
    assert row["blocks_committed"] == 4 and row["blocks_lost"] == 0
    other_job = subprocess.run(  # another job of lumi may not use the folder meanwhile
        [sys.executable, "-c", "import sys; from pathlib import Path; from crossfed.site.lock "
         "import hold_site_folder; hold_site_folder(Path(sys.argv[1]), wait_s=0)",
         str(runner.dir)],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert other_job.returncode != 0 and "SiteBusy" in other_job.stderr, other_job.stderr


def test_a_sites_delta_counts_how_often_each_token_was_an_input_of_the_windows_it_trained(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """The delta a site sends carries, beside its tensors, the count of each token of the
    vocabulary among the inputs of the windows it trained (crossfed.rowcounts): what the
    coordinator weights the embedding's rows by."""
    init(coordinator, tiny_data)
    config = load_run_config(site_config(tmp_path, coordinator, tiny_data))
    runner = SiteRunner(
        site_settings(config, "lumi", load_sites(config)["lumi"]), coordinator.client("lumi")
    )
    outcome = runner.run_round(1)
    assert outcome.status == "accepted", outcome.detail
    with sqlite3.connect(coordinator.state_dir / "state.sqlite") as db:
        (key,) = db.execute("SELECT blob FROM deltas WHERE site = 'lumi'").fetchone()
    algo, _, digest = key.rpartition(":")
    with open_delta(coordinator.state_dir / "blobs" / algo / digest[:2] / digest) as delta:
        counts = delta.row_counts()[rowcounts.count_key(rowcounts.EMBEDDING)]
        assert rowcounts.EMBEDDING in delta.keys()
    cursor = checkpoint.latest(tmp_path / "results" / "sites" / "lumi" / "state")
    assert cursor is not None
    windows = [w for b in cursor["blocks"] for w in runner.space.block_windows(b)]
    store = WindowStore.open(tiny_data, "train")
    expected = rowcounts.token_counts(store.take(np.asarray(windows)), counts.numel())
    assert torch.equal(counts, expected) and int(counts.sum()) == outcome.tokens == 32 * 32


def test_with_background_checkpoints_off_every_checkpoint_is_written_before_training_goes_on(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path, monkeypatch
) -> None:
    """``inner.checkpoint_background: false`` (a node short of host memory for the copy):
    the background writer is never used, and the round still checkpoints and commits."""
    init(coordinator, tiny_data)
    config = load_run_config(
        site_config(tmp_path, coordinator, tiny_data, checkpoint_background=False)
    )
    assert config.inner.checkpoint_background is False
    written: list[str] = []
    foreground = checkpoint.save

    def save(state_dir, model, optimizer, cursor, ranks):
        written.append(cursor["status"])
        path = foreground(state_dir, model, optimizer, cursor, ranks)
        assert checkpoint.latest(state_dir)["path"] == str(path)  # published on return
        return path

    def refuse(*args, **kwargs):
        raise AssertionError("a background checkpoint was started")

    monkeypatch.setattr(checkpoint, "save", save)
    monkeypatch.setattr(checkpoint, "save_in_background", refuse)
    sites = load_sites(config)
    runner = SiteRunner(site_settings(config, "lumi", sites["lumi"]), coordinator.client("lumi"))
    outcome = runner.run_round(1)
    assert outcome.status == "accepted", outcome.detail
    assert written == ["training"] * 3 + ["done"]  # every step but the last, then the end
    cursor = checkpoint.latest(tmp_path / "results" / "sites" / "lumi" / "state")
    assert cursor is not None and cursor["status"] == "done" and cursor["windows"] == 32


def _site_job(tmp_path: Path, config: Path, name: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "crossfed", "site", "run", "--config", str(config)]
    cmd += ["--site", "lumi", "--round", "1", "--out", str(tmp_path / f"{name}.json")]
    log = open(tmp_path / f"{name}.log", "wb")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)


@pytest.mark.slow
def test_a_killed_site_job_resumes_its_lease_from_the_checkpoint(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    init(coordinator, tiny_data)
    config = site_config(tmp_path, coordinator, tiny_data, slowdown=4.0)
    state_dir = tmp_path / "results" / "sites" / "lumi" / "state"
    job = _site_job(tmp_path, config, "first")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        cursor = checkpoint.latest(state_dir) if (state_dir / "latest.json").exists() else None
        if cursor is not None and cursor["status"] == "training":
            break
        assert job.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.05)
    else:
        raise AssertionError("no mid-phase checkpoint appeared")
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=30)
    killed_at = checkpoint.latest(state_dir)
    assert killed_at is not None and 0 < killed_at["windows"] < 32

    again = _site_job(tmp_path, config, "second")
    assert again.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    outcome = json.loads((tmp_path / "second.json").read_text())
    assert outcome["status"] == "accepted", outcome["detail"]
    assert outcome["lease_id"] == killed_at["lease_id"]  # the same lease, continued
    assert outcome["extra"]["resumed_at_window"] == killed_at["windows"]
    assert outcome["windows"] == 32 and outcome["steps"] == 4 and outcome["tokens"] == 32 * 32
    row = ledger_row(coordinator, "lumi")
    assert row["grants"] == 1 and row["blocks_committed"] == 4
    assert row["blocks_lost"] == 0 and row["ttl_expiries"] == 0
    info = coordinator.client().round_info(1)
    assert [d["site"] for d in info["deltas"]] == ["lumi"] and info["deltas"][0]["steps"] == 4


@pytest.mark.slow
def test_a_torchrun_site_trains_with_two_real_ranks(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    init(coordinator, tiny_data)
    config = site_config(tmp_path, coordinator, tiny_data)
    data = yaml.safe_load(config.read_text())
    data["launcher"] = {"kind": "torchrun"}
    write_yaml(config, data)
    job = _site_job(tmp_path, config, "torchrun")
    assert job.wait(timeout=600) == 0, (tmp_path / "torchrun.log").read_text()[-4000:]
    outcome = json.loads((tmp_path / "torchrun.json").read_text())
    assert outcome["status"] == "accepted", outcome["detail"]
    assert outcome["launcher"] == "torchrun" and outcome["windows"] == 32
    assert outcome["blocks_committed"] == 4
    cursor = checkpoint.latest(tmp_path / "results" / "sites" / "lumi" / "state")
    assert cursor is not None and cursor["world"] == 2
    assert ledger_row(coordinator, "lumi")["blocks_committed"] == 4


class Killed(Exception):
    """Stands in for a SIGKILL between a site's final checkpoint and its delta."""


def killed_before_its_delta(
    settings, live: LiveCoordinator, monkeypatch, accumulation: int | None = None
) -> dict:
    """Run lumi's round 1 until its final checkpoint, die before the delta is written, and
    return the checkpoint's cursor."""

    def die(self, pending) -> None:
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(SiteRunner, "_write_pending", die)
        with pytest.raises(Killed):
            SiteRunner(settings, live.client("lumi")).run_round(1, accumulation=accumulation)
    cursor = checkpoint.latest(settings.work_dir / "lumi" / "state")
    assert cursor is not None and cursor["status"] == "done"
    return cursor


def steps_trained(monkeypatch) -> list[int]:
    """The steps each phase of a ``SiteRunner`` trains from here on, beyond its cursor's
    (the real ``_train``, observed)."""
    trained: list[int] = []
    original = SiteRunner._train

    def spy(self, round_no, start, state, beat):
        before = state.steps  # the cursor's steps (the phase mutates this state)
        out = original(self, round_no, start, state, beat)
        trained.append(out.steps - before)
        return out

    monkeypatch.setattr(SiteRunner, "_train", spy)
    return trained


def test_a_job_killed_between_its_final_checkpoint_and_its_delta_sends_without_retraining(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path, monkeypatch
) -> None:
    init(coordinator, tiny_data)
    config = load_run_config(site_config(tmp_path, coordinator, tiny_data))
    settings = site_settings(config, "lumi", load_sites(config)["lumi"])

    cursor = killed_before_its_delta(settings, coordinator, monkeypatch)
    assert cursor is not None and cursor["status"] == "done" and cursor["windows"] == 32

    trained = steps_trained(monkeypatch)
    outcome = SiteRunner(settings, coordinator.client("lumi")).run_round(1)  # the restart
    assert outcome.status == "accepted", outcome.detail
    assert trained == [0] and outcome.extra["resumed_at_window"] == 32
    assert outcome.steps == 4 and outcome.windows == 32 and outcome.blocks_committed == 4
    row = ledger_row(coordinator, "lumi")
    assert row["grants"] == 1 and row["blocks_committed"] == 4 and row["blocks_lost"] == 0


def test_a_job_restarted_after_its_leases_ttl_resumes_its_checkpoint_on_the_lease_revived(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path, monkeypatch
) -> None:
    """A job killed after its final checkpoint comes back only after its lease's TTL ran
    out (a requeue takes longer than a TTL): no other lease took the lease's blocks, so
    the restarted job's heartbeat revives the lease and it sends what the checkpoint
    trained, without training it again; its blocks are committed once."""
    spec = tiny_spec(
        tiny_data,
        sites={name: 2 if name == "lumi" else 1 for name in SITES},
        leases=LeasePolicy(min_ttl_s=4.0, initial_ttl_s=4.0, probe_share=1.0),
    )
    coordinator.client().init_run(spec.to_dict())
    config = load_run_config(site_config(tmp_path, coordinator, tiny_data))
    settings = site_settings(config, "lumi", load_sites(config)["lumi"])
    cursor = killed_before_its_delta(settings, coordinator, monkeypatch)
    deadline = time.monotonic() + 60
    while ledger_row(coordinator, "lumi")["ttl_expiries"] == 0:
        assert time.monotonic() < deadline, "the killed job's lease never expired"
        time.sleep(0.2)
    assert coordinator.client().status()["active_leases"] == []

    trained = steps_trained(monkeypatch)
    outcome = SiteRunner(settings, coordinator.client("lumi")).run_round(1)  # the restart
    assert outcome.status == "accepted", outcome.detail
    assert outcome.lease_id == cursor["lease_id"] and trained == [0]
    assert outcome.extra["resumed_at_window"] == 32 and outcome.blocks_committed == 4
    row = ledger_row(coordinator, "lumi")
    assert (row["grants"], row["blocks_granted"], row["blocks_committed"]) == (1, 8, 4)
    assert (row["blocks_lost"], row["ttl_expiries"]) == (4, 1)  # the expiry, counted


def test_a_checkpoint_that_trained_past_a_steal_is_dropped_not_sent_again_and_again(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path, monkeypatch
) -> None:
    """A steal that races the step loop takes blocks a checkpoint has already trained: the
    restarted job releases that lease and trains the round anew, instead of sending a delta
    that claims more than the lease holds (refused as implausible on every retry)."""
    init(coordinator, tiny_data)
    path = site_config(tmp_path, coordinator, tiny_data)
    data = yaml.safe_load(path.read_text())
    data["darl"]["heartbeat_s"] = 120.0  # the coordinator hears of no progress: stealable
    config = load_run_config(write_yaml(path, data))
    settings = site_settings(config, "lumi", load_sites(config)["lumi"])

    cursor = killed_before_its_delta(settings, coordinator, monkeypatch)
    assert cursor is not None and cursor["status"] == "done" and cursor["windows"] == 32
    # snellius drains the pool (its lease all but trained), so frontier steals from lumi's
    space = BlockSpace(read_meta(tiny_data)["n_windows"], 8, 7)
    for name in ("snellius", "frontier"):
        coordinator.client(name).register(name, space.digest(), 1, 1.0)
    snellius = coordinator.client("snellius")
    drain = snellius.lease("snellius", 1, space.n_blocks, 4.0, 1.0)["lease"]
    snellius.heartbeat(drain["lease_id"], "snellius", drain["n_blocks"] - 1, 4.0)
    stolen = coordinator.client("frontier").lease("frontier", 1, 1, 4.0, 1.0)["lease"]
    assert stolen["blocks"] == cursor["blocks"][2:]  # lumi keeps 2 of its 4 blocks

    outcome = SiteRunner(settings, coordinator.client("lumi")).run_round(1)  # the restart
    assert outcome.status == "accepted", outcome.detail
    assert outcome.lease_id != cursor["lease_id"] and "resumed_at_window" not in outcome.extra
    assert outcome.windows == 16 and outcome.blocks_committed == 2  # the 2 it gave back
    row = ledger_row(coordinator, "lumi")
    assert row["grants"] == 2 and row["blocks_committed"] == 2 and row["blocks_lost"] == 2


def test_a_delta_refused_after_a_steal_the_site_did_not_hear_of_releases_its_lease(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """A steal after the site's last heartbeat takes blocks it then trains anyway: its delta
    claims more than the lease holds and is refused, and the site releases the lease at
    once, so the blocks it kept return to the pool now, not at the lease's TTL (120 s here,
    which the round would otherwise wait for)."""
    init(coordinator, tiny_data)
    path = site_config(tmp_path, coordinator, tiny_data, slowdown=8.0)
    data = yaml.safe_load(path.read_text())
    data["darl"]["heartbeat_s"] = 120.0  # one heartbeat at the phase's start, then none
    config = load_run_config(write_yaml(path, data))
    settings = site_settings(config, "lumi", load_sites(config)["lumi"])
    state_dir = settings.work_dir / "lumi" / "state"
    space = BlockSpace(read_meta(tiny_data)["n_windows"], 8, 7)
    for name in ("snellius", "frontier"):
        coordinator.client(name).register(name, space.digest(), 1, 1.0)
    stolen: list[dict] = []

    def steal_after_the_first_step() -> None:  # lumi's heartbeat has gone: it will not hear
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            cursor = checkpoint.latest(state_dir) if (state_dir / "latest.json").exists() else None
            if cursor is not None and cursor["windows"] > 0:
                snellius = coordinator.client("snellius")
                drain = snellius.lease("snellius", 1, space.n_blocks, 4.0, 1.0)["lease"]
                snellius.heartbeat(drain["lease_id"], "snellius", drain["n_blocks"] - 1, 4.0)
                stolen.append(coordinator.client("frontier").lease("frontier", 1, 1, 4.0, 1.0))
                return
            time.sleep(0.01)

    thief = threading.Thread(target=steal_after_the_first_step)
    thief.start()
    outcome = SiteRunner(settings, coordinator.client("lumi")).run_round(1)
    thief.join()
    assert stolen and stolen[0]["lease"]["n_blocks"] == 2  # lumi's lease keeps 2 of its 4
    assert outcome.status == "lease_lost" and outcome.detail.startswith("bad_progress")
    assert outcome.windows == 32  # it trained all 4 blocks, the 2 stolen ones too
    active = coordinator.client().status()["active_leases"]
    assert outcome.lease_id not in [lease["lease_id"] for lease in active]
    row = ledger_row(coordinator, "lumi")
    assert row["blocks_committed"] == 0 and row["blocks_lost"] == 2 and row["ttl_expiries"] == 0


def test_a_take_over_whose_reply_was_lost_takes_the_lease_over_all_the_same(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """A restarted job takes over its dead predecessor's lease, but the reply is lost: the
    coordinator did take it over (its progress back to 0) and the client's retry, which
    carries the progress the job first saw, is refused ``bad_progress``. The job looks
    again and takes the lease over at the progress it now has, instead of leaving it to
    its TTL (120 s here, which the round would wait for)."""
    init(coordinator, tiny_data)
    config = load_run_config(site_config(tmp_path, coordinator, tiny_data))
    settings = site_settings(config, "lumi", load_sites(config)["lumi"])
    space = BlockSpace(read_meta(tiny_data)["n_windows"], 8, 7)
    dead = coordinator.client("lumi")
    dead.register("lumi", space.digest(), 2, 1.0)
    held = dead.lease("lumi", 1, 4, 1.0, 1.0)["lease"]
    dead.heartbeat(held["lease_id"], "lumi", 3, 1.0)  # then the job dies
    with LostReply(coordinator.port, b"/adopt") as proxy:
        client = CoordinatorClient(
            f"http://127.0.0.1:{proxy.port}", coordinator.secrets["sites"]["lumi"],
            retry_budget_s=10.0,
        )  # fmt: skip
        control = Control(client, settings, space, tmp_path / "lumi")
        reply = control.take_over(1, 1.0)
        assert proxy.lost.is_set()  # the first adoption's reply never came
    assert reply is not None and reply["lease"]["lease_id"] == held["lease_id"]
    assert reply["lease"]["consumed"] == 0 and reply["lease"]["n_blocks"] == 4
    with sqlite3.connect(coordinator.state_dir / "state.sqlite") as conn:
        adopts = conn.execute("SELECT args FROM darl_events WHERE op = 'adopt'").fetchall()
    assert [json.loads(args)["consumed"] for (args,) in adopts] == [3, 0]


def test_a_round_takes_the_plans_accumulation_and_a_resumed_phase_keeps_its_own(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path, monkeypatch
) -> None:
    init(coordinator, tiny_data)
    config = load_run_config(site_config(tmp_path, coordinator, tiny_data))
    settings = site_settings(config, "lumi", load_sites(config)["lumi"])
    assert settings.inner.accumulation == 1

    cursor = killed_before_its_delta(settings, coordinator, monkeypatch, accumulation=2)
    # H=4 steps of W*A*B = 2*2*4 windows: the plan's A=2 sized the lease and the phase
    assert cursor is not None and cursor["accumulation"] == 2 and cursor["windows"] == 64
    # the retried job reads a newer plan (A=3): the phase it resumes keeps A=2
    outcome = SiteRunner(settings, coordinator.client("lumi")).run_round(1, accumulation=3)
    assert outcome.status == "accepted", outcome.detail
    assert outcome.accumulation == 2 and outcome.windows == 64 and outcome.blocks_committed == 8
    assert outcome.extra["resumed_at_window"] == 64
    row = ledger_row(coordinator, "lumi")
    assert row["grants"] == 1 and row["blocks_committed"] == 8 and row["blocks_lost"] == 0


def test_block_end_finishes_the_block_in_progress() -> None:
    sizes = [8, 8, 8, 4]  # windows per leased block, the last one short
    assert [block_end(sizes, done) for done in (0, 1, 8, 9, 16, 25, 28)] == [
        0, 8, 8, 16, 16, 28, 28,
    ]  # fmt: skip


def test_out_of_time_counts_the_next_step() -> None:
    now = time.time()
    assert not out_of_time(None, 1e9)
    assert not out_of_time(now + 60, 10.0)
    assert out_of_time(now + 60, 120.0)  # the next step would end after the stop time
    assert out_of_time(now - 1, None)


def test_a_round_past_its_stop_time_sends_the_blocks_it_trained(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """A chain job's walltime comes mid-phase: the phase ends at a block boundary, the blocks
    trained are committed and the rest of the lease returns to the pool, none lost."""
    init(coordinator, tiny_data)
    config = load_run_config(site_config(tmp_path, coordinator, tiny_data, slowdown=8.0))
    settings = site_settings(config, "lumi", load_sites(config)["lumi"])
    runner = SiteRunner(settings, coordinator.client("lumi"))
    state_dir = tmp_path / "results" / "sites" / "lumi" / "state"

    def walltime_after_the_first_step() -> None:  # the job's clock runs out mid-phase
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if (state_dir / "latest.json").exists():
                cursor = checkpoint.latest(state_dir)
                if cursor is not None and cursor["windows"] > 0:
                    runner.s = replace(runner.s, stop_training_at=time.time() - 1)
                    return
            time.sleep(0.01)

    clock = threading.Thread(target=walltime_after_the_first_step)
    clock.start()
    outcome = runner.run_round(1)
    clock.join()
    assert outcome.status == "accepted", outcome.detail
    assert "walltime" in outcome.detail
    # steps of 8 windows = one block each: it stopped after 1-2 of the lease's 4 blocks
    assert outcome.windows in (8, 16) and outcome.blocks_committed == outcome.windows // 8
    row = ledger_row(coordinator, "lumi")
    # the rest went back to the pool with the commit (the ledger's blocks_lost: returned
    # uncommitted), not by a TTL expiry
    assert row["blocks_committed"] == outcome.blocks_committed
    assert row["blocks_lost"] == 4 - outcome.blocks_committed and row["ttl_expiries"] == 0
    # the commit pooled the untrained rest at once: no lease is left holding it
    assert not coordinator.client().status()["active_leases"]


def test_a_round_that_starts_past_its_stop_time_releases_its_lease(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    init(coordinator, tiny_data)
    config = load_run_config(site_config(tmp_path, coordinator, tiny_data))
    settings = site_settings(config, "lumi", load_sites(config)["lumi"])
    settings = replace(settings, stop_training_at=time.time() - 1)
    outcome = SiteRunner(settings, coordinator.client("lumi")).run_round(1)
    assert outcome.status == "walltime" and outcome.steps == 0
    row = ledger_row(coordinator, "lumi")
    assert row["grants"] == 1 and row["blocks_committed"] == 0
    assert row["blocks_lost"] == row["blocks_granted"] and row["ttl_expiries"] == 0
    assert not coordinator.client().status()["active_leases"]  # released, not left to expire
