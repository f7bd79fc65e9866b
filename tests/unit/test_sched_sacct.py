"""Slurm durations, the sacct walltime discount gamma and per-GPU token rates."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta, timezone

import pandas as pd
import pytest
import yaml

from crossfed.config import (
    SlurmDurationError,
    format_slurm_duration,
    parse_slurm_duration,
)
from crossfed.sched.sacct import (
    JobLogError,
    SacctParseError,
    SlurmTimeError,
    load_job_log,
    parse_sacct,
    parse_slurm_time,
    per_gpu_rates,
    walltime_discount,
)
from tests.helpers import DATA


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("08:00:00", 8 * 3600),
        ("1-02:03:04", 86400 + 2 * 3600 + 3 * 60 + 4),
        ("2-00:00:00", 2 * 86400),
        ("59:59", 59 * 60 + 59),  # sacct MM:SS
        ("00:00:00", 0),
        ("30", 30 * 60),  # sbatch -t minutes
        ("1-12", 86400 + 12 * 3600),  # sbatch -t D-H
        ("1-12:30", 86400 + 12 * 3600 + 30 * 60),  # sbatch -t D-H:M
        ("00:00:01.5", 1.5),
    ],
)
def test_parse_slurm_duration(text: str, seconds: float) -> None:
    assert parse_slurm_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["UNLIMITED", "Partition_Limit", "INFINITE"])
def test_unlimited_durations_are_none(text: str) -> None:
    assert parse_slurm_duration(text) is None


@pytest.mark.parametrize("text", ["", "abc", "1:2:3:4", "-5", "1-", "08:00:00x"])
def test_bad_durations_raise(text: str) -> None:
    with pytest.raises(SlurmDurationError):
        parse_slurm_duration(text)


@pytest.mark.parametrize("seconds", [0, 59, 3600, 28800, 86400, 86400 * 3 + 3661])
def test_format_round_trips(seconds: int) -> None:
    assert parse_slurm_duration(format_slurm_duration(seconds)) == seconds


def test_format_uses_days() -> None:
    assert format_slurm_duration(86400 + 3600) == "1-01:00:00"
    assert format_slurm_duration(8 * 3600) == "08:00:00"


SACCT = """\
101|04:00:00|08:00:00|COMPLETED|2026-11-20T00:00:00|2026-11-20T04:00:00|billing=4,cpu=32,gres/gpu=4,mem=200G,node=1
102|08:00:00|08:00:00|TIMEOUT|2026-11-21T00:00:00|2026-11-21T08:00:00|cpu=32,gres/gpu=4,node=1
103|02:00:00|08:00:00|FAILED|2026-11-22T00:00:00|2026-11-22T02:00:00|cpu=32,gres/gpu=4,node=1
104|1-00:00:00|2-00:00:00|CANCELLED by 1234|2026-11-23T00:00:00|2026-11-24T00:00:00|cpu=64,node=2
105|00:30:00|08:00:00|RUNNING|2026-11-29T10:00:00|Unknown|cpu=32,gres/gpu=4,node=1
106|00:00:00|08:00:00|CANCELLED by 1234|None|2026-11-25T00:00:00|
107|01:00:00|UNLIMITED|COMPLETED|2026-11-25T00:00:00|2026-11-25T01:00:00|cpu=1,node=1
108|01:00:00|08:00:00|COMPLETED|2026-10-01T00:00:00|2026-10-01T01:00:00|cpu=1,node=1
"""
NOW = datetime(2026, 11, 29, 12, 0, 0)


def test_parse_sacct_fields() -> None:
    recs = parse_sacct(SACCT)
    assert [r.job_id for r in recs] == [str(i) for i in range(101, 109)]
    assert recs[0].elapsed_s == 4 * 3600 and recs[0].timelimit_s == 8 * 3600
    assert recs[0].gpus == 4 and recs[3].gpus == 0
    assert recs[4].end is None and recs[5].start is None
    assert recs[6].timelimit_s is None


def test_gamma_ratio_of_sums_over_finished_jobs_in_window() -> None:
    # usable: 101 (4/8 h), 102 (8/8), 103 (2/8), 104 (24/48); 105 running, 106 never
    # started, 107 unlimited, 108 outside the 14-day window.
    d = walltime_discount(parse_sacct(SACCT), NOW, window_s=14 * 86400)
    assert d.jobs == 4 and d.method == "ratio"
    assert d.gamma == pytest.approx((4 + 8 + 2 + 24) / (8 + 8 + 8 + 48))


def test_gamma_median() -> None:
    d = walltime_discount(parse_sacct(SACCT), NOW, method="median")
    assert d.gamma == pytest.approx((0.5 + 0.5) / 2)  # ratios 0.5, 1, 0.25, 0.5


def test_gamma_default_without_enough_history() -> None:
    d = walltime_discount(parse_sacct(SACCT), NOW, window_s=3600)
    assert d.gamma == 1.0 and d.method == "default" and d.jobs == 0


def test_gamma_is_clipped_to_floor() -> None:
    line = "|00:00:01|1-00:00:00|COMPLETED|2026-11-28T00:00:00|2026-11-28T00:00:01|"
    text = "\n".join(f"{i}{line}" for i in range(5))
    assert walltime_discount(parse_sacct(text), NOW, floor=0.05).gamma == 0.05


def test_sacct_wrong_field_count_names_the_line() -> None:
    with pytest.raises(SacctParseError, match="line 2"):
        parse_sacct("1|00:01:00|00:10:00|COMPLETED|||\n2|00:01:00|COMPLETED\n")


def test_sacct_bad_duration_is_a_parse_error() -> None:
    with pytest.raises(SacctParseError, match="line 1"):
        parse_sacct("1|soon|00:10:00|COMPLETED|||\n")


def test_rates_from_history_and_prior() -> None:
    log = pd.DataFrame(
        {
            "site": ["a", "a", "b"],
            "tokens": [1_000_000, 3_000_000, 10],
            "seconds": [100, 100, 0],  # b's only round is unusable
            "gpus": [4, 4, 8],
        }
    )
    rates = per_gpu_rates(log, {"a": 1.0, "b": 7.0, "c": 9.0})
    assert rates["a"].source == "history" and rates["a"].rounds == 2
    assert rates["a"].tokens_per_s_per_gpu == pytest.approx(4_000_000 / 800)
    assert rates["b"].source == "prior" and rates["b"].tokens_per_s_per_gpu == 7.0
    assert rates["c"].tokens_per_s_per_gpu == 9.0


def test_load_job_log_json_and_csv(tmp_path) -> None:
    rows = [{"site": "a", "tokens": 100, "seconds": 10, "gpus": 1}]
    (tmp_path / "log.json").write_text(json.dumps({"rounds": rows}))
    pd.DataFrame(rows).to_csv(tmp_path / "log.csv", index=False)
    for name in ("log.json", "log.csv"):
        df = load_job_log(tmp_path / name)
        assert per_gpu_rates(df, {})["a"].tokens_per_s_per_gpu == 10.0


def test_load_job_log_errors(tmp_path) -> None:
    with pytest.raises(JobLogError, match="not found"):
        load_job_log(tmp_path / "missing.csv")
    (tmp_path / "bad.csv").write_text("site,tokens\na,1\n")
    with pytest.raises(JobLogError, match="missing columns"):
        load_job_log(tmp_path / "bad.csv")
    (tmp_path / "nan.csv").write_text("site,tokens,seconds,gpus\na,lots,1,1\n")
    with pytest.raises(JobLogError, match="tokens"):
        load_job_log(tmp_path / "nan.csv")


# ----------------------------------------------------------------------------- SLURM_TIME_FORMAT

SLURM_DATA = yaml.safe_load((DATA / "slurm" / "sbatch_sacct_2205_2511.yaml").read_text())


@pytest.mark.parametrize("case", SLURM_DATA["times"], ids=lambda c: c["text"])
def test_slurm_times_in_every_time_format(case: dict) -> None:
    got = parse_slurm_time(case["text"], datetime.fromisoformat(case["now"]))
    want = datetime.fromisoformat(case["expect"]) if case["expect"] else None
    assert got == want
    if got is not None:
        assert (got.tzinfo is None) == (want.tzinfo is None)


@pytest.mark.parametrize("case", SLURM_DATA["unreadable_times"], ids=lambda c: c["text"])
def test_unreadable_times_raise_naming_the_text(case: dict) -> None:
    with pytest.raises(SlurmTimeError, match=re.escape(repr(case["text"]))):
        parse_slurm_time(case["text"], NOW)


def test_relative_times_resolve_in_the_cluster_zone() -> None:
    cet = timezone(timedelta(hours=1))
    now = datetime(2026, 12, 1, 23, 30, tzinfo=UTC)  # already 2 December in CET
    assert parse_slurm_time("Tomorr 01:00", now, tz=cet) == datetime(2026, 12, 3, 1, 0, tzinfo=cet)


@pytest.mark.parametrize("case", SLURM_DATA["durations"], ids=lambda c: c["text"])
def test_sacct_durations_of_every_version(case: dict) -> None:
    assert parse_slurm_duration(case["text"]) == case["seconds"]


SACCT_RELATIVE = """\
201|04:00:00|08:00:00|COMPLETED|Ystday 06:00|Ystday 10:00|cpu=32,gres/gpu=4,node=1
202|02:00:00|08:00:00|COMPLETED|06:00:00|08:00:00|cpu=32,gres/gpu=4,node=1
203|1-00:00:00|2-00:00:00|TIMEOUT|25 Nov 10:00|26 Nov 10:00|cpu=64,node=2
204|00:30:00|UNLIMITED|RUNNING|11:30:00|Unknown|cpu=1,node=1
205|01:00:00|Partition_Limit|COMPLETED|26 Nov 01:00|26 Nov 02:00|cpu=1,node=1
"""


def test_sacct_in_relative_format_gives_the_same_gamma_as_iso() -> None:
    iso = "\n".join(
        [
            "201|04:00:00|08:00:00|COMPLETED|2026-11-28T06:00:00|2026-11-28T10:00:00|",
            "202|02:00:00|08:00:00|COMPLETED|2026-11-29T06:00:00|2026-11-29T08:00:00|",
            "203|1-00:00:00|2-00:00:00|TIMEOUT|2026-11-25T10:00:00|2026-11-26T10:00:00|",
            "204|00:30:00|UNLIMITED|RUNNING|2026-11-29T11:30:00|Unknown|",
            "205|01:00:00|Partition_Limit|COMPLETED|2026-11-26T01:00:00|2026-11-26T02:00:00|",
        ]
    )
    rel = parse_sacct(SACCT_RELATIVE, now=NOW)
    assert [r.end for r in rel] == [r.end for r in parse_sacct(iso)]
    assert rel[4].timelimit_s is None and rel[3].end is None
    d = walltime_discount(rel, NOW)
    assert d == walltime_discount(parse_sacct(iso), NOW)
    assert d.jobs == 3 and d.gamma == pytest.approx((4 + 2 + 24) / (8 + 8 + 48))


def test_sacct_times_in_an_unknown_format_skip_the_row_not_the_capture() -> None:
    text = SACCT.replace("2026-11-20T04:00:00", "20.11.2026 04:00")
    recs = parse_sacct(text)
    assert len(recs) == 8 and recs[0].end is None
    assert recs[0].unparsed == ("End='20.11.2026 04:00'",) and recs[1].unparsed == ()
    d = walltime_discount(recs, NOW)
    assert d.unparsed == 1 and d.jobs == 3  # 101 is left out, the other three count
    assert d.gamma == pytest.approx((8 + 2 + 24) / (8 + 8 + 48))
