"""The single-host Slurm 22.05 test cluster behaves like the sites crossfed schedules on."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.helpers.slurm_cluster import (
    DATA_FILE,
    DEFAULT_PARTITIONS,
    TEST_ONLY_CASES,
    Capture,
    ClusterPaths,
    ClusterPorts,
    PartitionSpec,
    SlurmCommandError,
    SlurmLayoutError,
    SlurmTestCluster,
    SlurmUnavailable,
    capture_test_only,
    check_available,
    load_captures,
    normalise,
    parse_captures,
    render_captures,
    render_gres_conf,
    render_slurm_conf,
    skip_or_fail,
    slurm_cluster_fixture,
    validate_layout,
)

slurm_cluster = slurm_cluster_fixture()
WRAP = "sleep 1; echo hi"

ESTIMATE_RE = re.compile(
    r"^sbatch: Job (?P<job>\d+) to start at (?P<start>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d) "
    r"using (?P<cpus>\d+) processors on nodes (?P<nodes>\S+) in partition (?P<part>\S+)$"
)


def _ports() -> ClusterPorts:
    return ClusterPorts(
        mariadb=1,
        slurmdbd=2,
        slurmctld=3,
        slurmd={"n1": 11, "n2": 12, "n3": 13, "n4": 14, "n5": 15},
    )


# ---- pure parts (no daemons) ---------------------------------------------------------------


def test_rendered_slurm_conf_holds_both_sites_with_their_walltime_caps(tmp_path: Path) -> None:
    conf = render_slurm_conf("crossfed", DEFAULT_PARTITIONS, ClusterPaths(tmp_path), _ports())
    assert conf.startswith(f"# crossfed-test-cluster workdir={tmp_path}\n")
    assert "PartitionName=lumi Nodes=n1,n2 MaxTime=00:10:00 Default=YES State=UP" in conf
    assert "PartitionName=snellius Nodes=n3,n4 MaxTime=00:30:00 Default=NO State=UP" in conf
    assert re.search(r"^NodeName=n2 .*Port=12 .*Gres=gpu:mi250x:8 ", conf, re.M)
    assert re.search(r"^NodeName=n4 .*Port=14 .*Gres=gpu:h100:4 ", conf, re.M)
    for key in ("EnforcePartLimits=ALL", "MailProg=/bin/true", "GresTypes=gpu"):
        assert key in conf.splitlines()
    sock = tmp_path / "munge" / "munge.socket"
    assert f"AuthInfo=socket={sock}" in conf and f"AccountingStoragePass={sock}" in conf


def test_rendered_gres_conf_points_fake_gpus_at_per_node_files(tmp_path: Path) -> None:
    gres = render_gres_conf(DEFAULT_PARTITIONS, ClusterPaths(tmp_path))
    assert f"NodeName=n1 Name=gpu Type=mi250x File={tmp_path}/dev/n1/nvidia[0-7]" in gres
    assert f"NodeName=n3 Name=gpu Type=h100 File={tmp_path}/dev/n3/nvidia[0-3]" in gres


def test_gpu_less_partition_gets_no_gres() -> None:
    layout = {"cpu": PartitionSpec(nodes=("c1",), max_time="5")}
    conf = render_slurm_conf(
        "x", layout, ClusterPaths(Path("/w")), ClusterPorts(1, 2, 3, {"c1": 4})
    )
    assert "Gres=" not in conf
    assert render_gres_conf(layout, ClusterPaths(Path("/w"))) == "AutoDetect=off\n"


def test_a_work_directory_too_long_for_the_step_sockets_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    deep = tmp_path / ("d" * 60)
    with pytest.raises(SlurmLayoutError, match=r"too long for Slurm's unix sockets \(\d+ bytes"):
        SlurmTestCluster(deep)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({}, "at least one partition"),
        (
            {
                "a": PartitionSpec(nodes=("n1",), max_time="5"),
                "b": PartitionSpec(nodes=("n1",), max_time="5"),
            },
            "node n1 is in both a and b",
        ),
        ({"Bad-Name": PartitionSpec(nodes=("n1",), max_time="5")}, "partition name"),
        (
            {
                "a": PartitionSpec(nodes=("n1",), max_time="5", default=True),
                "b": PartitionSpec(nodes=("n2",), max_time="5", default=True),
            },
            "more than one partition",
        ),
    ],
)
def test_bad_layouts_are_rejected_with_the_reason(
    layout: dict[str, PartitionSpec], message: str
) -> None:
    with pytest.raises(SlurmLayoutError, match=message):
        validate_layout(layout)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nodes": (), "max_time": "5"}, "at least one node"),
        ({"nodes": ("n1",), "max_time": "ten minutes"}, "max_time"),
        ({"nodes": ("N 1",), "max_time": "5"}, "node name"),
        ({"nodes": ("n1", "n1"), "max_time": "5"}, "duplicate node"),
        ({"nodes": ("n1",), "max_time": "5", "gpus_per_node": -1}, "positive"),
    ],
)
def test_bad_partition_specs_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(SlurmLayoutError, match=message):
        PartitionSpec(**kwargs)  # type: ignore[arg-type]


def test_missing_binaries_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.helpers.slurm_cluster.find_binary", lambda name: None)
    with pytest.raises(SlurmUnavailable, match=r"missing .*slurmctld.*install-system-deps\.sh"):
        check_available()


@pytest.mark.parametrize(("ci", "outcome"), [("true", "fail"), ("", "skip")])
def test_unavailable_cluster_skips_locally_but_fails_in_ci(
    monkeypatch: pytest.MonkeyPatch, ci: str, outcome: str
) -> None:
    monkeypatch.setenv("CI", ci)
    expected = pytest.fail.Exception if outcome == "fail" else pytest.skip.Exception
    with pytest.raises(expected, match="no slurmctld"):
        skip_or_fail(SlurmUnavailable("no slurmctld"))


def test_foreign_system_slurm_conf_is_refused_not_overwritten(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    tmp_path = tmp_path_factory.mktemp("foreign")  # short enough for the step sockets
    foreign = tmp_path / "slurm.conf"
    foreign.write_text("ClusterName=production\n")
    cluster = SlurmTestCluster(tmp_path / "c", system_conf=foreign)
    with pytest.raises(SlurmUnavailable, match="belongs to another Slurm setup"):
        cluster.preflight()
    assert foreign.read_text() == "ClusterName=production\n"


def test_captures_round_trip_through_the_data_file_format() -> None:
    caps = [
        Capture("a", ("sbatch", "--wrap", "sleep 1; echo hi"), 0, "", "line one\n"),
        Capture("b", ("sacct", "-P"), 1, "x|y\n1|2\n", ""),
    ]
    assert list(parse_captures(render_captures(caps)).values()) == caps


def test_data_file_holds_every_test_only_case() -> None:
    captures = load_captures(DATA_FILE)
    assert set(TEST_ONLY_CASES) <= set(captures)
    assert captures["test_only_walltime_too_long"].returncode != 0
    assert ESTIMATE_RE.match(captures["test_only_ok_lumi"].stderr.strip())


# ---- the live cluster ----------------------------------------------------------------------


@pytest.mark.slurm
def test_every_partition_is_up_and_idle(slurm_cluster: SlurmTestCluster) -> None:
    out = slurm_cluster.run("sinfo", "-h", "-o", "%P|%a|%l|%D|%T|%G").stdout
    rows = {line.split("|")[0]: line.split("|")[1:] for line in out.splitlines()}
    assert rows == {
        "lumi*": ["up", "10:00", "2", "idle", "gpu:mi250x:8"],
        "snellius": ["up", "30:00", "2", "idle", "gpu:h100:4"],
        "small": ["up", "30:00", "1", "idle", "(null)"],
    }


@pytest.mark.slurm
def test_cluster_config_is_reachable_without_slurm_conf(slurm_cluster: SlurmTestCluster) -> None:
    assert os.environ["SLURM_CONF"] == str(slurm_cluster.conf_path)
    system = slurm_cluster.system_conf
    assert system is not None
    assert system.read_text() == slurm_cluster.conf_path.read_text()
    env = {k: v for k, v in slurm_cluster.env.items() if k != "SLURM_CONF"}
    out = subprocess.run(
        ["sinfo", "-h", "-o", "%P"], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["lumi*", "snellius", "small"]


@pytest.mark.slurm
@pytest.mark.parametrize(
    ("args", "part", "nodes"),
    [
        (("-p", "lumi", "-N", "1", "--gres=gpu:8", "-t", "00:10:00"), "lumi", "n1"),
        (("-p", "snellius", "-N", "2", "--gres=gpu:4", "-t", "00:30:00"), "snellius", "n[3-4]"),
    ],
)
def test_test_only_prints_estimated_start_for_valid_shape(
    slurm_cluster: SlurmTestCluster, args: tuple[str, ...], part: str, nodes: str
) -> None:
    res = slurm_cluster.run("sbatch", "--test-only", *args, "--wrap", "true")
    assert res.stdout == ""
    match = ESTIMATE_RE.match(res.stderr.strip())
    assert match, res.stderr
    assert (match["part"], match["nodes"]) == (part, nodes)
    start = datetime.fromisoformat(match["start"])
    assert abs(start - datetime.now()) < timedelta(minutes=1)


@pytest.mark.slurm
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("-p", "lumi", "-t", "00:20:00"),
            "allocation failure: Requested time limit is invalid (missing or exceeds some limit)",
        ),
        (
            ("-p", "snellius", "-t", "00:30:01"),
            "allocation failure: Requested time limit is invalid (missing or exceeds some limit)",
        ),
        (
            ("-p", "nosuch", "-t", "00:05:00"),
            "sbatch: error: invalid partition specified: nosuch\n"
            "allocation failure: Invalid partition name specified",
        ),
    ],
)
def test_test_only_rejects_overlong_walltime_and_unknown_partition(
    slurm_cluster: SlurmTestCluster, args: tuple[str, ...], message: str
) -> None:
    res = slurm_cluster.run("sbatch", "--test-only", *args, "--wrap", "true", check=False)
    assert res.returncode == 1
    assert res.stderr.strip() == message


@pytest.mark.slurm
def test_busy_partition_pushes_estimated_start_past_the_running_job(
    slurm_cluster: SlurmTestCluster,
) -> None:
    hold_args = ("-p", "lumi", "-N", "2", "--exclusive", "-t", "00:10:00", "--wrap", "sleep 600")
    hold = slurm_cluster.sbatch(*hold_args)
    try:
        slurm_cluster.wait_job(hold, {"RUNNING"}, 30)
        busy = _estimated_start(slurm_cluster, "lumi")
        idle = _estimated_start(slurm_cluster, "snellius")
    finally:
        slurm_cluster.run("scancel", hold)
    assert busy - idle >= timedelta(minutes=9), (busy, idle)
    slurm_cluster.wait_idle(30)


def _estimated_start(cluster: SlurmTestCluster, partition: str) -> datetime:
    res = cluster.run("sbatch", "--test-only", "-p", partition, "-t", "5", "--wrap", "true")
    match = ESTIMATE_RE.match(res.stderr.strip())
    assert match, res.stderr
    return datetime.fromisoformat(match["start"])


@pytest.mark.slurm
def test_live_outputs_match_the_captured_data_file(slurm_cluster: SlurmTestCluster) -> None:
    stored = load_captures(DATA_FILE)
    for live in capture_test_only(slurm_cluster):
        want = stored[live.name]
        assert (live.argv, live.returncode) == (want.argv, want.returncode), live.name
        assert normalise(live.stderr) == normalise(want.stderr), live.name
        assert normalise(live.stdout) == normalise(want.stdout), live.name


@pytest.mark.slurm
def test_batch_job_completes_and_is_accounted(
    slurm_cluster: SlurmTestCluster, tmp_path: Path
) -> None:
    out = tmp_path / "job.out"
    job = slurm_cluster.sbatch("-p", "lumi", "-t", "00:05:00", "-o", str(out), "--wrap", WRAP)
    assert slurm_cluster.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED"
    assert out.read_text() == "hi\n"
    fields = "JobID,Partition,Account,State,ExitCode,Elapsed,Timelimit"
    res = slurm_cluster.run("sacct", "-X", "-P", "-j", job, "-o", fields).stdout.splitlines()
    assert res[0] == "JobID|Partition|Account|State|ExitCode|Elapsed|Timelimit"
    jobid, part, account, state, exit_code, elapsed, limit = res[1].split("|")
    expected = (job, "lumi", "crossfed", "COMPLETED", "0:0", "00:05:00")
    assert (jobid, part, account, state, exit_code, limit) == expected, (
        slurm_cluster.run("sacct", "-P", "-j", job, "-o", "ALL").stdout,
        slurm_cluster.run("scontrol", "show", "job", job, check=False).stdout,
    )
    assert re.fullmatch(r"00:00:0[1-9]", elapsed), elapsed


@pytest.mark.slurm
def test_scancel_of_running_job_shows_cancelled_in_sacct(slurm_cluster: SlurmTestCluster) -> None:
    job = slurm_cluster.sbatch("-p", "snellius", "-t", "00:30:00", "--wrap", "sleep 600")
    slurm_cluster.wait_job(job, {"RUNNING"}, 30)
    slurm_cluster.run("scancel", job)
    assert slurm_cluster.wait_job(job, {"CANCELLED"}, 30) == "CANCELLED"
    state = slurm_cluster.run("sacct", "-X", "-n", "-P", "-j", job, "-o", "State").stdout
    assert state.strip() == "CANCELLED by 0"


@pytest.mark.slurm
def test_srun_spans_two_nodes(slurm_cluster: SlurmTestCluster) -> None:
    script = "echo $SLURMD_NODENAME $SLURM_PROCID"
    res = slurm_cluster.run("srun", "-p", "snellius", "-N2", "-n2", "-t1", "bash", "-c", script)
    assert sorted(res.stdout.splitlines()) == ["n3 0", "n4 1"]


@pytest.mark.slurm
def test_inner_srun_in_a_batch_job_works_without_slurm_conf(
    slurm_cluster: SlurmTestCluster, tmp_path: Path
) -> None:
    out = tmp_path / "inner.out"
    script = "env -u SLURM_CONF srun -N 2 bash -c 'echo $SLURMD_NODENAME'"
    job = slurm_cluster.sbatch("-p", "lumi", "-N", "2", "-t", "1", "-o", str(out), "--wrap", script)
    assert slurm_cluster.wait_job(job, {"COMPLETED", "FAILED"}) == "COMPLETED", out.read_text()
    assert sorted(out.read_text().split()) == ["n1", "n2"]


@pytest.mark.slurm
def test_gres_gpus_set_visible_device_indices(slurm_cluster: SlurmTestCluster) -> None:
    """task/none + /dev/null files: Slurm 22.05 exports the allocated indices, counted from 0."""
    script = "env | grep -E '^(CUDA|ROCR)_VISIBLE_DEVICES|^GPU_DEVICE_ORDINAL|^SLURM_.*GPUS'"
    res = slurm_cluster.run("srun", "-p", "lumi", "--gres=gpu:2", "-t", "1", "bash", "-c", script)
    env = dict(line.split("=", 1) for line in res.stdout.splitlines())
    assert env == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "ROCR_VISIBLE_DEVICES": "0,1",
        "GPU_DEVICE_ORDINAL": "0,1",
        "SLURM_STEP_GPUS": "0,1",
        "SLURM_GPUS_ON_NODE": "2",
    }


@pytest.mark.slurm
def test_failed_command_error_carries_stderr(slurm_cluster: SlurmTestCluster) -> None:
    with pytest.raises(SlurmCommandError, match="invalid partition specified: nosuch"):
        slurm_cluster.run("sbatch", "-p", "nosuch", "--wrap", "true")


@pytest.mark.slurm
@pytest.mark.slow
def test_stop_kills_daemons_and_jobs_and_cleans_up(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    layout = {"solo": PartitionSpec(("s1",), max_time="00:05:00", gpus_per_node=1, default=True)}
    tmp_path = tmp_path_factory.mktemp("stop")  # short: the job's step socket lives under it
    cluster = SlurmTestCluster(tmp_path / "solo", layout, system_conf=None)
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        skip_or_fail(exc)
    try:
        job = cluster.sbatch("-t", "5", "--wrap", "exec sleep 600")
        cluster.wait_job(job, {"RUNNING"}, 30)
        job_pids = _pids_with_env(f"SLURM_JOB_ID={job}")
        daemon_pids = list(cluster.daemon_pids.values())
        ports = cluster.ports
    finally:
        cluster.stop()

    assert job_pids and len(daemon_pids) == 5 and ports is not None
    assert not [pid for pid in job_pids + daemon_pids if _running(pid)]
    for port in (ports.mariadb, ports.slurmdbd, ports.slurmctld, *ports.slurmd.values()):
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, port
    remaining = sorted(p.name for p in (tmp_path / "solo").iterdir())
    assert remaining == ["etc", "jobs", "log"]
    assert "slurmctld.log" in cluster.logs()


def _running(pid: int) -> bool:
    """True for a live process; False when gone or a zombie awaiting its reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _pids_with_env(needle: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle.encode() in environ:
                pids.append(int(entry.name))
    return pids
