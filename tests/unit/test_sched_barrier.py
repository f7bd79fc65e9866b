"""Filling the barrier: accumulation from measured step times makes sites finish together
(paper Fig. 2a: the fast site's idle share falls from 75% to under 10%)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from crossfed.cli import main
from crossfed.sched.barrier import (
    StepModel,
    fill_barrier,
    fill_plan,
    idle_shares,
    job_log,
    predicted_idle,
    step_models,
)
from tests.conftest import write_yaml


def outcome(site: str, round_no: int, *, step_s: float, a: int = 1, status="accepted") -> dict:
    steps = 10
    return {
        "site": site,
        "round": round_no,
        "status": status,
        "steps": steps,
        "tokens": 4096 * a,
        "compute_s": step_s * steps,
        "accumulation": a,
        "ranks": 2,
        "micro_batch": 4,
    }


def write_outcomes(results: Path, outcomes: list[dict]) -> None:
    for o in outcomes:
        path = results / "rounds" / str(o["round"]) / "train" / f"{o['site']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(o))


def test_paper_figure_2a_calibrated_accumulation_cuts_the_fast_sites_idle_share() -> None:
    # H=100: LUMI's phase takes 170 s, Snellius' 43 s at A=1, so Snellius idles 75%
    models = {"lumi": StepModel(1.70), "snellius": StepModel(0.43)}
    unbalanced = predicted_idle(models, {"lumi": 1, "snellius": 1})
    assert unbalanced["snellius"] == pytest.approx(0.75, abs=0.01)
    filled = fill_barrier(models, {"lumi": 1, "snellius": 1}, ["lumi", "snellius"])
    assert filled == {"lumi": 1, "snellius": 4}
    idle = predicted_idle(models, filled)
    assert max(idle.values()) < 0.1  # the paper measured 8% with its A = 5


def test_step_model_is_the_median_slot_time_of_recent_rounds() -> None:
    log = pd.DataFrame(
        [
            {"site": "snellius", "round": 1, "accumulation": 1, "step_s": 9.0},  # too old
            {"site": "snellius", "round": 2, "accumulation": 1, "step_s": 0.5},
            {"site": "snellius", "round": 3, "accumulation": 4, "step_s": 1.6},
            {"site": "snellius", "round": 4, "accumulation": 4, "step_s": 2.4},
            {"site": "lumi", "round": 1, "accumulation": 2, "step_s": 3.0},
        ]
    )
    models = step_models(log)
    assert models["snellius"].slot_s == pytest.approx(0.5)
    assert models["lumi"] == StepModel(1.5)
    # lumi keeps A=2 (3.0 s a step); snellius needs 3.0 / 0.5 = 6 slots
    assert fill_barrier(models, {"lumi": 2, "snellius": 1}, ["lumi", "snellius"]) == {
        "lumi": 2,
        "snellius": 6,
    }
    # a site never measured keeps its configured value
    assert fill_barrier(models, {"lumi": 2, "frontier": 3}, ["lumi", "frontier"])["frontier"] == 3
    # a fixed per-step cost in the model is honoured
    assert fill_barrier({"a": StepModel(1.0, 1.0), "b": StepModel(0.5)}, {"a": 2, "b": 1},
                        ["a", "b"]) == {"a": 2, "b": 6}  # fmt: skip


def test_job_log_reads_accepted_rounds_before_the_planned_one(tmp_path: Path) -> None:
    write_outcomes(
        tmp_path,
        [
            outcome("lumi", 1, step_s=2.0),
            outcome("snellius", 1, step_s=0.5),
            outcome("snellius", 2, step_s=0.6, a=2),
            outcome("frontier", 2, step_s=9.0, status="lease_lost"),
            outcome("lumi", 3, step_s=2.0),  # the round being planned: not yet history
        ],
    )
    log = job_log(tmp_path, before_round=3, shapes_gpus={"snellius": 4})
    assert list(zip(log["round"], log["site"], strict=True)) == [
        (1, "lumi"),
        (1, "snellius"),
        (2, "snellius"),
    ]
    assert log["gpus"].tolist() == [2, 4, 4]
    assert log["seconds"].tolist() == [20.0, 5.0, 6.0]
    assert log["step_s"].tolist() == [2.0, 0.5, 0.6]


def test_fill_plan_sets_submitting_sites_only_and_says_why() -> None:
    plan = {"sites": {"lumi": {"submit": True}, "snellius": {"submit": True}, "x": {"submit": 0}}}
    log = pd.DataFrame(
        [
            {"site": "lumi", "round": 1, "accumulation": 1, "step_s": 2.0},
            {"site": "snellius", "round": 1, "accumulation": 1, "step_s": 0.5},
        ]
    )
    filled = fill_plan(plan, log, {"lumi": 1, "snellius": 1, "x": 1})
    assert filled["sites"]["snellius"]["accumulation"] == 4
    assert "accumulation" not in filled["sites"]["x"]
    assert filled["barrier"]["source"] == "measured step times"
    empty = fill_plan({"sites": {"lumi": {}}}, pd.DataFrame(), {"lumi": 2})
    assert empty["sites"]["lumi"]["accumulation"] == 2
    assert empty["barrier"]["source"].startswith("configured")


def test_idle_share_per_site_and_round() -> None:
    frame = pd.DataFrame(
        [
            {"round": 1, "site": "a", "status": "accepted", "compute_s": 40.0},
            {"round": 1, "site": "b", "status": "accepted", "compute_s": 160.0},
            {"round": 1, "site": "c", "status": "missed", "compute_s": 0.0},
            {"round": 2, "site": "a", "status": "accepted", "compute_s": 50.0},
        ]
    )
    out = idle_shares(frame)
    assert out["idle_s"].tolist()[:2] == [120.0, 0.0]
    assert out["idle_share"].tolist()[:2] == [0.75, 0.0]
    assert pd.isna(out["idle_share"].iloc[2]) and out["idle_share"].iloc[3] == 0.0


def test_plan_job_log_and_plan_fill_write_the_job_log_and_fill_the_plan(tmp_path: Path) -> None:
    results = tmp_path / "results"
    write_outcomes(results, [outcome("lumi", 1, step_s=2.0), outcome("snellius", 1, step_s=0.5)])
    required = {"ranks": 1, "micro_batch": 1, "scheduler": "none", "tokens_per_s_per_gpu": 1}
    sites = {
        "sites": {
            "lumi": {**required, "accumulation": 1, "shapes": []},
            "snellius": {
                **required,
                "accumulation": 1,
                "shapes": [
                    {
                        "name": "h",
                        "partition": "p",
                        "nodes": 1,
                        "gpus_per_node": 4,
                        "walltime": "01:00:00",
                    }
                ],
            },
        }
    }
    sites_yaml = write_yaml(tmp_path / "sites.yaml", sites)
    (results / "rounds" / "1" / "plan.json").write_text(
        json.dumps({"sites": {"snellius": {"shape": "h"}}})
    )
    log_path = results / "rounds" / "2" / "job_log.csv"
    args = ["plan", "job-log", "--results", str(results), "--before", "2"]
    args += ["--sites", str(sites_yaml)]
    assert main([*args, "--out", str(log_path)]) == 0
    assert pd.read_csv(log_path).set_index("site")["gpus"].to_dict() == {"lumi": 2, "snellius": 4}
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps({"sites": {"lumi": {"submit": True}, "snellius": {}}}))
    args = ["plan", "fill", "--plan", str(plan_path), "--job-log", str(log_path)]
    assert main([*args, "--sites", str(sites_yaml)]) == 0
    plan = json.loads(plan_path.read_text())
    assert (
        plan["sites"]["snellius"]["accumulation"] == 4
        and plan["sites"]["lumi"]["accumulation"] == 1
    )
    assert (
        main(
            [
                "plan",
                "fill",
                "--plan",
                str(tmp_path / "nope.json"),
                "--job-log",
                str(log_path),
                "--sites",
                str(sites_yaml),
            ]
        )
        == 2
    )
