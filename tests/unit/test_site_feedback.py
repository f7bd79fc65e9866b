"""Error feedback as site state, against a real coordinator: the residual of an accepted int4
delta is carried into the next one, survives a SIGKILLed job (mid-phase, and between the
written delta and its commit), and a site that rejoins after missed rounds drops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from crossfed.config import load_run_config, load_sites
from crossfed.site import SiteRunner, SiteSettings
from crossfed.site.job import site_settings
from crossfed.train import checkpoint
from tests.conftest import REPO, LiveCoordinator, write_yaml
from tests.unit.test_site_inner import init, site_config


def feedback_config(tmp_path: Path, live: LiveCoordinator, data: Path, **inner) -> Path:
    """The site tests' config with int4 deltas and error feedback switched on."""
    path = site_config(tmp_path, live, data, **inner)
    config = yaml.safe_load(path.read_text())
    config["transport"] = {"compress": "int4", "error_feedback": True}
    return write_yaml(path, config)


def settings_of(config: Path, site: str) -> SiteSettings:
    run = load_run_config(config)
    return site_settings(run, site, load_sites(run)[site])


def residual_tag(state_dir: Path) -> tuple[int, int]:
    """(round, generation) in the committed residual's header."""
    with safe_open(str(state_dir / checkpoint.RESIDUAL), framework="pt") as handle:
        meta = handle.metadata()
    return int(meta[checkpoint.ROUND_KEY]), int(meta[checkpoint.GENERATION_KEY])


def wait_generation(live: LiveCoordinator, generation: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if live.client().status()["generation"] >= generation:
            return
        time.sleep(0.1)
    raise AssertionError(f"generation {generation} was not published")


def test_settings_read_the_codec_and_the_feedback_switch(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    settings = settings_of(feedback_config(tmp_path, coordinator, tiny_data), "lumi")
    assert settings.compress == "int4" and settings.error_feedback is True
    (tmp_path / "plain").mkdir()
    plain = settings_of(site_config(tmp_path / "plain", coordinator, tiny_data), "lumi")
    assert plain.compress == "none" and plain.error_feedback is False


def site_job(tmp_path: Path, config: Path, name: str, round_no: int) -> subprocess.Popen:
    """``crossfed site run`` of lumi for ``round_no`` as its own process."""
    cmd = [sys.executable, "-m", "crossfed", "site", "run", "--config", str(config)]
    cmd += ["--site", "lumi", "--round", str(round_no), "--out", str(tmp_path / f"{name}.json")]
    log = open(tmp_path / f"{name}.log", "wb")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)


def finished(tmp_path: Path, job: subprocess.Popen, name: str) -> dict:
    assert job.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    outcome = json.loads((tmp_path / f"{name}.json").read_text())
    assert outcome["status"] == "accepted", outcome["detail"]
    return outcome


@pytest.mark.slow
def test_the_residual_survives_a_sigkilled_job_and_goes_into_the_resumed_delta(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    init(coordinator, tiny_data)
    config = feedback_config(tmp_path, coordinator, tiny_data, slowdown=4.0)
    state_dir = settings_of(config, "lumi").work_dir / "lumi" / "state"
    first = finished(tmp_path, site_job(tmp_path, config, "first", 1), "first")
    assert first["extra"]["residual"] == "none"  # nothing to carry into a first delta
    assert residual_tag(state_dir) == (1, 0)
    residual = load_file(str(state_dir / checkpoint.RESIDUAL))
    assert all(v.dtype == torch.float32 for v in residual.values())
    assert any(bool(v.abs().sum() > 0) for v in residual.values())  # int4 drops something
    kept = (state_dir / checkpoint.RESIDUAL).read_bytes()
    wait_generation(coordinator, 1)

    job = site_job(tmp_path, config, "killed", 2)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        cursor = checkpoint.latest(state_dir)
        if cursor is not None and cursor["round"] == 2 and cursor["status"] == "training":
            break
        assert job.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        time.sleep(0.05)
    else:
        raise AssertionError("no mid-phase checkpoint of round 2 appeared")
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=30)
    assert (state_dir / checkpoint.RESIDUAL).read_bytes() == kept  # untouched by the kill

    outcome = finished(tmp_path, site_job(tmp_path, config, "resumed", 2), "resumed")
    assert outcome["extra"]["resumed_at_window"] > 0
    assert outcome["extra"]["residual"] == "carried"
    assert residual_tag(state_dir) == (2, 1)  # the new residual, of the delta from gen 1
    assert (state_dir / checkpoint.RESIDUAL).read_bytes() != kept
    assert not list(state_dir.parent.glob("residual-r*"))  # no candidate left over


class Killed(Exception):
    pass


def test_a_job_killed_before_its_commit_resends_and_commits_its_residual_once(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path, monkeypatch
) -> None:
    init(coordinator, tiny_data)
    settings = settings_of(feedback_config(tmp_path, coordinator, tiny_data), "lumi")
    state_dir, site_dir = settings.work_dir / "lumi" / "state", settings.work_dir / "lumi"
    runner = SiteRunner(settings, coordinator.client("lumi"))

    def die(self, pending, outcome, *, fresh: bool) -> None:
        raise Killed  # the job ends right after the pending record

    with monkeypatch.context() as patch:
        patch.setattr(SiteRunner, "_send", die)
        with pytest.raises(Killed):
            runner.run_round(1)
    assert not (state_dir / checkpoint.RESIDUAL).exists()  # not accepted: not committed yet
    pending = json.loads((site_dir / "pending.json").read_text())
    candidate = Path(pending["residual"])
    made = load_file(str(candidate))

    outcome = SiteRunner(settings, coordinator.client("lumi")).run_round(1)  # the restart
    assert outcome.status == "accepted" and outcome.extra["resumed"] is True
    assert not candidate.exists() and not (site_dir / "pending.json").exists()
    committed = load_file(str(state_dir / checkpoint.RESIDUAL))
    assert committed.keys() == made.keys()
    assert all(torch.equal(committed[k], made[k]) for k in made)  # the one made with the delta
    assert residual_tag(state_dir) == (1, 0)


def test_a_site_that_rejoins_after_missed_rounds_drops_its_residual(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    init(coordinator, tiny_data)
    config = feedback_config(tmp_path, coordinator, tiny_data)
    lumi, snellius = settings_of(config, "lumi"), settings_of(config, "snellius")
    lumi_state = lumi.work_dir / "lumi" / "state"
    lumi_runner = SiteRunner(lumi, coordinator.client("lumi"))
    assert lumi_runner.run_round(1).status == "accepted"
    assert residual_tag(lumi_state) == (1, 0)
    wait_generation(coordinator, 1)

    snellius_runner = SiteRunner(snellius, coordinator.client("snellius"))
    alone = snellius_runner.run_round(2)  # lumi sits round 2 out
    assert alone.status == "accepted" and alone.extra["residual"] == "none"
    wait_generation(coordinator, 2)

    back = lumi_runner.run_round(3)
    assert back.status == "accepted", back.detail
    assert back.extra["residual"].startswith("dropped: it trailed the delta of round 1")
    assert "starts from generation 2" in back.extra["residual"]
    assert residual_tag(lumi_state) == (3, 2)  # a fresh residual, carried next round
    wait_generation(coordinator, 3)
    assert lumi_runner.run_round(4).extra["residual"] == "carried"
