"""Idealised queue model: time-to-target with and without queue-aware placement (Table 4).

Assumptions (the paper's, §4 Table 4): after its queue wait a site chains single-node jobs
back to back up to its QoS node limit, with no re-queueing gap and 0% barrier wait (no site
ever waits on another). Under these assumptions the round-by-round projection is the
continuous waterfill of ``crossfed.sched.planner``; the queue-aware figure is the planner's
own allocation (every node a lane, every lane a chain of walltime-capped jobs).

* ``time_to_target_h``: queue-aware: every site trains from the end of its own wait.
* ``baseline_h``: nobody trains until the last site's wait is over, then all train together.
* ``speedup``: the share of the baseline's time saved, ``1 - time_to_target / baseline``;
  this is the paper's "18-43% faster than waiting for all sites" (scenarios B and C).
  ``baseline_ratio = baseline / time_to_target`` is reported alongside.
* ``jobs``: node allocations; each of a site's ``nodes`` lanes needs
  ``ceil(active / walltime)`` jobs to cover its active time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from crossfed.config import Shape, SiteConfig
from crossfed.sched.planner import PlanParams, Segment, finish_time, make_plan
from crossfed.sched.probe import ProbeReason, ProbeResult, probe_frame, probe_row

_TOKENS_PER_UNIT = 1e9  # plan in billions of tokens: keeps the numbers readable


class ScenarioError(ValueError):
    """A scenario file that is missing or malformed."""


@dataclass(frozen=True)
class ScenarioSite:
    """One site of a what-if scenario."""

    name: str
    nodes: int
    walltime_h: float
    tokens_per_s_per_node: float
    queue_wait_h: float
    gpus_per_node: int | None = None


@dataclass(frozen=True)
class Scenario:
    """A target and the sites that share it."""

    target_tokens: float
    sites: tuple[ScenarioSite, ...]
    name: str = ""


@dataclass(frozen=True)
class SiteProjection:
    wait_h: float
    active_h: float
    jobs: int
    tokens: float


@dataclass(frozen=True)
class Projection:
    target_tokens: float
    time_to_target_h: float
    time_to_target_d: float
    baseline_h: float
    speedup: float
    baseline_ratio: float
    sites: dict[str, SiteProjection]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _yaml_float(v: Any) -> Any:
    """PyYAML (YAML 1.1) reads ``100.0e9`` as a string; accept such numeric strings."""
    if isinstance(v, str):
        try:
            f = float(v)
        except ValueError:
            return v
        return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
    return v


def _number(raw: Mapping[str, Any], key: str, where: str, *, minimum: float, strict: bool) -> Any:
    if key not in raw:
        raise ScenarioError(f"{where}: missing required key {key!r}")
    v = _yaml_float(raw[key])
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ScenarioError(f"{where}: {key!r} must be a number, got {v!r}")
    if v < minimum or (strict and v == minimum):
        op = ">" if strict else ">="
        raise ScenarioError(f"{where}: {key!r} must be {op} {minimum}, got {v!r}")
    return v


def parse_scenario(data: Any, *, source: str = "scenario") -> Scenario:
    """Validate a loaded scenario mapping (unknown keys are ignored)."""
    if not isinstance(data, Mapping):
        raise ScenarioError(f"{source}: expected a mapping at the top level")
    target = float(_number(data, "target_tokens", source, minimum=0, strict=True))
    raw_sites = data.get("sites")
    if not isinstance(raw_sites, Mapping) or not raw_sites:
        raise ScenarioError(f"{source}: expected a non-empty 'sites:' mapping")
    sites = []
    for name, raw in raw_sites.items():
        where = f"{source}: sites.{name}"
        if not isinstance(raw, Mapping):
            raise ScenarioError(f"{where}: expected a mapping")
        nodes = _number(raw, "nodes", where, minimum=1, strict=False)
        if not isinstance(nodes, int):
            raise ScenarioError(f"{where}: 'nodes' must be an integer, got {nodes!r}")
        gpn = raw.get("gpus_per_node")
        if gpn is not None and (isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1):
            raise ScenarioError(f"{where}: 'gpus_per_node' must be a positive integer")
        sites.append(
            ScenarioSite(
                name=str(name),
                nodes=nodes,
                walltime_h=float(_number(raw, "walltime_h", where, minimum=0, strict=True)),
                tokens_per_s_per_node=float(
                    _number(raw, "tokens_per_s_per_node", where, minimum=0, strict=True)
                ),
                queue_wait_h=float(_number(raw, "queue_wait_h", where, minimum=0, strict=False)),
                gpus_per_node=gpn,
            )
        )
    return Scenario(target, tuple(sites), name=str(data.get("name", "")))


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML file."""
    p = Path(path)
    if not p.is_file():
        raise ScenarioError(f"scenario not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{p}: invalid YAML: {exc}") from exc
    return parse_scenario(data, source=str(p))


def _as_planner_input(sc: Scenario, now: datetime) -> tuple[dict[str, SiteConfig], Any]:
    """Scenario sites as Slurm sites with one single-node shape and a fresh probe."""
    sites: dict[str, SiteConfig] = {}
    rows = []
    for s in sc.sites:
        gpn = s.gpus_per_node or 1
        shape = Shape(f"{gpn}x{s.walltime_h:g}h", "scenario", 1, gpn, s.walltime_h * 3600.0)
        sites[s.name] = SiteConfig(
            name=s.name,
            ranks=gpn,
            micro_batch=1,
            accumulation=1,
            tokens_per_s_per_gpu=s.tokens_per_s_per_node / gpn,
            scheduler="slurm",
            max_walltime_s=shape.walltime_s,
            qos_max_nodes=s.nodes,
            shapes=(shape,),
        )
        wait = s.queue_wait_h * 3600.0
        rows.append(
            probe_row(s.name, shape, ProbeResult(True, ProbeReason.OK, "", None, wait), now)
        )
    return sites, probe_frame(rows)


def simulate(sc: Scenario) -> Projection:
    """Project time-to-target for queue-aware placement and for waiting on all sites."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    sites, probes = _as_planner_input(sc, now)
    units = sc.target_tokens / _TOKENS_PER_UNIT
    params = PlanParams(units_total=units, units_per_round=units, tokens_per_unit=_TOKENS_PER_UNIT)
    plan = make_plan(sites, probes, params, now)
    t_h = (plan.predicted_finish_s or math.inf) / 3600.0

    last_wait = max(s.queue_wait_h for s in sc.sites) * 3600.0
    together = [Segment(last_wait, s.nodes * s.tokens_per_s_per_node) for s in sc.sites]
    base_h = finish_time(together, sc.target_tokens) / 3600.0

    out: dict[str, SiteProjection] = {}
    for s in sc.sites:
        sp = plan.sites[s.name]
        active = (sp.predicted_finish_s - sp.predicted_start_s) if sp.submit else 0.0
        out[s.name] = SiteProjection(
            wait_h=s.queue_wait_h,
            active_h=active / 3600.0,
            jobs=sp.jobs,
            tokens=sp.units * _TOKENS_PER_UNIT,
        )
    return Projection(
        target_tokens=sc.target_tokens,
        time_to_target_h=t_h,
        time_to_target_d=t_h / 24.0,
        baseline_h=base_h,
        speedup=1.0 - t_h / base_h,
        baseline_ratio=base_h / t_h,
        sites=out,
    )


def format_table(sc: Scenario, proj: Projection) -> str:
    """A readable Table-4-style summary."""
    head = f"{'site':<12}{'shape':>10}{'wait h':>9}{'active h':>10}{'jobs':>7}{'tokens':>10}"
    lines = [head, "-" * len(head)]
    for s in sc.sites:
        p = proj.sites[s.name]
        shape = f"{s.gpus_per_node or 1}x{s.walltime_h:g}h"
        lines.append(
            f"{s.name:<12}{shape:>10}{p.wait_h:>9.1f}{p.active_h:>10.1f}{p.jobs:>7d}"
            f"{p.tokens / 1e9:>9.1f}B"
        )
    lines.append(
        f"time to {sc.target_tokens / 1e9:g}B tokens: {proj.time_to_target_h:.1f} h "
        f"({proj.time_to_target_d:.2f} d); waiting for all sites: {proj.baseline_h:.1f} h "
        f"({proj.baseline_h / 24:.2f} d); queue-aware saves {proj.speedup:.0%}"
    )
    return "\n".join(lines)
