"""Filling the barrier (paper Fig. 2a): accumulation steps A per site from measured step times.

Every site trains the same H inner steps per round, so with equal batches a fast site idles at
the round barrier until the slowest one is done (75% of the phase in the paper). A step with
A accumulation slots takes about ``A * slot`` seconds; from the step times measured in
earlier rounds this module picks each site's A so that all sites finish their H steps together:
the slowest site keeps its configured A and the others grow theirs (Snellius: A = 5, idle 8%).

The measurements are the site loops' per-round records (``results/rounds/<r>/train/<site>.json``);
they also become the planner's job log (site, tokens, seconds, gpus). The plan rule runs both
steps through the CLI (crossfed.sched.cli):

    crossfed plan job-log --results results --before 3 --sites config/sites.yaml --out job_log.csv
    crossfed plan fill --plan draft.json --job-log job_log.csv --sites config/sites.yaml \\
        --out plan.json
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from crossfed.config import read_sites_file
from crossfed.fileio import write_atomic

LOG_COLUMNS = [
    "site",
    "round",
    "tokens",
    "seconds",
    "gpus",
    "steps",
    "accumulation",
    "ranks",
    "micro_batch",
    "step_s",
]


class BarrierError(ValueError):
    """Measurements or a plan that the barrier cannot be filled from."""


@dataclass(frozen=True)
class StepModel:
    """Seconds of one optimiser step with A accumulation slots: ``fixed_s + a * slot_s``."""

    slot_s: float
    fixed_s: float = 0.0

    def step_s(self, accumulation: int) -> float:
        return self.fixed_s + accumulation * self.slot_s


def job_log(
    results: Path, before_round: int, shapes_gpus: Mapping[str, int] | None = None
) -> pd.DataFrame:
    """Accepted train outcomes of rounds before ``before_round``, one row per (round, site).

    ``gpus`` is the GPU count of the site's job shape (``shapes_gpus``), else its ranks: the
    planner divides by it to get a per-GPU rate.
    """
    rows = []
    for path in sorted(Path(results).glob("rounds/*/train/*.json")):
        try:
            outcome = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise BarrierError(f"{path}: unreadable train outcome: {exc}") from exc
        round_no = outcome.get("round")
        if not isinstance(round_no, int) or round_no >= before_round:
            continue
        if outcome.get("status") != "accepted" or not outcome.get("steps"):
            continue
        if not outcome.get("compute_s") or not outcome.get("accumulation"):
            continue
        site = outcome["site"]
        rows.append(
            {
                "site": site,
                "round": round_no,
                "tokens": int(outcome["tokens"]),
                "seconds": float(outcome["compute_s"]),
                "gpus": int((shapes_gpus or {}).get(site) or outcome.get("ranks") or 1),
                "steps": int(outcome["steps"]),
                "accumulation": int(outcome["accumulation"]),
                "ranks": int(outcome.get("ranks") or 1),
                "micro_batch": int(outcome.get("micro_batch") or 1),
                "step_s": float(outcome["compute_s"]) / int(outcome["steps"]),
            }
        )
    frame = pd.DataFrame(rows, columns=LOG_COLUMNS)
    return frame.sort_values(["round", "site"]).reset_index(drop=True)


def step_models(log: pd.DataFrame, *, recent: int = 3) -> dict[str, StepModel]:
    """Seconds per accumulation slot per site: the median of ``step_s / A`` over its
    ``recent`` latest rounds.

    Proportional on purpose: a fixed per-step cost (optimiser, clipping) makes it overestimate
    the slot at small A, so A grows by less than needed and converges over rounds instead of
    overshooting on noisy timings (fitting ``fixed + A * slot`` to two noisy points did).
    """
    models = {}
    for site, rows in log.sort_values("round").groupby("site"):
        rows = rows.tail(recent)
        per_slot = rows["step_s"].to_numpy(float) / rows["accumulation"].to_numpy(float)
        models[str(site)] = StepModel(float(np.median(per_slot)))
    return models


def fill_barrier(
    models: Mapping[str, StepModel], configured: Mapping[str, int], sites: Sequence[str]
) -> dict[str, int]:
    """A per site in ``sites`` so their steps take as long as the slowest site's.

    The slowest site (longest step at its configured A) keeps that A; every other measured
    site gets the A whose step time comes closest to it (at least 1). Sites without a
    measurement keep their configured A.
    """
    measured = [s for s in sites if s in models]
    out = {s: int(configured[s]) for s in sites}
    if not measured:
        return out
    target = max(models[s].step_s(int(configured[s])) for s in measured)
    for s in measured:
        m = models[s]
        out[s] = max(1, int(round((target - m.fixed_s) / m.slot_s)))
    return out


def predicted_idle(
    models: Mapping[str, StepModel], accumulation: Mapping[str, int]
) -> dict[str, float]:
    """Share of the phase each site would idle at the barrier with these A values."""
    times = {s: models[s].step_s(a) for s, a in accumulation.items() if s in models}
    if not times:
        return {}
    longest = max(times.values())
    return {s: (longest - t) / longest for s, t in times.items()}


def fill_plan(
    plan: dict[str, Any], log: pd.DataFrame, configured: Mapping[str, int]
) -> dict[str, Any]:
    """``plan`` with the submitting sites' accumulation set from the measured step times."""
    sites = [
        s
        for s, entry in plan.get("sites", {}).items()
        if entry.get("submit", True) and s in configured
    ]
    models = step_models(log) if not log.empty else {}
    filled = fill_barrier(models, configured, sites)
    for s, a in filled.items():
        plan["sites"][s]["accumulation"] = a
    plan["barrier"] = {
        "source": "measured step times" if models else "configured (no measurements yet)",
        "accumulation": filled,
        "step_model": {s: vars(m) for s, m in models.items()},
        "predicted_idle_share": predicted_idle(models, filled),
    }
    return plan


def idle_shares(sites: pd.DataFrame) -> pd.DataFrame:
    """``idle_s`` and ``idle_share`` per (round, site): how long each accepted site waited at
    the barrier for the slowest one's inner phase, absolute and as a share of that phase."""
    frame = sites.copy()
    frame["idle_s"] = np.nan
    frame["idle_share"] = np.nan
    if frame.empty or "compute_s" not in frame:
        return frame
    done = frame["status"] == "accepted"
    slowest = frame[done].groupby("round")["compute_s"].transform("max")
    frame.loc[done, "idle_s"] = slowest - frame.loc[done, "compute_s"]
    frame.loc[done, "idle_share"] = frame.loc[done, "idle_s"] / slowest.where(slowest > 0)
    return frame


def _shape_gpus(sites_yaml: Path | None, plan_paths: Sequence[Path]) -> dict[str, int]:
    """GPUs of each site's planned job shape (the latest plan that names one)."""
    if sites_yaml is None:
        return {}
    shapes = {
        site: {shape.name: shape.gpus for shape in cfg.shapes}
        for site, cfg in read_sites_file(sites_yaml).items()
    }
    gpus: dict[str, int] = {}
    for path in plan_paths:
        plan = json.loads(path.read_text())
        for site, entry in plan.get("sites", {}).items():
            shape = entry.get("shape")
            if shape and shapes.get(site, {}).get(shape):
                gpus[site] = shapes[site][shape]
    return gpus


def _configured(sites_yaml: Path) -> dict[str, int]:
    sites = read_sites_file(sites_yaml)
    return {name: cfg.accumulation for name, cfg in sites.items()}


def write_job_log(results: Path, before: int, sites_yaml: Path | None, out: Path) -> str:
    """The planner's job log of the rounds before ``before``, written to ``out``."""
    plans = sorted(results.glob("rounds/*/plan.json"), key=lambda p: int(p.parent.name))
    plans = [p for p in plans if int(p.parent.name) < before]
    frame = job_log(results, before, _shape_gpus(sites_yaml, plans))
    write_atomic(out, frame.to_csv(index=False))
    return f"job log: {len(frame)} measured site rounds before round {before}"


def fill_plan_file(plan_path: Path, job_log_path: Path, sites_yaml: Path, out: Path) -> str:
    """The plan at ``plan_path`` with its accumulation filled, written to ``out``."""
    plan = fill_plan(
        json.loads(plan_path.read_text()), pd.read_csv(job_log_path), _configured(sites_yaml)
    )
    write_atomic(out, json.dumps(plan, indent=2, default=str) + "\n")
    barrier = plan["barrier"]
    shares = ", ".join(f"{s} {v:.0%}" for s, v in barrier["predicted_idle_share"].items())
    return f"barrier ({barrier['source']}): accumulation {barrier['accumulation']}" + (
        f"; predicted idle {shares}" if shares else ""
    )
