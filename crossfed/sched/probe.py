"""Queue probes: ``sbatch --test-only`` per job shape, parsed into a timestamped table.

``parse_test_only`` is pure (text in, ``ProbeResult`` out); ``run_test_only`` is the thin
subprocess runner; ``collect_probes`` turns a site config into a probe table. Nothing is
ever enqueued: ``--test-only`` only asks the scheduler where the job would start.

This module also holds the site configuration (``config/sites.yaml``) the probe and the
planner share.
"""

from __future__ import annotations

import math
import re
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, tzinfo
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from crossfed.sched.columns import PROBE_COLUMNS
from crossfed.sched.sacct import (
    SlurmDurationError,
    SlurmTimeError,
    format_slurm_duration,
    parse_slurm_duration,
    parse_slurm_time,
    slurm_client_env,
)
from crossfed.sched.slurm_messages import ProbeReason, classify_failure

LOCAL_DETAIL = "local profile: no batch scheduler, jobs start now"


class SitesConfigError(ValueError):
    """config/sites.yaml is missing, unreadable or lacks a key the scheduler needs."""


class ProbeTableError(ValueError):
    """A probe CSV that is missing or lacks required columns."""


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Shape:
    """A job shape: partition, node count, GPUs per node and walltime."""

    name: str
    partition: str
    nodes: int
    gpus_per_node: int
    walltime_s: float

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class SiteConfig:
    """The scheduler-relevant part of one site in ``config/sites.yaml``."""

    name: str
    ranks: int
    micro_batch: int
    accumulation: int
    tokens_per_s_per_gpu: float
    scheduler: str = "none"
    rtt_ms: float = 0.0
    max_walltime_s: float = math.inf
    qos_max_nodes: int = 1
    account: str | None = None
    shapes: tuple[Shape, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def has_scheduler(self) -> bool:
        return self.scheduler != "none"

    def shape(self, name: str) -> Shape | None:
        return next((s for s in self.shapes if s.name == name), None)


def _need(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise SitesConfigError(f"{where}: missing required key {key!r}")
    return d[key]


def _num(value: Any, key: str, where: str, *, integer: bool = False, minimum: float = 0) -> Any:
    if isinstance(value, str) and not integer:  # YAML 1.1 reads ``1.2e4`` as a string
        try:
            value = float(value)
        except ValueError:
            pass
    ok_type = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_type):
        kind = "an integer" if integer else "a number"
        raise SitesConfigError(f"{where}: {key!r} must be {kind}, got {value!r}")
    if value < minimum or (not integer and not math.isfinite(value)):
        raise SitesConfigError(f"{where}: {key!r} must be >= {minimum}, got {value!r}")
    return value


def _parse_shape(raw: Any, where: str) -> Shape:
    if not isinstance(raw, Mapping):
        raise SitesConfigError(f"{where}: a shape must be a mapping, got {raw!r}")
    name = str(_need(raw, "name", where))
    where = f"{where} {name!r}"
    wall = _need(raw, "walltime", where)
    try:
        wall_s = parse_slurm_duration(wall)
    except SlurmDurationError as exc:
        raise SitesConfigError(f"{where}: walltime: {exc}") from exc
    if wall_s is None or wall_s <= 0:
        raise SitesConfigError(f"{where}: walltime must be a finite positive duration")
    return Shape(
        name=name,
        partition=str(_need(raw, "partition", where)),
        nodes=_num(_need(raw, "nodes", where), "nodes", where, integer=True, minimum=1),
        gpus_per_node=_num(raw.get("gpus_per_node", 0), "gpus_per_node", where, integer=True),
        walltime_s=wall_s,
    )


def parse_site(name: str, raw: Any) -> SiteConfig:
    """Validate one site mapping; unknown keys are kept in ``extra``."""
    where = f"sites.{name}"
    if not isinstance(raw, Mapping):
        raise SitesConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    scheduler = str(raw.get("scheduler", "none")).lower()
    if scheduler not in {"none", "slurm"}:
        raise SitesConfigError(f"{where}: scheduler must be 'none' or 'slurm', got {scheduler!r}")
    shapes_raw = raw.get("shapes") or []
    if not isinstance(shapes_raw, list):
        raise SitesConfigError(f"{where}: shapes must be a list")
    shapes = tuple(_parse_shape(s, f"{where}.shapes[{i}]") for i, s in enumerate(shapes_raw))
    if len({s.name for s in shapes}) != len(shapes):
        raise SitesConfigError(f"{where}: shape names must be unique")
    if scheduler == "slurm" and not shapes:
        raise SitesConfigError(f"{where}: a slurm site needs at least one shape")
    max_wall_h = raw.get("max_walltime_h")
    max_wall = math.inf
    if max_wall_h is not None:
        max_wall = _num(max_wall_h, "max_walltime_h", where) * 3600.0
    elif scheduler == "slurm":
        raise SitesConfigError(f"{where}: missing required key 'max_walltime_h'")
    qos_default = None if scheduler == "slurm" else 1
    qos = raw.get("qos_max_nodes", qos_default)
    if qos is None:
        raise SitesConfigError(f"{where}: missing required key 'qos_max_nodes'")
    account = raw.get("account")
    known = {
        "ranks",
        "micro_batch",
        "accumulation",
        "rtt_ms",
        "scheduler",
        "max_walltime_h",
        "qos_max_nodes",
        "tokens_per_s_per_gpu",
        "account",
        "shapes",
    }
    return SiteConfig(
        name=name,
        ranks=_num(_need(raw, "ranks", where), "ranks", where, integer=True, minimum=1),
        micro_batch=_num(
            _need(raw, "micro_batch", where), "micro_batch", where, integer=True, minimum=1
        ),
        accumulation=_num(
            raw.get("accumulation", 1), "accumulation", where, integer=True, minimum=1
        ),
        tokens_per_s_per_gpu=float(
            _num(_need(raw, "tokens_per_s_per_gpu", where), "tokens_per_s_per_gpu", where)
        ),
        scheduler=scheduler,
        rtt_ms=float(_num(raw.get("rtt_ms", 0), "rtt_ms", where)),
        max_walltime_s=float(max_wall),
        qos_max_nodes=_num(qos, "qos_max_nodes", where, integer=True, minimum=1),
        account=None if account in (None, "") else str(account),
        shapes=shapes,
        extra={k: v for k, v in raw.items() if k not in known},
    )


def parse_sites(data: Any, *, source: str = "sites config") -> dict[str, SiteConfig]:
    """Validate the ``sites:`` mapping of a loaded sites.yaml."""
    if not isinstance(data, Mapping) or not isinstance(data.get("sites"), Mapping):
        raise SitesConfigError(f"{source}: expected a top-level 'sites:' mapping")
    if not data["sites"]:
        raise SitesConfigError(f"{source}: 'sites:' is empty")
    return {str(n): parse_site(str(n), raw) for n, raw in data["sites"].items()}


def load_sites_yaml(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a sites.yaml, with clear errors for a missing or broken file."""
    p = Path(path)
    if not p.is_file():
        raise SitesConfigError(f"sites config not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise SitesConfigError(f"{p}: invalid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise SitesConfigError(f"{p}: expected a mapping at the top level")
    return dict(data)


def load_sites(path: str | Path) -> dict[str, SiteConfig]:
    """Load and validate ``config/sites.yaml``."""
    return parse_sites(load_sites_yaml(path), source=str(path))


# ----------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class ProbeResult:
    """The outcome of one ``sbatch --test-only``."""

    ok: bool
    reason: ProbeReason
    detail: str
    est_start: datetime | None = None
    wait_s: float | None = None
    job_id: str | None = None


# "Job 8 to start at 2026-11-29T17:30:59 using 1 processors on nodes n1 in partition gpu"
# (src/api/allocate.c, 22.05-24.11); 25.05 and 25.11 print "... at <time>[ on cluster C] a
# using ...". The time is whatever SLURM_TIME_FORMAT makes of it, spaces included.
_START = re.compile(
    r"(?:Job\s+(?P<job>\d+)\s+)?to start at\s+(?P<ts>.+?)"
    r"(?:\s+on cluster\s+\S+)?(?:\s+a)?\s+using\s+\d+\s+processors"
)
_START_BARE = re.compile(r"(?:Job\s+(?P<job>\d+)\s+)?to start at\s+(?P<ts>\S+)")


def _detail(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (" | ".join(errors or lines))[:500]


def parse_test_only(
    stdout: str, stderr: str, returncode: int, now: datetime, *, tz: tzinfo | None = None
) -> ProbeResult:
    """Parse one ``sbatch --test-only`` run into a typed result.

    Slurm prints the estimate on stderr, e.g. ``sbatch: Job 8 to start at
    2026-11-29T17:30:59 using 1 processors on nodes n1 in partition gpu``. The timestamp is
    the cluster's local time in any format ``parse_slurm_time`` reads (``relative`` ones
    against ``now``); when ``now`` is timezone-aware it is read in ``tz`` (default:
    ``now``'s zone). The wait is clipped at zero (a start "in the past" means now). A
    start time in no known format is ``unparsed`` with the raw text in the detail.
    Failures are read by ``slurm_messages.classify_failure``.
    """
    text = f"{stderr}\n{stdout}"
    if returncode == 0:
        m = _START.search(text) or _START_BARE.search(text)
        if m:
            try:
                est = parse_slurm_time(m.group("ts"), now, tz=tz)
            except SlurmTimeError as exc:
                return ProbeResult(False, ProbeReason.UNPARSED, str(exc), job_id=m.group("job"))
            if est is None:
                detail = f"no start estimate: {m.group('ts')!r}"
                return ProbeResult(False, ProbeReason.UNPARSED, detail, job_id=m.group("job"))
            wait = max(0.0, (est - now).total_seconds())
            return ProbeResult(True, ProbeReason.OK, "", est, wait, m.group("job"))
        return ProbeResult(False, ProbeReason.UNPARSED, _detail(text) or "no start estimate")
    reason = classify_failure(text)
    return ProbeResult(False, reason, _detail(text) or f"sbatch exited {returncode}")


# ----------------------------------------------------------------------------- running


def sbatch_argv(site: SiteConfig, shape: Shape, *, sbatch: str = "sbatch") -> list[str]:
    """The ``sbatch --test-only`` argv for one shape (nothing is enqueued)."""
    cmd = [sbatch, "--test-only", "-J", "crossfed-probe", "-p", shape.partition]
    cmd += ["-N", str(shape.nodes)]
    if shape.gpus_per_node > 0:
        cmd.append(f"--gres=gpu:{shape.gpus_per_node}")
    cmd += ["-t", format_slurm_duration(shape.walltime_s)]
    if site.account:
        cmd += ["-A", site.account]
    cmd += ["--wrap", "true"]
    return cmd


Runner = Callable[[Sequence[str], float], tuple[str, str, int]]


def subprocess_runner(cmd: Sequence[str], timeout_s: float) -> tuple[str, str, int]:
    """Run a Slurm command; raises FileNotFoundError / TimeoutExpired as subprocess does.

    The command prints ISO times (``SLURM_TIME_FORMAT=standard``) whatever the caller set.
    """
    proc = subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout_s, env=slurm_client_env()
    )
    return proc.stdout, proc.stderr, proc.returncode


def run_test_only(
    site: SiteConfig,
    shape: Shape,
    now: datetime,
    *,
    sbatch: str = "sbatch",
    timeout_s: float = 30.0,
    runner: Runner = subprocess_runner,
    tz: tzinfo | None = None,
) -> ProbeResult:
    """Probe one shape; a missing sbatch or a timeout becomes a typed reason, not a crash."""
    cmd = sbatch_argv(site, shape, sbatch=sbatch)
    try:
        stdout, stderr, rc = runner(cmd, timeout_s)
    except FileNotFoundError:
        return ProbeResult(False, ProbeReason.UNAVAILABLE, f"sbatch not found: {sbatch}")
    except PermissionError as exc:
        return ProbeResult(False, ProbeReason.UNAVAILABLE, f"sbatch not executable: {exc}")
    except subprocess.TimeoutExpired:
        return ProbeResult(False, ProbeReason.TIMEOUT, f"sbatch timed out after {timeout_s:g}s")
    return parse_test_only(stdout, stderr, rc, now, tz=tz)


def probe_row(
    site: str, shape: Shape | None, result: ProbeResult, probed_at: datetime
) -> dict[str, Any]:
    """One row of the probe table."""
    return {
        "probed_at": probed_at.isoformat(),
        "site": site,
        "shape": shape.name if shape else "",
        "partition": shape.partition if shape else "",
        "nodes": shape.nodes if shape else 0,
        "gpus_per_node": shape.gpus_per_node if shape else 0,
        "walltime_s": shape.walltime_s if shape else math.nan,
        "ok": result.ok,
        "reason": str(result.reason),
        "detail": result.detail,
        "est_start": result.est_start.isoformat() if result.est_start else "",
        "wait_s": result.wait_s if result.wait_s is not None else math.nan,
        "job_id": result.job_id or "",
    }


def collect_probes(
    sites: Mapping[str, SiteConfig],
    now: datetime,
    *,
    only: Iterable[str] | None = None,
    sbatch: str = "sbatch",
    timeout_s: float = 30.0,
    runner: Runner = subprocess_runner,
    tz: tzinfo | None = None,
) -> pd.DataFrame:
    """Probe every shape of every (selected) site and return the probe table."""
    wanted = set(only) if only is not None else None
    if wanted is not None and (unknown := wanted - set(sites)):
        raise SitesConfigError(f"unknown site(s) {sorted(unknown)}; known: {sorted(sites)}")
    rows: list[dict[str, Any]] = []
    for name, site in sites.items():
        if wanted is not None and name not in wanted:
            continue
        if not site.has_scheduler:
            local = ProbeResult(False, ProbeReason.NO_SCHEDULER, LOCAL_DETAIL, now, 0.0)
            for shape in site.shapes or (None,):
                rows.append(probe_row(name, shape, local, now))
            continue
        for shape in site.shapes:
            res = run_test_only(
                site, shape, now, sbatch=sbatch, timeout_s=timeout_s, runner=runner, tz=tz
            )
            rows.append(probe_row(name, shape, res, now))
    return probe_frame(rows)


def probe_frame(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """A probe table with the canonical column order and dtypes."""
    df = pd.DataFrame(list(rows), columns=list(PROBE_COLUMNS))
    return _typed(df)


def _typed(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    for col in ("probed_at", "site", "shape", "partition", "reason", "detail", "est_start"):
        out[col] = out[col].fillna("").astype(str)
    out["job_id"] = out["job_id"].fillna("").astype(str) if "job_id" in out else ""
    for col in ("nodes", "gpus_per_node"):
        out[col] = pd.to_numeric(out[col], errors="coerce").fillna(0).astype(int)
    for col in ("walltime_s", "wait_s"):
        out[col] = pd.to_numeric(out[col], errors="coerce").astype(float)
    out["ok"] = out["ok"].map(_as_bool).astype(bool)
    return out


def _as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in {"true", "1", "yes"}
    return bool(v) if v is not None and v == v else False


def write_probes(df: pd.DataFrame, path: str | Path) -> None:
    """Write a probe table as CSV."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(p, index=False)


def append_history(df: pd.DataFrame, path: str | Path) -> None:
    """Append probe rows to a history CSV (header written once)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    exists = p.is_file() and p.stat().st_size > 0
    df.to_csv(p, mode="a", header=not exists, index=False, columns=list(PROBE_COLUMNS))


def read_probes(path: str | Path) -> pd.DataFrame:
    """Read a probe (or probe history) CSV."""
    p = Path(path)
    if not p.is_file():
        raise ProbeTableError(f"probe table not found: {p}")
    try:
        df = pd.read_csv(p, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ProbeTableError(f"{p}: cannot parse probe table: {exc}") from exc
    required = [c for c in PROBE_COLUMNS if c != "job_id"]
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ProbeTableError(f"{p}: missing columns {missing}")
    if "job_id" not in df.columns:
        df["job_id"] = ""
    return _typed(df[list(PROBE_COLUMNS)])


def as_aware(dt: datetime) -> datetime:
    """A timezone-aware datetime; naive values are read as this machine's local time."""
    return dt if dt.tzinfo is not None else dt.astimezone()
