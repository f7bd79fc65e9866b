"""Queue-aware placement: a waterfill over sites' predicted start times (paper §3.3).

Work is counted in data units; one outer round consumes ``units_per_round`` (R) of them.
Every site contributes *lanes*: with a QoS limit of Q nodes and a shape of n nodes, a site
runs ``Q // n`` jobs side by side, and each lane chains walltime-capped jobs back to back
from the site's predicted start (``probe wait * gamma``). The waterfill raises a common
finish level T until the lanes' throughput integrated from their starts covers the
outstanding units: the soonest-available sites fill first, sites that are free together
split work in proportion to throughput, and a site whose start lies beyond T gets nothing.

``min_units_per_job`` drops lanes whose whole chain would carry less than that (smallest
first, re-solving each time, never the last productive lane); the trailing job of a longer
chain may carry less. The reserve rho pads the last job of every chain (never beyond the
walltime cap) so a site can keep training if others start later than predicted.

A refused probe skips its shape, and the site's ``advice`` says what to change
(``slurm_messages.Advice``: shorten the walltime, resize the node count, reshape, fix the
account/partition, wait). A ``try_later`` probe (controller or database unreachable,
rate limited, sbatch timed out) says nothing about the queue: the shape's newest
informative probe decides instead, so a transient failure does not drop a fresh estimate.

Running and queued jobs are fixed input (their throughput counts, they are never
re-planned), so recomputing the plan every Delta folds in new capacity without disturbing
them. All times inside are seconds from ``now``; the plan also carries ISO timestamps.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd

from crossfed.config import SiteConfig
from crossfed.sched.probe import LOCAL_DETAIL, as_aware
from crossfed.sched.slurm_messages import Advice, advice_for

EPS = 1e-9
MAX_ROUND_ENDS = 1000


class PlanError(ValueError):
    """Planner input that cannot be planned (bad parameters, unknown sites or shapes)."""


# ----------------------------------------------------------------------------- waterfill


@dataclass(frozen=True)
class Segment:
    """A stretch of constant throughput: ``rate`` units/s from ``start`` until ``end``."""

    start: float
    rate: float
    end: float = math.inf


def delivered(segments: Sequence[Segment], t: float) -> float:
    """Units the segments have produced by time ``t``."""
    return sum(s.rate * max(0.0, min(t, s.end) - s.start) for s in segments)


def finish_times(segments: Sequence[Segment], targets: Sequence[float]) -> list[float]:
    """Earliest times at which ``delivered`` reaches each target (ascending targets).

    Piecewise-linear inversion in one sweep over start/end events; ``inf`` when the
    segments never reach a target.
    """
    if any(b < a for a, b in zip(targets, targets[1:], strict=False)):
        raise PlanError("finish_times needs ascending targets")
    events: list[tuple[float, float]] = []
    for s in segments:
        if s.rate <= 0 or s.end <= s.start or not math.isfinite(s.start):
            continue
        events.append((s.start, s.rate))
        if math.isfinite(s.end):
            events.append((s.end, -s.rate))
    heapq.heapify(events)
    out: list[float] = []
    i, done, rate = 0, 0.0, 0.0
    tiny = 1e-12 * max((r for _, r in events), default=0.0)
    now = min((e[0] for e in events), default=0.0)
    while i < len(targets) and targets[i] <= EPS:
        out.append(0.0)
        i += 1
    while events and i < len(targets):
        t_next = events[0][0]
        while i < len(targets) and rate > 0 and done + rate * (t_next - now) >= targets[i]:
            out.append(now + (targets[i] - done) / rate)
            i += 1
        done += rate * (t_next - now)
        now = t_next
        while events and events[0][0] == t_next:
            rate += heapq.heappop(events)[1]
        if rate < tiny:  # float residue after every lane has ended
            rate = 0.0
    while i < len(targets):
        out.append(now + (targets[i] - done) / rate if rate > 0 else math.inf)
        i += 1
    return out


def finish_time(segments: Sequence[Segment], units: float) -> float:
    """Earliest time at which the segments have delivered ``units``."""
    return finish_times(segments, [units])[0]


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class PlanParams:
    """Knobs of the planner (paper §3.3: R, minimum units per job, gamma, rho, max age)."""

    units_total: float
    units_per_round: float = 1.0
    tokens_per_unit: float = 1.0
    round: int = 0
    min_units_per_job: float = 0.0
    reserve_s: float = 0.0
    max_probe_age_s: float = 3600.0
    gamma: float = 1.0

    def __post_init__(self) -> None:
        checks = {
            "units_total": self.units_total >= 0,
            "units_per_round": self.units_per_round > 0,
            "tokens_per_unit": self.tokens_per_unit > 0,
            "round": self.round >= 0,
            "min_units_per_job": self.min_units_per_job >= 0,
            "reserve_s": self.reserve_s >= 0,
            "max_probe_age_s": self.max_probe_age_s > 0,
            "gamma": 0 < self.gamma <= 1,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            vals = ", ".join(f"{k}={getattr(self, k)!r}" for k in bad)
            raise PlanError(f"invalid planner parameters: {vals}")

    @property
    def units_outstanding(self) -> float:
        return max(0.0, self.units_total - self.round * self.units_per_round)


@dataclass(frozen=True)
class FixedJob:
    """A running or queued job the plan must keep (``start=None``: at the predicted start)."""

    site: str
    shape: str | None
    start: datetime | None = None
    end: datetime | None = None
    state: str = "running"


@dataclass(frozen=True)
class Candidate:
    """One way a site can take work: a shape, its predicted start and throughput."""

    site: str
    shape: str | None
    start_s: float
    lanes: int
    tokens_per_s: float  # one job (lane)
    walltime_s: float  # cap per job
    gpus: int
    wait_s: float = 0.0  # raw probe wait
    probe_age_s: float | None = None


# ----------------------------------------------------------------------------- output


@dataclass
class PlannedJob:
    """One job of a lane's chain."""

    lane: int
    start_s: float
    end_s: float
    walltime_s: float
    units: float


@dataclass
class LanePlan:
    """One QoS slot of a site: ``jobs`` back-to-back jobs from ``start_s`` to ``end_s``.

    Every job but the last runs the full ``job_walltime_s`` (the site's cap); the last one
    trains the remainder and requests ``last_walltime_s`` (remainder + reserve, capped).
    """

    lane: int
    start_s: float
    end_s: float
    jobs: int
    job_walltime_s: float
    last_walltime_s: float
    units: float

    def expand(self) -> list[PlannedJob]:
        """The individual jobs of the chain."""
        rate = self.units / (self.end_s - self.start_s)
        out = []
        for k in range(self.jobs):
            a = self.start_s + k * self.job_walltime_s
            b = self.end_s if k == self.jobs - 1 else a + self.job_walltime_s
            req = self.last_walltime_s if k == self.jobs - 1 else self.job_walltime_s
            out.append(PlannedJob(self.lane, a, b, req, rate * (b - a)))
        return out


@dataclass
class SitePlan:
    """What one site should do."""

    site: str
    submit: bool
    reason: str
    shape: str | None = None
    jobs: int = 0
    lanes: int = 0
    units: float = 0.0
    fixed_units: float = 0.0
    accumulation: int | None = None
    tokens_per_s: float = 0.0
    gamma: float = 1.0
    wait_s: float | None = None
    predicted_start_s: float | None = None
    predicted_finish_s: float | None = None
    predicted_start: str | None = None
    predicted_finish: str | None = None
    lane_plans: list[LanePlan] = field(default_factory=list)
    advice: dict[str, str] = field(default_factory=dict)  # shape -> Advice of its probe

    def planned_jobs(self) -> list[PlannedJob]:
        """Every job of every lane, in lane order."""
        return [j for lane in self.lane_plans for j in lane.expand()]


@dataclass
class Plan:
    """A placement decision for the remainder of the run."""

    created_at: str
    mode: str  # queue_aware | all_now | done | infeasible | closed (crossfed.catchup)
    round: int
    units_total: float
    units_outstanding: float
    units_per_round: float
    tokens_per_unit: float
    rounds_remaining: int
    predicted_finish_s: float | None
    predicted_finish: str | None
    round_ends_s: list[float]
    sites: dict[str, SitePlan]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        try:
            sites = {
                name: SitePlan(
                    **{
                        **sp,
                        "lane_plans": [LanePlan(**ln) for ln in sp.get("lane_plans", [])],
                    }
                )
                for name, sp in d["sites"].items()
            }
            known = {f.name for f in fields(cls)} - {"sites"}  # a closed round's adds detail
            return cls(**{k: v for k, v in d.items() if k in known}, sites=sites)
        except (KeyError, TypeError) as exc:
            raise PlanError(f"not a crossfed plan: {exc}") from exc


def write_plan(plan: Plan, path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(plan.to_json() + "\n")


def read_plan(path: str | Path) -> Plan:
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"plan not found: {p}")
    try:
        return Plan.from_dict(json.loads(p.read_text()))
    except json.JSONDecodeError as exc:
        raise PlanError(f"{p}: invalid JSON: {exc}") from exc


# ----------------------------------------------------------------------------- candidates


def _seconds(a: datetime, b: datetime) -> float:
    """``a - b`` in seconds, tolerant of mixing naive and aware values."""
    return (as_aware(a) - as_aware(b)).total_seconds()


def _parse_ts(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text) if text else None
    except ValueError:
        return None


def probe_rows_by_site(probes: pd.DataFrame, now: datetime) -> dict[str, list[dict[str, Any]]]:
    """Probe rows grouped by site, each with its ``age_s`` and table order ``seq``."""
    out: dict[str, list[dict[str, Any]]] = {}
    for seq, row in enumerate(probes.to_dict("records")):
        ts = _parse_ts(str(row.get("probed_at", "")))
        if ts is None:
            raise PlanError(f"probe row {seq}: bad probed_at {row.get('probed_at')!r}")
        row["age_s"] = _seconds(now, ts)
        row["seq"] = seq
        out.setdefault(str(row["site"]), []).append(row)
    return out


def _newest(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The most recent row (later rows win ties, as in an appended history)."""
    return min(rows, key=lambda r: (r["age_s"], -r["seq"]))


def _deciding(rows: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any], str]:
    """The row that decides a shape and a note when it is not the newest one.

    A ``try_later`` probe (controller, database or rate limit trouble, sbatch timeout)
    says nothing about the queue, so the newest probe that does says it instead.
    """
    row = _newest(rows)
    if advice_for(str(row["reason"])) is not Advice.TRY_LATER:
        return row, ""
    known = [r for r in rows if advice_for(str(r["reason"])) is not Advice.TRY_LATER]
    if not known:
        return row, ""
    older = _newest(known)
    return older, f"{row['reason']}, read the probe of {older['age_s']:.0f}s ago"


def shape_advice(site: SiteConfig, rows: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Shape -> advice for every probed shape whose deciding probe is not usable."""
    out: dict[str, str] = {}
    for shape in site.shapes if site.has_scheduler else ():
        srows = [r for r in rows if r["shape"] == shape.name]
        if srows:
            advice = advice_for(str(_deciding(srows)[0]["reason"]))
            if advice is not Advice.USE:
                out[shape.name] = str(advice)
    return out


def site_candidates(
    site: SiteConfig,
    rows: Sequence[Mapping[str, Any]],
    *,
    gamma: float,
    rate_per_gpu: float,
    max_probe_age_s: float,
) -> tuple[list[Candidate], str]:
    """Eligible (shape, start, throughput) options of a site, or why there are none.

    ``rows`` are the site's probe rows from ``probe_rows_by_site``.
    """
    if not site.has_scheduler:
        shape = site.shapes[0].name if site.shapes else None
        return [
            Candidate(site.name, shape, 0.0, 1, rate_per_gpu * site.ranks, math.inf, site.ranks)
        ], LOCAL_DETAIL
    if not rows:
        return [], "no_probe: the site has no probe rows"
    ok_rows = [r for r in rows if r["ok"]]
    if not ok_rows:
        return [], "probe_failed: " + _failures(rows)
    newest_ok_age = _newest(ok_rows)["age_s"]
    if newest_ok_age > max_probe_age_s:
        return [], (
            f"stale_probe: newest ok probe is {newest_ok_age:.0f}s old "
            f"(max_probe_age_s={max_probe_age_s:g})"
        )
    cands: list[Candidate] = []
    skipped: list[str] = []
    for shape in site.shapes:
        srows = [r for r in rows if r["shape"] == shape.name]
        if not srows:
            skipped.append(f"{shape.name}: no_probe")
            continue
        row, note = _deciding(srows)
        if note:
            skipped.append(f"{shape.name}: {note}")
        if not row["ok"]:
            skipped.append(f"{shape.name}: {row['reason']} ({advice_for(str(row['reason']))})")
            continue
        if row["age_s"] > max_probe_age_s:
            skipped.append(f"{shape.name}: stale_probe")
            continue
        if shape.walltime_s > site.max_walltime_s + EPS:
            skipped.append(f"{shape.name}: walltime over site maximum")
            continue
        if shape.nodes > site.qos_max_nodes:
            skipped.append(f"{shape.name}: nodes over QoS limit")
            continue
        wait = float(row["wait_s"]) if row["wait_s"] == row["wait_s"] else 0.0
        cands.append(
            Candidate(
                site=site.name,
                shape=shape.name,
                start_s=max(0.0, gamma * wait - row["age_s"]),
                lanes=max(1, site.qos_max_nodes // shape.nodes),
                tokens_per_s=rate_per_gpu * shape.gpus,
                walltime_s=min(shape.walltime_s, site.max_walltime_s),
                gpus=shape.gpus,
                wait_s=wait,
                probe_age_s=row["age_s"],
            )
        )
    if not cands:
        return [], "no usable shape: " + "; ".join(skipped)
    return cands, "; ".join(skipped)


def _failures(rows: Sequence[Mapping[str, Any]]) -> str:
    shapes = sorted({str(r["shape"]) for r in rows})
    newest = {sh: _deciding([r for r in rows if r["shape"] == sh])[0] for sh in shapes}
    return "; ".join(f"{sh or '-'}: {r['reason']}" for sh, r in newest.items())


# ----------------------------------------------------------------------------- planning


@dataclass
class _Fixed:
    site: str
    start_s: float
    end_s: float
    tokens_per_s: float


def _fixed_jobs(
    fixed: Sequence[FixedJob],
    sites: Mapping[str, SiteConfig],
    cands: Mapping[str, list[Candidate]],
    rates: Mapping[str, float],
    now: datetime,
) -> list[_Fixed]:
    out = []
    for job in fixed:
        site = sites.get(job.site)
        if site is None:
            raise PlanError(f"fixed job for unknown site {job.site!r}")
        shape = site.shape(job.shape) if job.shape else None
        if job.shape and shape is None:
            raise PlanError(f"fixed job on {job.site!r}: unknown shape {job.shape!r}")
        gpus = shape.gpus if shape else site.ranks
        wall = min(shape.walltime_s, site.max_walltime_s) if shape else site.max_walltime_s
        if job.start is not None:
            start = _seconds(job.start, now)
        else:
            same = [c for c in cands.get(job.site, []) if c.shape == job.shape]
            start = min((c.start_s for c in same or cands.get(job.site, [])), default=0.0)
        end = _seconds(job.end, now) if job.end is not None else start + wall
        if end > max(start, 0.0):
            out.append(_Fixed(job.site, max(start, 0.0), end, rates[job.site] * gpus))
    return out


def _lane_starts(c: Candidate, fixed_ends: Sequence[float], lanes: int) -> list[float]:
    """A lane behind a running job of the site opens when that job ends (QoS)."""
    ends = sorted(fixed_ends)
    starts = [max(c.start_s, ends[i]) if i < len(ends) else c.start_s for i in range(c.lanes)]
    return sorted(starts)[:lanes]


class _Model:
    """Fixed segments plus one candidate per site; solves the finish level T."""

    def __init__(self, fixed: list[_Fixed], tokens_per_unit: float, units: float) -> None:
        self.fixed = fixed
        self.tpu = tokens_per_unit
        self.units = units
        self.fixed_segments = [
            Segment(f.start_s, f.tokens_per_s / tokens_per_unit, f.end_s) for f in fixed
        ]
        self.fixed_ends: dict[str, list[float]] = {}
        for f in fixed:
            self.fixed_ends.setdefault(f.site, []).append(f.end_s)

    def lanes(self, choice: Mapping[str, Candidate], counts: Mapping[str, int]) -> dict:
        return {
            s: _lane_starts(c, self.fixed_ends.get(s, []), counts.get(s, c.lanes))
            for s, c in choice.items()
        }

    def segments(self, choice: Mapping[str, Candidate], counts: Mapping[str, int]) -> list:
        segs = list(self.fixed_segments)
        for s, starts in self.lanes(choice, counts).items():
            rate = choice[s].tokens_per_s / self.tpu
            segs += [Segment(st, rate) for st in starts]
        return segs

    def finish(self, choice: Mapping[str, Candidate], counts: Mapping[str, int]) -> float:
        return finish_time(self.segments(choice, counts), self.units)


def _choose_shapes(model: _Model, cands: Mapping[str, list[Candidate]]) -> dict[str, Candidate]:
    """Coordinate descent on T: per site, the shape that minimises the common finish."""

    def key(c: Candidate, t: float) -> tuple:
        return (t, c.gpus, c.start_s, c.shape or "")

    def standalone(c: Candidate) -> float:
        return c.start_s + model.units * model.tpu / (c.lanes * c.tokens_per_s)

    choice = {
        s: min(cs, key=lambda c: (standalone(c), c.gpus, c.shape or ""))
        for s, cs in cands.items()
        if cs
    }
    best = model.finish(choice, {})
    for _ in range(20):
        changed = False
        for s, cs in cands.items():
            if len(cs) < 2:
                continue
            scored = [(key(c, model.finish({**choice, s: c}, {})), c) for c in cs]
            k, c = min(scored, key=lambda kc: kc[0])
            if c != choice[s] and k[0] < best - EPS:
                choice[s], best, changed = c, k[0], True
        if not changed:
            break
    return choice


def _drop_small_lanes(
    model: _Model, choice: Mapping[str, Candidate], min_units: float
) -> dict[str, int]:
    """Drop lanes whose work is below ``min_units`` (never the last productive one)."""
    counts = {s: c.lanes for s, c in choice.items()}
    if min_units <= 0:
        return counts
    while True:
        t = model.finish(choice, counts)
        if not math.isfinite(t):
            return counts
        small: list[tuple[float, str]] = []
        productive = 0
        for s, starts in model.lanes(choice, counts).items():
            rate = choice[s].tokens_per_s / model.tpu
            for st in starts:
                u = rate * max(0.0, t - st)
                if u > EPS:
                    productive += 1
                    if u < min_units - EPS:
                        small.append((u, s))
        if not small or productive <= 1:
            return counts
        _, s = min(small)
        counts[s] -= 1


def _lane(
    lane: int, start: float, finish: float, wall: float, rate: float, reserve: float
) -> LanePlan | None:
    """The chain of walltime-capped jobs covering ``[start, finish)`` on one lane."""
    dur = finish - start
    if dur <= EPS:
        return None
    if not math.isfinite(wall):  # no batch scheduler: one job for the whole stretch
        return LanePlan(lane, start, finish, 1, dur, dur + reserve, rate * dur)
    n = max(1, math.ceil(dur / wall - 1e-9))
    last = dur - (n - 1) * wall
    return LanePlan(lane, start, finish, n, wall, min(wall, last + reserve), rate * dur)


def accumulation_steps(
    sites: Mapping[str, SiteConfig], tokens_per_s: Mapping[str, float]
) -> dict[str, int]:
    """Accumulation A per site so that participating sites finish a round together.

    A round at a site takes ``H * B * W * A * seq / throughput``; equal round times need
    ``A`` proportional to ``throughput / (B * W)``. The slowest site keeps its configured A;
    the others scale by their speed relative to it, rounded to an integer >= 1 (Fig. 2a).
    """
    speed = {
        s: tps / (sites[s].micro_batch * sites[s].ranks)
        for s, tps in tokens_per_s.items()
        if tps > 0
    }
    if not speed:
        return {}
    slow = min(speed, key=lambda s: (speed[s], s))
    base = sites[slow].accumulation
    return {s: max(1, round(base * v / speed[slow])) for s, v in speed.items()}


def make_plan(
    sites: Mapping[str, SiteConfig],
    probes: pd.DataFrame,
    params: PlanParams,
    now: datetime,
    *,
    gammas: Mapping[str, float] | None = None,
    rates: Mapping[str, float] | None = None,
    fixed: Sequence[FixedJob] = (),
) -> Plan:
    """Plan the outstanding units over the sites (see the module docstring)."""
    if not sites:
        raise PlanError("no sites to plan for")
    gammas = dict(gammas or {})
    for s, g in gammas.items():
        if not 0 < g <= 1:
            raise PlanError(f"gamma for {s!r} must be in (0, 1], got {g!r}")
    rate = {s: float((rates or {}).get(s, cfg.tokens_per_s_per_gpu)) for s, cfg in sites.items()}
    bad = [s for s, r in rate.items() if not r > 0]
    if bad:
        raise PlanError(f"per-GPU token rate must be > 0 for {bad}")
    all_local = not any(c.has_scheduler for c in sites.values())
    units = params.units_outstanding

    by_site = probe_rows_by_site(probes, now)
    cands: dict[str, list[Candidate]] = {}
    notes: dict[str, str] = {}
    for name, cfg in sites.items():
        cands[name], notes[name] = site_candidates(
            cfg,
            by_site.get(name, []),
            gamma=gammas.get(name, params.gamma),
            rate_per_gpu=rate[name],
            max_probe_age_s=params.max_probe_age_s,
        )
    advice = {name: shape_advice(cfg, by_site.get(name, [])) for name, cfg in sites.items()}
    fixed_jobs = _fixed_jobs(fixed, sites, cands, rate, now)
    model = _Model(fixed_jobs, params.tokens_per_unit, units)

    if units <= EPS:
        return _empty_plan(params, now, sites, "done", "target reached: no outstanding units")

    choice = _choose_shapes(model, cands)
    counts = _drop_small_lanes(model, choice, params.min_units_per_job)
    segments = model.segments(choice, counts)
    t_fin = finish_time(segments, units)
    if not math.isfinite(t_fin):
        reasons = {s: notes[s] or "no capacity" for s in sites}
        return _empty_plan(params, now, sites, "infeasible", reasons, advice)

    lanes = model.lanes(choice, counts)
    site_plans: dict[str, SitePlan] = {}
    tps_participating: dict[str, float] = {}
    for name, cfg in sites.items():
        g = gammas.get(name, params.gamma)
        fixed_units = sum(
            f.tokens_per_s / params.tokens_per_unit * max(0.0, min(t_fin, f.end_s) - f.start_s)
            for f in fixed_jobs
            if f.site == name
        )
        c = choice.get(name)
        if c is None:
            site_plans[name] = SitePlan(name, False, notes[name], gamma=g, fixed_units=fixed_units)
            if fixed_units > 0:
                tps_participating[name] = max(f.tokens_per_s for f in fixed_jobs if f.site == name)
            continue
        rate_u = c.tokens_per_s / params.tokens_per_unit
        chains = [
            _lane(i, st, t_fin, c.walltime_s, rate_u, params.reserve_s)
            for i, st in enumerate(lanes[name])
        ]
        used = [ln for ln in chains if ln is not None]
        sp = SitePlan(
            name,
            submit=bool(used),
            reason="",
            shape=c.shape,
            gamma=g,
            wait_s=c.wait_s,
            tokens_per_s=c.tokens_per_s,
            fixed_units=fixed_units,
        )
        if used:
            sp.jobs = sum(ln.jobs for ln in used)
            sp.lanes = len(used)
            sp.units = sum(ln.units for ln in used)
            sp.predicted_start_s = min(ln.start_s for ln in used)
            sp.predicted_finish_s = t_fin
            sp.lane_plans = used
            sp.reason = _submit_reason(cfg, c, all_local, notes[name])
            tps_participating[name] = c.tokens_per_s
        else:
            opens = min(lanes[name], default=math.inf)
            if counts.get(name, c.lanes) == 0:
                sp.reason = f"below min_units_per_job={params.min_units_per_job:g}"
            elif opens > c.start_s + EPS:
                sp.reason = "busy: its running/queued jobs hold every QoS slot until the finish"
            else:
                sp.reason = (
                    f"starts after the predicted finish (start {c.start_s / 3600:.2f} h, "
                    f"finish {t_fin / 3600:.2f} h)"
                )
            if fixed_units > 0:
                tps_participating[name] = c.tokens_per_s
        site_plans[name] = sp

    acc = (
        {s: sites[s].accumulation for s in tps_participating}
        if all_local
        else accumulation_steps(sites, tps_participating)
    )
    for name, a in acc.items():
        site_plans[name].accumulation = a
    for name, sp in site_plans.items():
        sp.advice = advice[name]
    for sp in site_plans.values():
        if sp.predicted_start_s is not None:
            sp.predicted_start = _iso(now, sp.predicted_start_s)
            sp.predicted_finish = _iso(now, sp.predicted_finish_s)

    rounds = math.ceil(units / params.units_per_round - EPS)
    shown = min(rounds, MAX_ROUND_ENDS)  # the first rounds are the ones a plan acts on
    targets = [min(units, k * params.units_per_round) for k in range(1, shown + 1)]
    return Plan(
        created_at=as_aware(now).isoformat(),
        mode="all_now" if all_local else "queue_aware",
        round=params.round,
        units_total=params.units_total,
        units_outstanding=units,
        units_per_round=params.units_per_round,
        tokens_per_unit=params.tokens_per_unit,
        rounds_remaining=rounds,
        predicted_finish_s=t_fin,
        predicted_finish=_iso(now, t_fin),
        round_ends_s=finish_times(segments, targets),
        sites=site_plans,
    )


def _submit_reason(cfg: SiteConfig, c: Candidate, all_local: bool, note: str) -> str:
    if not cfg.has_scheduler:
        return LOCAL_DETAIL
    text = (
        f"{c.shape}: starts in {c.start_s / 3600:.2f} h "
        f"(probe wait {c.wait_s / 3600:.2f} h, discounted)"
    )
    return f"{text}; skipped {note}" if note else text


def _iso(now: datetime, offset_s: float | None) -> str | None:
    if offset_s is None or not math.isfinite(offset_s):
        return None
    return (as_aware(now) + timedelta(seconds=offset_s)).isoformat()


def _empty_plan(
    params: PlanParams,
    now: datetime,
    sites: Mapping[str, SiteConfig],
    mode: str,
    reason: str | Mapping[str, str],
    advice: Mapping[str, dict[str, str]] | None = None,
) -> Plan:
    reasons = reason if isinstance(reason, Mapping) else dict.fromkeys(sites, reason)
    advice = advice or {}
    return Plan(
        created_at=as_aware(now).isoformat(),
        mode=mode,
        round=params.round,
        units_total=params.units_total,
        units_outstanding=params.units_outstanding,
        units_per_round=params.units_per_round,
        tokens_per_unit=params.tokens_per_unit,
        rounds_remaining=math.ceil(params.units_outstanding / params.units_per_round - EPS),
        predicted_finish_s=None,
        predicted_finish=None,
        round_ends_s=[],
        sites={s: SitePlan(s, False, reasons[s], advice=advice.get(s, {})) for s in sites},
    )


__all__ = [
    "Candidate",
    "LanePlan",
    "FixedJob",
    "Plan",
    "PlanError",
    "PlanParams",
    "PlannedJob",
    "Segment",
    "SitePlan",
    "accumulation_steps",
    "delivered",
    "finish_time",
    "finish_times",
    "make_plan",
    "read_plan",
    "probe_rows_by_site",
    "shape_advice",
    "site_candidates",
    "write_plan",
]
