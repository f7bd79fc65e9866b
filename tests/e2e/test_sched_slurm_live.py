"""The probe and sacct parsers against a real Slurm 22.05, whatever SLURM_TIME_FORMAT says.

The cluster is the single-host one of tests/helpers/slurm_cluster.py, started here without taking
over /etc/slurm/slurm.conf (these commands need no inner srun), so it runs beside another
test cluster on the same host. Every command gets SLURM_CONF explicitly.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from crossfed.config import Shape, SiteConfig
from crossfed.sched.probe import (
    ProbeReason,
    parse_test_only,
    run_test_only,
    sbatch_argv,
    subprocess_runner,
)
from crossfed.sched.sacct import (
    SACCT_FIELDS,
    parse_sacct,
    run_sacct,
    sacct_window_start,
    walltime_discount,
)
from tests.helpers.slurm_cluster import SlurmTestCluster, SlurmUnavailable, free_ports, skip_or_fail

ISO = re.compile(r"to start at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d ")
LUMI = SiteConfig(
    name="lumi",
    ranks=8,
    micro_batch=1,
    accumulation=1,
    tokens_per_s_per_gpu=1.0,
    scheduler="slurm",
    max_walltime_s=600.0,
    qos_max_nodes=2,
    account="crossfed",
    shapes=(Shape("lumi-5m", "lumi", 1, 8, 300.0),),
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmTestCluster]:
    live = SlurmTestCluster(tmp_path_factory.mktemp("slurm"), system_conf=None)
    try:
        live.start()
    except SlurmUnavailable as exc:
        skip_or_fail(exc)
    try:
        yield live
    finally:
        live.stop()


def conf_with_closed_port(cluster: SlurmTestCluster, key: str, folder: Path) -> Path:
    """A copy of the cluster's slurm.conf in ``folder`` whose ``key`` port nothing serves."""
    closed = free_ports(1)[0]
    conf = re.sub(rf"^{key}=\d+$", f"{key}={closed}", cluster.conf_path.read_text(), flags=re.M)
    assert f"{key}={closed}" in conf
    (folder / "slurm.conf").write_text(conf)
    return folder / "slurm.conf"


@pytest.fixture
def caller_env(cluster: SlurmTestCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's environment: this cluster, and times in the relative format."""
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf_path))
    monkeypatch.setenv("SLURM_TIME_FORMAT", "relative")


def test_probe_reads_the_start_whatever_the_callers_time_format(
    cluster: SlurmTestCluster, caller_env: None
) -> None:
    shape = LUMI.shapes[0]
    cluster.wait_idle(30)
    # the caller's setting reaches a plain sbatch: Slurm prints today's start as %H:%M:%S
    plain = subprocess.run(sbatch_argv(LUMI, shape), capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and "to start at" in plain.stderr and not ISO.search(plain.stderr)
    now = datetime.now()
    relative = parse_test_only(plain.stdout, plain.stderr, plain.returncode, now)
    assert relative.ok, relative.detail
    seen: list[tuple[str, str, int]] = []

    def recording(cmd, timeout_s):
        seen.append(subprocess_runner(cmd, timeout_s))
        return seen[-1]

    r = run_test_only(LUMI, shape, now, runner=recording)
    assert r.ok and r.reason is ProbeReason.OK
    assert ISO.search(seen[0][1])  # the runner asked for standard times
    # an idle partition starts the job now: both readings agree to the second
    assert abs(r.est_start - relative.est_start) <= timedelta(seconds=5)
    assert abs(r.est_start - now) <= timedelta(minutes=5)


def test_probe_of_an_unreachable_controller_is_try_later(
    cluster: SlurmTestCluster, caller_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_CONF", str(conf_with_closed_port(cluster, "SlurmctldPort", tmp_path)))
    r = run_test_only(LUMI, LUMI.shapes[0], datetime.now(), timeout_s=120)
    assert not r.ok and r.reason is ProbeReason.TRY_LATER
    assert "Unable to contact slurm controller" in r.detail


def test_sacct_of_a_finished_job_reads_alike_in_relative_and_standard_times(
    cluster: SlurmTestCluster, caller_env: None
) -> None:
    job = cluster.sbatch("-p", "small", "-t", "00:01:00", "--wrap", "sleep 2")
    cluster.wait_job(job, {"COMPLETED"}, 60)
    fields = ["-X", "-P", "-n", "-o", ",".join(SACCT_FIELDS), "-j", job]
    # sacct as the caller would run it: relative times (today's as %H:%M:%S)
    plain = subprocess.run(["sacct", *fields], capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and plain.stdout.strip(), plain.stderr
    assert not re.search(r"\d{4}-\d\d-\d\dT", plain.stdout)
    now = datetime.now()
    relative = [r for r in parse_sacct(plain.stdout, now=now) if r.job_id == job]
    standard = run_sacct(sacct_window_start(now, 3600.0))
    assert re.search(rf"^{job}\|.*\|\d{{4}}-\d\d-\d\dT", standard, flags=re.M)
    iso = [r for r in parse_sacct(standard) if r.job_id == job]
    assert len(relative) == len(iso) == 1
    assert relative[0].start == iso[0].start and relative[0].end == iso[0].end
    assert relative[0].start is not None and relative[0].end >= relative[0].start
    assert relative[0].state == "COMPLETED" and relative[0].timelimit_s == 60.0
    assert walltime_discount(relative, now, min_jobs=1).jobs == 1


def test_probe_of_a_cluster_whose_database_is_unreachable_is_try_later(
    cluster: SlurmTestCluster, caller_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A login node that names its cluster (``SLURM_CLUSTERS``, as ``-M`` does) asks
    slurmdbd first; with slurmdbd unreachable the probe says nothing about the shape."""
    conf = conf_with_closed_port(cluster, "AccountingStoragePort", tmp_path)
    monkeypatch.setenv("SLURM_CONF", str(conf))
    monkeypatch.setenv("SLURM_CLUSTERS", cluster.cluster_name)
    r = run_test_only(LUMI, LUMI.shapes[0], datetime.now(), timeout_s=120)
    assert not r.ok and r.reason is ProbeReason.TRY_LATER, r.detail
    assert "problem talking to the database" in r.detail.lower()


def test_a_job_submit_throttle_is_try_later(cluster: SlurmTestCluster, caller_env: None) -> None:
    """Slurm's own job_submit/throttle plugin refuses a user's jobs past N an hour with its
    text before the generic accounting-policy line: the probe reads it as try later (the
    same shape fits within the hour), not as a policy for a person to check."""
    conf = cluster.conf_path.read_text()
    throttled = conf + "JobSubmitPlugins=throttle\nSchedulerParameters=jobs_per_user_per_hour=1\n"
    try:
        cluster.conf_path.write_text(throttled)
        cluster.run("scontrol", "reconfigure")
        cluster.sbatch("-p", "small", "-t", "00:01:00", "--wrap", "true")  # the hour's one
        r = run_test_only(LUMI, LUMI.shapes[0], datetime.now(), timeout_s=120)
        assert not r.ok and r.reason is ProbeReason.TRY_LATER, r.detail
        assert "Reached jobs per hour limit" in r.detail
    finally:
        cluster.conf_path.write_text(conf)
        cluster.run("scontrol", "reconfigure")
