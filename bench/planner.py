"""Planner speed: one plan for 10 sites x 5 shapes and a 1T-token target.

Prints a short summary, then ONE JSON line: plan_s (median wall time of make_plan), the 1 s
target, and ratio = plan_s / 1.0 (well under 1 is the goal).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from datetime import UTC, datetime, timedelta

from crossfed.config import Shape, SiteConfig
from crossfed.sched.planner import PlanParams, make_plan
from crossfed.sched.probe import ProbeReason, ProbeResult, probe_frame, probe_row

TARGET_S = 1.0
REPEATS = 7


def scenario(seed: int = 0):
    rng = random.Random(seed)
    now = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    sites, rows = {}, []
    for i in range(10):
        shapes = tuple(
            Shape(
                f"shape{k}",
                f"part{k % 2}",
                2 ** (k % 3),
                rng.choice([4, 8]),
                rng.choice([1, 2, 8, 24, 48]) * 3600.0,
            )  # fmt: skip
            for k in range(5)
        )
        name = f"site{i}"
        sites[name] = SiteConfig(
            name=name,
            ranks=8,
            micro_batch=2,
            accumulation=1,
            tokens_per_s_per_gpu=rng.uniform(3000, 15000),
            scheduler="slurm",
            max_walltime_s=48 * 3600.0,
            qos_max_nodes=rng.choice([4, 8, 16]),
            shapes=shapes,
        )
        for sh in shapes:
            if rng.random() < 0.1:
                res = ProbeResult(False, ProbeReason.NODE_CONFIG, "unavailable")
            else:
                res = ProbeResult(True, ProbeReason.OK, "", None, rng.uniform(0, 72) * 3600)
            rows.append(probe_row(name, sh, res, now - timedelta(seconds=rng.uniform(0, 600))))
    tokens_per_unit = 2**20
    params = PlanParams(
        units_total=1e12 / tokens_per_unit,
        units_per_round=1000,
        tokens_per_unit=tokens_per_unit,
        min_units_per_job=100,
        reserve_s=900,
    )
    return sites, probe_frame(rows), params, now


def main() -> None:
    sites, probes, params, now = scenario()
    times, plan = [], None
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        plan = make_plan(sites, probes, params, now)
        times.append(time.perf_counter() - t0)
    plan_s = statistics.median(times)
    submitting = sum(sp.submit for sp in plan.sites.values())
    jobs = sum(sp.jobs for sp in plan.sites.values())
    print(
        f"10 sites x 5 shapes, 1T tokens: {submitting} sites submit {jobs} jobs, "
        f"finish in {plan.predicted_finish_s / 3600:.1f} h; plan {plan_s * 1e3:.1f} ms"
    )
    print(json.dumps({"plan_s": plan_s, "target_s": TARGET_S, "ratio": plan_s / TARGET_S}))


if __name__ == "__main__":
    main()
