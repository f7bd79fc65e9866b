"""`crossfed probe` / `crossfed plan [simulate]` through add_parsers and argparse."""

from __future__ import annotations

import argparse
import json
import os
import stat
from datetime import datetime
from pathlib import Path

import pytest

from crossfed.sched.commands import add_parsers
from crossfed.sched.planner import read_plan
from crossfed.sched.probe import read_probes

SCENARIOS = Path(__file__).resolve().parents[2] / "config" / "scenarios"

SITES = """
sites:
  snellius:
    ranks: 4
    micro_batch: 2
    scheduler: slurm
    max_walltime_h: 120
    qos_max_nodes: 4
    tokens_per_s_per_gpu: 12000
    account: acc
    shapes:
      - {name: h100-8h, partition: gpu_h100, nodes: 1, gpus_per_node: 4, walltime: "08:00:00"}
      - {name: h100-5d, partition: gpu_h100, nodes: 1, gpus_per_node: 4, walltime: "5-00:00:00"}
  lumi:
    ranks: 8
    micro_batch: 2
    scheduler: slurm
    max_walltime_h: 48
    qos_max_nodes: 4
    tokens_per_s_per_gpu: 5000
    account: project_x
    shapes:
      - {name: mi250-1h, partition: standard-g, nodes: 1, gpus_per_node: 8, walltime: "01:00:00"}
  laptop:
    ranks: 1
    micro_batch: 2
    scheduler: none
    tokens_per_s_per_gpu: 1000
planner:
  target_tokens: 1.0e+10
  tokens_per_unit: 1.0e+6
  units_per_round: 100
"""

FAKE_SBATCH = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls.log"
case "$*" in
  *5-00:00:00*)
    echo "sbatch: error: Batch job submission failed: Requested time limit is invalid \
(missing or exceeds some limit)" >&2; exit 1;;
  *gpu_h100*)
    echo "sbatch: Job 8 to start at 2026-11-29T17:30:59 using 1 processors on nodes n1 \
in partition gpu_h100" >&2; exit 0;;
  *)
    echo "sbatch: Job 9 to start at 2026-11-29T20:00:00 using 1 processors on nodes n1 \
in partition standard-g" >&2; exit 0;;
esac
"""


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="crossfed")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def site_dir(tmp_path: Path) -> Path:
    (tmp_path / "sites.yaml").write_text(SITES)
    sb = tmp_path / "sbatch"
    sb.write_text(FAKE_SBATCH)
    sb.chmod(sb.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def test_registers_probe_and_plan_with_simulate() -> None:
    parser = argparse.ArgumentParser(prog="crossfed")
    add_parsers(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["probe", "--sites", "s.yaml", "--out", "p.csv"])
    b = parser.parse_args(["plan", "--sites", "s", "--probes", "p", "--out", "o", "--round", "3"])
    c = parser.parse_args(["plan", "simulate", "x.yaml", "--json"])
    assert a.func.__name__ == "cmd_probe"
    assert b.func.__name__ == "cmd_plan" and b.round == 3
    assert c.func.__name__ == "cmd_simulate" and c.scenario == "x.yaml" and c.json


def test_probe_then_plan_round_trip(site_dir: Path, capsys) -> None:
    d = site_dir
    rc = run(
        [
            "probe",
            "--sites", str(d / "sites.yaml"),
            "--out", str(d / "probe.csv"),
            "--history", str(d / "hist.csv"),
            "--now", "2026-11-29T16:00:00",
            "--sbatch", str(d / "sbatch"),
        ]
    )  # fmt: skip
    assert rc == 0
    calls = (d / "calls.log").read_text().splitlines()
    assert len(calls) == 3 and all(c.startswith("--test-only") for c in calls)
    table = read_probes(d / "probe.csv")
    reasons = dict(zip(table["shape"], table["reason"], strict=True))
    assert reasons == {
        "h100-8h": "ok",
        "h100-5d": "time_limit",
        "mi250-1h": "ok",
        "": "no_scheduler",
    }
    assert len(read_probes(d / "hist.csv")) == 4

    rc = run(
        [
            "plan",
            "--sites", str(d / "sites.yaml"),
            "--probes", str(d / "probe.csv"),
            "--out", str(d / "plan.json"),
            "--now", "2026-11-29T16:10:00",
            "--round", "10",
        ]
    )  # fmt: skip
    assert rc == 0
    plan = read_plan(d / "plan.json")
    assert plan.mode == "queue_aware" and plan.units_outstanding == 10000 - 10 * 100
    assert plan.sites["snellius"].shape == "h100-8h"
    assert all(sp.submit for sp in plan.sites.values())
    assert sum(sp.units for sp in plan.sites.values()) == pytest.approx(9000)
    # fastest per micro-batch slot (snellius: 48k tok/s over B*W=8) gets the largest A
    acc = {s: sp.accumulation for s, sp in plan.sites.items()}
    assert acc == {"snellius": 12, "lumi": 5, "laptop": 1}


def test_plan_with_sacct_jobs_and_job_log(site_dir: Path) -> None:
    d = site_dir
    run(["probe", "--sites", str(d / "sites.yaml"), "--out", str(d / "probe.csv"),
         "--now", "2026-11-29T16:00:00", "--sbatch", str(d / "sbatch")])  # fmt: skip
    line = "|04:00:00|08:00:00|COMPLETED|2026-11-28T00:00:00|2026-11-28T04:00:00|gres/gpu=4"
    (d / "sacct.txt").write_text("\n".join(f"{i}{line}" for i in range(5)) + "\n")
    (d / "log.csv").write_text("site,tokens,seconds,gpus\nlumi,8000000,100,8\n")
    (d / "jobs.json").write_text(
        json.dumps([{"site": "snellius", "shape": "h100-8h", "state": "running",
                     "start": "2026-11-29T15:00:00", "end": "2026-11-29T23:00:00"}])
    )  # fmt: skip
    rc = run(
        [
            "plan",
            "--sites", str(d / "sites.yaml"),
            "--probes", str(d / "probe.csv"),
            "--out", str(d / "plan.json"),
            "--now", "2026-11-29T16:10:00",
            "--sacct-history", f"snellius={d / 'sacct.txt'}",
            "--job-log", str(d / "log.csv"),
            "--jobs", str(d / "jobs.json"),
        ]
    )  # fmt: skip
    assert rc == 0
    plan = read_plan(d / "plan.json")
    assert plan.sites["snellius"].gamma == pytest.approx(0.5)
    assert plan.sites["lumi"].gamma == 1.0
    assert plan.sites["lumi"].tokens_per_s == pytest.approx(10000 * 8)  # history, not prior
    assert plan.sites["snellius"].fixed_units > 0


def test_plan_reads_sacct_captured_in_relative_time_format(site_dir: Path, capsys) -> None:
    d = site_dir
    run(["probe", "--sites", str(d / "sites.yaml"), "--out", str(d / "probe.csv"),
         "--now", "2026-11-29T16:00:00", "--sbatch", str(d / "sbatch")])  # fmt: skip
    # SLURM_TIME_FORMAT=relative, captured on 29 November (the file's mtime): "Ystday" is
    # the 28th, "HH:MM:SS" the 29th, whatever day the plan runs on
    ystday = "|04:00:00|08:00:00|COMPLETED|Ystday 00:00|Ystday 04:00|gres/gpu=4"
    today = "|02:00:00|08:00:00|COMPLETED|10:00:00|12:00:00|gres/gpu=4"
    rows = [f"{i}{ystday}" for i in range(3)] + [f"1{i}{today}" for i in range(3)]
    rows.append("9|08:00:00|08:00:00|TIMEOUT|28.11. 00:00|28.11. 08:00|gres/gpu=4")
    sacct = d / "sacct.txt"
    sacct.write_text("\n".join(rows) + "\n")
    captured = datetime(2026, 11, 29, 16, 5).timestamp()
    os.utime(sacct, (captured, captured))
    rc = run(
        [
            "plan",
            "--sites", str(d / "sites.yaml"),
            "--probes", str(d / "probe.csv"),
            "--out", str(d / "plan.json"),
            "--now", "2026-11-29T16:10:00",
            "--max-probe-age-s", "1e7",
            "--sacct-history", f"snellius={sacct}",
        ]
    )  # fmt: skip
    assert rc == 0
    assert read_plan(d / "plan.json").sites["snellius"].gamma == pytest.approx(0.375)
    # planned two weeks later, a 16-day window holds the 29th's jobs but not the 28th's
    rc = run(
        [
            "plan",
            "--sites", str(d / "sites.yaml"),
            "--probes", str(d / "probe.csv"),
            "--out", str(d / "plan.json"),
            "--now", "2026-12-14T16:10:00",
            "--max-probe-age-s", "1e7",
            "--gamma-window-days", "16",
            "--sacct-history", f"snellius={sacct}",
        ]
    )  # fmt: skip
    assert rc == 0
    assert read_plan(d / "plan.json").sites["snellius"].gamma == pytest.approx(0.25)
    err = capsys.readouterr().err
    assert "1 row(s) with Start/End in no known time format" in err and str(sacct) in err


def test_probe_prints_the_advice_for_a_refused_shape(site_dir: Path, capsys) -> None:
    d = site_dir
    rc = run(["probe", "--sites", str(d / "sites.yaml"), "--out", str(d / "probe.csv"),
              "--now", "2026-11-29T16:00:00", "--sbatch", str(d / "sbatch")])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    refused = [ln for ln in out if "h100-5d" in ln]
    assert len(refused) == 1 and "-> shorten_walltime: " in refused[0]
    assert not any("->" in ln for ln in out if "h100-8h" in ln)


def test_simulate_json(capsys) -> None:
    assert run(["plan", "simulate", str(SCENARIOS / "table4_a.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["time_to_target_h"] / 24 == pytest.approx(1.11, rel=0.02)
    assert out["sites"]["lumi"]["jobs"] == 108 and out["sites"]["snellius"]["jobs"] == 16
    assert {"baseline_h", "speedup"} <= set(out)


def test_simulate_table(capsys) -> None:
    assert run(["plan", "simulate", str(SCENARIOS / "table4_c.yaml")]) == 0
    text = capsys.readouterr().out
    assert "snellius" in text and "1.58 d" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "simulate", "{d}/nope.yaml"], "scenario not found"),
        (["probe", "--sites", "{d}/nope.yaml", "--out", "{d}/p.csv"], "sites config not found"),
        (["plan", "--sites", "{d}/sites.yaml", "--out", "{d}/o.json"], "--probes"),
        (
            ["plan", "--sites", "{d}/sites.yaml", "--probes", "{d}/nope.csv", "--out", "{d}/o"],
            "probe table not found",
        ),
        (
            ["probe", "--sites", "{d}/sites.yaml", "--out", "{d}/p.csv", "--now", "tomorrow"],
            "--now",
        ),
        (
            ["probe", "--sites", "{d}/sites.yaml", "--out", "{d}/p.csv", "--site", "mars"],
            "mars",
        ),
    ],
)
def test_bad_input_exits_2_naming_the_problem(site_dir, capsys, argv, message) -> None:
    argv = [a.format(d=site_dir) for a in argv]
    assert run(argv) == 2
    assert message in capsys.readouterr().err


def test_plan_without_target_exits_2(tmp_path, capsys) -> None:
    (tmp_path / "sites.yaml").write_text(SITES.split("planner:")[0])
    (tmp_path / "p.csv").write_text(
        "probed_at,site,shape,partition,nodes,gpus_per_node,walltime_s,ok,reason,detail,"
        "est_start,wait_s\n"
    )
    rc = run(["plan", "--sites", str(tmp_path / "sites.yaml"), "--probes",
              str(tmp_path / "p.csv"), "--out", str(tmp_path / "o.json")])  # fmt: skip
    assert rc == 2 and "no target" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ("  laptop:\n", "  laptop:\n    transport: vpn\n"),
            "sites/laptop/transport: 'vpn' is not one of",
        ),
        (
            ("partition: standard-g", "partiton: standard-g"),
            "unknown key 'partiton' (did you mean 'partition'",
        ),
        (
            ("target_tokens:", "target_token:"),
            "planner: unknown key 'target_token' (did you mean 'target_tokens'",
        ),
        (("  laptop:\n", "  Laptop!:\n"), "sites: 'Laptop!' does not match"),
    ],
)
def test_a_sites_file_on_the_command_line_is_checked_by_the_run_schema(
    site_dir, capsys, change, message
) -> None:
    """`probe` and `plan` read --sites with the run's one loader: every known key is checked
    by the schema (an enum, a shape's typo, the planner block, a site's name)."""
    path = site_dir / "sites.yaml"
    assert change[0] in path.read_text()
    path.write_text(path.read_text().replace(change[0], change[1]))
    for argv in (
        ["probe", "--sites", str(path), "--out", str(site_dir / "p.csv")],
        ["plan", "--sites", str(path), "--probes", str(site_dir / "p.csv"),
         "--out", str(site_dir / "o.json")],
    ):  # fmt: skip
        assert run(argv) == 2
        err = capsys.readouterr().err
        assert message in err, err
    assert not (site_dir / "p.csv").exists() and not (site_dir / "o.json").exists()
