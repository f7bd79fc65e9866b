"""Queue probes: ``sbatch --test-only`` per job shape, parsed into a timestamped table.

``parse_test_only`` is pure (text in, ``ProbeResult`` out); ``run_test_only`` is the thin
subprocess runner; ``collect_probes`` turns a site config into a probe table. Nothing is
ever enqueued: ``--test-only`` only asks the scheduler where the job would start.

The sites it probes are :class:`crossfed.config.SiteConfig`, the run's one site type.
"""

from __future__ import annotations

import math
import re
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, tzinfo
from pathlib import Path
from typing import Any

import pandas as pd

from crossfed.config import Shape, SiteConfig, SitesConfigError, format_slurm_duration
from crossfed.sched.columns import PROBE_COLUMNS
from crossfed.sched.sacct import SlurmTimeError, parse_slurm_time, slurm_client_env
from crossfed.sched.slurm_messages import ProbeReason, classify_failure

LOCAL_DETAIL = "local profile: no batch scheduler, jobs start now"


class ProbeTableError(ValueError):
    """A probe CSV that is missing or lacks required columns."""


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
