"""sbatch --test-only parsing, the probe runner and the probe table."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone

import pytest
import yaml

from crossfed.config import Shape, SiteConfig, SitesConfigError, parse_sites, read_sites_file
from crossfed.sched.probe import (
    LOCAL_DETAIL,
    ProbeReason,
    ProbeTableError,
    append_history,
    collect_probes,
    parse_test_only,
    read_probes,
    run_test_only,
    sbatch_argv,
    subprocess_runner,
    write_probes,
)
from crossfed.sched.slurm_messages import ADVICE, Advice, advice_for
from tests.helpers import DATA

NOW = datetime(2026, 11, 29, 16, 0, 0)
OK_STDERR = (
    "sbatch: Job 8 to start at 2026-11-29T17:30:59 using 1 processors on nodes n1 "
    "in partition gpu\n"
)
FAILURES = {
    "sbatch: error: Batch job submission failed: Requested time limit is invalid "
    "(missing or exceeds some limit)\n": ProbeReason.TIME_LIMIT,
    "allocation failure: Requested time limit is invalid (missing or exceeds some limit)\n": (
        ProbeReason.TIME_LIMIT
    ),
    "sbatch: error: Batch job submission failed: Node count specification invalid\n": (
        ProbeReason.NODE_COUNT
    ),
    "allocation failure: Node count specification invalid\n": ProbeReason.NODE_COUNT,
    "sbatch: error: Batch job submission failed: Requested node configuration is not "
    "available\n": ProbeReason.NODE_CONFIG,
    "allocation failure: Requested node configuration is not available\n": (
        ProbeReason.NODE_CONFIG
    ),
    "sbatch: error: invalid partition specified: nosuch\n": ProbeReason.PARTITION,
    "sbatch: error: Batch job submission failed: Invalid account or account/partition "
    "combination specified\n": ProbeReason.ACCOUNT,
    "sbatch: error: Something nobody has seen before\n": ProbeReason.UNPARSED,
}


def test_parse_ok_estimate() -> None:
    r = parse_test_only("", OK_STDERR, 0, NOW)
    assert r.ok and r.reason is ProbeReason.OK
    assert r.est_start == datetime(2026, 11, 29, 17, 30, 59)
    assert r.wait_s == 5459.0 and r.job_id == "8"


def test_parse_ok_with_warning_lines_and_stdout() -> None:
    r = parse_test_only(OK_STDERR, "sbatch: Warning: something harmless\n", 0, NOW)
    assert r.ok and r.wait_s == 5459.0


def test_start_in_the_past_means_now() -> None:
    assert parse_test_only("", OK_STDERR, 0, NOW + timedelta(hours=5)).wait_s == 0.0


def test_aware_now_reads_cluster_time_in_given_zone() -> None:
    cet = timezone(timedelta(hours=1))
    now = datetime(2026, 11, 29, 15, 0, 0, tzinfo=UTC)
    r = parse_test_only("", OK_STDERR, 0, now, tz=cet)
    assert r.est_start.utcoffset() == timedelta(hours=1)
    assert r.wait_s == pytest.approx(5459.0)  # 17:30:59 CET is 16:30:59 UTC


@pytest.mark.parametrize(("stderr", "reason"), list(FAILURES.items()))
def test_failures_become_typed_reasons(stderr: str, reason: ProbeReason) -> None:
    r = parse_test_only("", stderr, 1, NOW)
    assert not r.ok and r.reason is reason
    assert r.est_start is None and r.wait_s is None
    assert r.detail  # the message is kept for humans


def test_exit_zero_without_estimate_is_unparsed() -> None:
    r = parse_test_only("Submitted batch job 12\n", "", 0, NOW)
    assert r.reason is ProbeReason.UNPARSED and not r.ok


SITE = SiteConfig(
    name="snellius",
    ranks=4,
    micro_batch=2,
    accumulation=1,
    tokens_per_s_per_gpu=12000.0,
    scheduler="slurm",
    max_walltime_s=120 * 3600.0,
    qos_max_nodes=4,
    account="acc1",
    shapes=(Shape("h100-8h", "gpu_h100", 1, 4, 8 * 3600.0),),
)


def test_sbatch_argv_enqueues_nothing() -> None:
    argv = sbatch_argv(SITE, SITE.shapes[0])
    assert argv[:2] == ["sbatch", "--test-only"]
    assert argv[argv.index("-p") + 1] == "gpu_h100" and argv[argv.index("-N") + 1] == "1"
    assert "--gres=gpu:4" in argv and argv[argv.index("-t") + 1] == "08:00:00"
    assert argv[argv.index("-A") + 1] == "acc1" and argv[-2:] == ["--wrap", "true"]


def _raises(exc: BaseException):
    def runner(cmd, timeout_s):
        raise exc

    return runner


def test_runner_missing_sbatch_and_timeout_are_reasons() -> None:
    shape = SITE.shapes[0]
    r = run_test_only(SITE, shape, NOW, runner=_raises(FileNotFoundError("sbatch")))
    assert r.reason is ProbeReason.UNAVAILABLE
    r = run_test_only(SITE, shape, NOW, runner=_raises(subprocess.TimeoutExpired("sbatch", 3)))
    assert r.reason is ProbeReason.TIMEOUT


def test_runner_with_real_missing_binary() -> None:
    r = run_test_only(SITE, SITE.shapes[0], NOW, sbatch="/nonexistent/sbatch")
    assert r.reason is ProbeReason.UNAVAILABLE


def test_collect_probes_table(tmp_path) -> None:
    local = SiteConfig("laptop", 1, 2, 1, 1000.0)
    seen = []

    def runner(cmd, timeout_s):
        seen.append(cmd)
        return "", OK_STDERR, 0

    df = collect_probes({"snellius": SITE, "laptop": local}, NOW, runner=runner)
    assert len(seen) == 1  # the local site runs no sbatch
    assert list(df["site"]) == ["snellius", "laptop"]
    snel, lap = df.iloc[0], df.iloc[1]
    assert snel["ok"] and snel["reason"] == "ok" and snel["wait_s"] == 5459.0
    assert snel["walltime_s"] == 28800.0 and snel["gpus_per_node"] == 4
    assert not lap["ok"] and lap["reason"] == "no_scheduler"
    assert lap["wait_s"] == 0.0 and lap["detail"] == LOCAL_DETAIL

    out = tmp_path / "probe.csv"
    write_probes(df, out)
    back = read_probes(out)
    assert back["ok"].tolist() == [True, False]
    assert back["wait_s"].tolist() == [5459.0, 0.0]
    assert back["probed_at"].iloc[0] == NOW.isoformat()


def test_history_appends_with_one_header(tmp_path) -> None:
    df = collect_probes({"snellius": SITE}, NOW, runner=lambda c, t: ("", OK_STDERR, 0))
    hist = tmp_path / "h" / "history.csv"
    append_history(df, hist)
    append_history(df, hist)
    assert hist.read_text().count("probed_at") == 1
    assert len(read_probes(hist)) == 2


def test_collect_unknown_site_is_an_error() -> None:
    with pytest.raises(SitesConfigError, match="nosuch"):
        collect_probes({"snellius": SITE}, NOW, only=["nosuch"])


def test_read_probes_errors(tmp_path) -> None:
    with pytest.raises(ProbeTableError, match="not found"):
        read_probes(tmp_path / "nope.csv")
    (tmp_path / "bad.csv").write_text("site,ok\nx,True\n")
    with pytest.raises(ProbeTableError, match="missing columns"):
        read_probes(tmp_path / "bad.csv")


SITES_YAML = """
sites:
  snellius:
    ranks: 4
    micro_batch: 2
    accumulation: 1
    rtt_ms: 3
    scheduler: slurm
    max_walltime_h: 120
    qos_max_nodes: 4
    tokens_per_s_per_gpu: 1.2e4
    account: "acc"
    some_future_key: {kept: true}
    shapes:
      - {name: h100-8h, partition: gpu_h100, nodes: 1, gpus_per_node: 4, walltime: "08:00:00"}
  laptop:
    ranks: 1
    micro_batch: 2
    scheduler: none
    tokens_per_s_per_gpu: 1000
"""


def test_load_sites(tmp_path) -> None:
    p = tmp_path / "sites.yaml"
    p.write_text(SITES_YAML)
    sites = read_sites_file(p)
    s = sites["snellius"]
    assert s.has_scheduler and s.max_walltime_s == 120 * 3600 and s.qos_max_nodes == 4
    assert s.tokens_per_s_per_gpu == 12000.0  # YAML 1.1 reads 1.2e4 as a string
    assert s.shapes[0].walltime_s == 8 * 3600 and s.extra["some_future_key"] == {"kept": True}
    assert not sites["laptop"].has_scheduler and sites["laptop"].accumulation == 1


@pytest.mark.parametrize(
    ("site", "message"),
    [
        ({"micro_batch": 2, "tokens_per_s_per_gpu": 1}, "'ranks'"),
        ({"ranks": 0, "micro_batch": 2, "tokens_per_s_per_gpu": 1}, "'ranks' must be >= 1"),
        ({"ranks": 1, "micro_batch": 2, "tokens_per_s_per_gpu": 1, "scheduler": "pbs"}, "pbs"),
        (
            {"ranks": 1, "micro_batch": 2, "tokens_per_s_per_gpu": 1, "scheduler": "slurm"},
            "at least one shape",
        ),
        (
            {
                "ranks": 1,
                "micro_batch": 2,
                "tokens_per_s_per_gpu": 1,
                "scheduler": "slurm",
                "max_walltime_h": 1,
                "qos_max_nodes": 1,
                "shapes": [{"name": "x", "partition": "p", "nodes": 1, "walltime": "soon"}],
            },
            "walltime",
        ),
        (
            {
                "ranks": 1,
                "micro_batch": 2,
                "tokens_per_s_per_gpu": 1,
                "scheduler": "slurm",
                "qos_max_nodes": 1,
                "shapes": [{"name": "x", "partition": "p", "nodes": 1, "walltime": "1:00:00"}],
            },
            "max_walltime_h",
        ),
    ],
)
def test_sites_config_errors_name_the_problem(site: dict, message: str) -> None:
    with pytest.raises(SitesConfigError, match=message):
        parse_sites({"sites": {"s": site}})


def test_sites_file_errors(tmp_path) -> None:
    with pytest.raises(SitesConfigError, match="not found"):
        read_sites_file(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("sites: [\n")
    with pytest.raises(SitesConfigError, match="invalid YAML"):
        read_sites_file(tmp_path / "bad.yaml")
    (tmp_path / "empty.yaml").write_text("other: 1\n")
    with pytest.raises(SitesConfigError, match="'sites:'"):
        read_sites_file(tmp_path / "empty.yaml")


# ----------------------------------------------------------------------------- Slurm 22.05-25.11

SLURM_DATA = yaml.safe_load((DATA / "slurm" / "sbatch_sacct_2205_2511.yaml").read_text())
GENERIC_POLICY = (
    "Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)"
)


@pytest.mark.parametrize("case", SLURM_DATA["start_lines"], ids=lambda c: c["source"][:60])
def test_start_estimates_of_every_version_and_time_format(case: dict) -> None:
    now = datetime.fromisoformat(case["now"])
    r = parse_test_only("", case["stderr"], 0, now)
    assert r.ok and r.reason is ProbeReason.OK, r.detail
    assert r.est_start == datetime.fromisoformat(case["start"]) and r.job_id == case["job"]
    assert r.wait_s == (r.est_start - now).total_seconds()


@pytest.mark.parametrize("case", SLURM_DATA["unreadable_starts"], ids=lambda c: c["raw"])
def test_unreadable_start_time_is_unparsed_with_the_raw_text(case: dict) -> None:
    r = parse_test_only("", case["stderr"], 0, NOW)
    assert not r.ok and r.reason is ProbeReason.UNPARSED
    assert case["raw"] in r.detail and r.est_start is None and r.job_id == case["job"]


@pytest.mark.parametrize("case", SLURM_DATA["refusals"], ids=lambda c: c["name"])
def test_composed_refusals_are_read_by_their_reason(case: dict) -> None:
    r = parse_test_only("", case["stderr"], 1, NOW)
    assert not r.ok and r.reason is ProbeReason(case["reason"])
    assert r.detail and r.est_start is None


ERRNO_CASES = [
    (reason, e) for reason, entries in SLURM_DATA["errno_texts"].items() for e in entries
]


@pytest.mark.parametrize(("reason", "entry"), ERRNO_CASES, ids=[e["errno"] for _, e in ERRNO_CASES])
def test_every_submission_errno_text_has_its_reason(reason: str, entry: dict) -> None:
    expected = ProbeReason(reason)
    for stderr in (
        f"allocation failure: {entry['text']}\n",  # --test-only
        f"sbatch: error: Batch job submission failed: {entry['text']}\n",  # a real submission
    ):
        assert parse_test_only("", stderr, 1, NOW).reason is expected, stderr


LIMIT_CASES = [(r, name) for r, names in SLURM_DATA["limit_names"].items() for name in names]


@pytest.mark.parametrize(("reason", "name"), LIMIT_CASES, ids=[n for _, n in LIMIT_CASES])
def test_every_named_limit_decides_over_the_generic_policy_line(reason: str, name: str) -> None:
    stderr = f"sbatch: error: {name}\nallocation failure: {GENERIC_POLICY}\n"
    r = parse_test_only("", stderr, 1, NOW)
    assert r.reason is ProbeReason(reason)
    assert name in r.detail  # the limit Slurm named is kept for humans


def test_node_and_gres_limits_are_not_time_limits() -> None:
    # the generic policy line contains "time limits"; only the named limit may decide
    for name in ("QOSMaxNodePerJobLimit", "QOSMaxGRESPerJob", "AssocMaxJobsLimit"):
        stderr = f"sbatch: error: {name}\nallocation failure: {GENERIC_POLICY}\n"
        assert parse_test_only("", stderr, 1, NOW).reason is not ProbeReason.TIME_LIMIT


def test_every_reason_maps_to_an_advice() -> None:
    assert set(ADVICE) == set(ProbeReason)
    assert advice_for("time_limit") is Advice.SHORTEN_WALLTIME
    assert advice_for("something_a_newer_crossfed_wrote") is Advice.CHECK


def test_runner_gives_slurm_standard_times_whatever_the_caller_set(monkeypatch) -> None:
    monkeypatch.setenv("SLURM_TIME_FORMAT", "relative")
    stdout, _, rc = subprocess_runner(
        [sys.executable, "-c", "import os; print(os.environ['SLURM_TIME_FORMAT'])"], 30
    )
    assert rc == 0 and stdout.strip() == "standard"
    assert os.environ["SLURM_TIME_FORMAT"] == "relative"  # the caller's own is untouched
