"""Slurm accounting: duration parsing, the walltime discount gamma, and per-GPU token rates.

Pure parsers take text or tables and a ``now``; ``run_sacct`` is the only function that
touches a process.

Walltime discount. ``sbatch --test-only`` assumes every queued job runs to its full time
limit, so its start estimates are pessimistic. gamma is the realised fraction of requested
walltime over a trailing window, estimated by default as the *ratio of sums*
``sum(Elapsed) / sum(Timelimit)``: it weights each job by the walltime it reserved, which is
what a queue estimate is built from, and one aborted job cannot drag it to zero the way it
could drag a mean of ratios. ``method="median"`` gives the median of per-job ratios instead.
The result is clipped to ``[floor, 1]``; with fewer than ``min_jobs`` usable jobs the
default (1.0, no discount) is returned and marked as such.
"""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, tzinfo
from pathlib import Path

import pandas as pd

from crossfed.config import SlurmDurationError, parse_slurm_duration

SACCT_FIELDS = ("JobID", "Elapsed", "Timelimit", "State", "Start", "End", "AllocTRES")
_UNFINISHED = {"RUNNING", "PENDING", "REQUEUED", "RESIZING", "SUSPENDED", "REQUEUE_HOLD"}


log = logging.getLogger(__name__)


class SlurmTimeError(ValueError):
    """A Slurm timestamp in no format crossfed can read."""


class SacctParseError(ValueError):
    """sacct output that does not have the expected fields."""


class SacctUnavailableError(RuntimeError):
    """sacct could not be run (missing binary, timeout, nonzero exit)."""


class JobLogError(ValueError):
    """A job log file (completed rounds per site) that is missing or malformed."""


# ----------------------------------------------------------------------------- timestamps

# Slurm prints times with slurm_make_time_str (src/common/parse_time.c): "standard" is
# %FT%T; "relative" picks by the distance from today: %H:%M:%S today, "Tomorr %H:%M",
# "Ystday %H:%M", "%a %H:%M" 2-6 days ahead, "%-d %b %H:%M" within a year, "%-d %b %Y"
# beyond; anything else with a '%' is a strftime format of the site's or user's choosing.
SLURM_TIME_ENV = {"SLURM_TIME_FORMAT": "standard"}
_NO_TIME = {"", "UNKNOWN", "NONE", "N/A"}
_WEEKDAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_HMS = re.compile(r"^(\d{1,2}):(\d\d):(\d\d)$")
_DAY_HM = re.compile(r"^(Tomorr|Ystday|Mon|Tue|Wed|Thu|Fri|Sat|Sun) (\d{1,2}):(\d\d)$")
_DATE_HM = re.compile(rf"^(\d{{1,2}}) ({'|'.join(_MONTHS)}) (\d{{1,2}}):(\d\d)$")
_DATE_Y = re.compile(rf"^(\d{{1,2}}) ({'|'.join(_MONTHS)}) (\d{{4}})$")
_EPOCH = re.compile(r"^\d{9,11}$")


def slurm_client_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a Slurm client command: ``base`` with standard (ISO) times."""
    return {**(os.environ if base is None else base), **SLURM_TIME_ENV}


def _near_year(month: int, day: int, today: datetime) -> int:
    """The year that puts ``month``/``day`` closest to ``today`` (relative dates omit it)."""
    years = []
    for y in (today.year - 1, today.year, today.year + 1):
        try:
            years.append((abs((datetime(y, month, day) - today.replace(tzinfo=None)).days), y))
        except ValueError:  # 29 Feb
            continue
    if not years:
        raise SlurmTimeError(f"no year has {day} {_MONTHS[month - 1]}")
    return min(years)[1]


def parse_slurm_time(text: str, now: datetime, *, tz: tzinfo | None = None) -> datetime | None:
    """A Slurm timestamp in any ``SLURM_TIME_FORMAT`` crossfed can read; None if unset.

    Reads ISO (``standard`` and ``%F %T``), every ``relative`` form (resolved against
    ``now``, the moment the command ran) and ``%s`` epoch seconds. Naive ``now`` gives
    naive results; an aware ``now`` gives times in ``tz`` (default: ``now``'s zone), the
    cluster's local time. Anything else raises SlurmTimeError with the text.
    """
    s = text.strip()
    if s.upper() in _NO_TIME:
        return None
    zone = (tz or now.tzinfo) if now.tzinfo is not None else None
    local = now.astimezone(zone) if zone is not None else now

    def at(day: datetime, h: int, mi: int, sec: int = 0) -> datetime:
        return day.replace(hour=h, minute=mi, second=sec, microsecond=0)

    try:
        if _EPOCH.match(s):
            when = datetime.fromtimestamp(int(s), tz=zone)
            return when
        try:
            when = datetime.fromisoformat(s)
        except ValueError:
            pass
        else:
            if when.tzinfo is None:
                return when.replace(tzinfo=zone)
            return (
                when.astimezone(zone)
                if zone is not None
                else when.astimezone().replace(tzinfo=None)
            )
        if m := _HMS.match(s):
            return at(local, int(m[1]), int(m[2]), int(m[3]))
        if m := _DAY_HM.match(s):
            word, h, mi = m[1], int(m[2]), int(m[3])
            if word == "Tomorr":
                offset = 1
            elif word == "Ystday":
                offset = -1
            else:  # the weekday 2 to 6 days ahead
                offset = next(
                    d for d in range(2, 7) if _WEEKDAYS[(local.weekday() + d) % 7] == word
                )
            return at(local + timedelta(days=offset), h, mi)
        if m := _DATE_HM.match(s):
            month, day = _MONTHS.index(m[2]) + 1, int(m[1])
            year = _near_year(month, day, local)
            return at(local.replace(year=year, month=month, day=day), int(m[3]), int(m[4]))
        if m := _DATE_Y.match(s):
            month, day = _MONTHS.index(m[2]) + 1, int(m[1])
            return at(local.replace(year=int(m[3]), month=month, day=day), 0, 0)
    except (ValueError, OverflowError, OSError) as exc:
        raise SlurmTimeError(f"not a Slurm timestamp: {text!r} ({exc})") from exc
    raise SlurmTimeError(
        f"not a Slurm timestamp: {text!r} (SLURM_TIME_FORMAT other than standard/relative?)"
    )


@dataclass(frozen=True)
class SacctRecord:
    """One allocation line of ``sacct -X -P``."""

    job_id: str
    elapsed_s: float
    timelimit_s: float | None
    state: str
    start: datetime | None
    end: datetime | None
    alloc_tres: dict[str, str] = field(default_factory=dict)
    unparsed: tuple[str, ...] = ()  # "Start='Ma 14:05'": timestamps in no known format

    @property
    def gpus(self) -> int:
        """GPUs allocated (``gres/gpu`` in AllocTRES), 0 when absent."""
        raw = self.alloc_tres.get("gres/gpu", "0")
        try:
            return int(raw)
        except ValueError:
            return 0


def _parse_tres(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in text.strip().split(","):
        if "=" in item:
            k, v = item.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _duration_or(text: str, empty: float | None) -> float | None:
    """A Slurm duration, or ``empty`` for a field slurmdbd has not filled in yet."""
    return parse_slurm_duration(text) if text.strip() else empty


def parse_sacct(text: str, now: datetime | None = None) -> list[SacctRecord]:
    """Parse ``sacct -X -P -n -o JobID,Elapsed,Timelimit,State,Start,End,AllocTRES`` output.

    A row with an empty Elapsed or Timelimit (a pending job, or one that ended seconds ago:
    slurmdbd fills those fields in a little later) is kept with elapsed 0 and no limit, so
    the walltime discount skips it instead of the whole capture failing. Start and End may
    be in any ``SLURM_TIME_FORMAT`` that ``parse_slurm_time`` reads, ``relative`` ones
    resolved against ``now`` (when sacct ran; default: the clock); one in no known format
    leaves that time unset and its raw text in ``unparsed``, so the discount skips the row.
    """
    ref = now if now is not None else datetime.now()
    records: list[SacctRecord] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        cols = line.split("|")
        if len(cols) != len(SACCT_FIELDS):
            raise SacctParseError(
                f"sacct line {lineno}: expected {len(SACCT_FIELDS)} '|'-separated fields "
                f"({','.join(SACCT_FIELDS)}), got {len(cols)}: {line!r}"
            )
        if cols[0].strip() == "JobID":  # a header line slipped through
            continue
        try:
            elapsed = _duration_or(cols[1], 0.0) or 0.0
            limit = _duration_or(cols[2], None)
        except SlurmDurationError as exc:
            raise SacctParseError(f"sacct line {lineno}: {exc}") from exc
        times: dict[str, datetime | None] = {}
        unparsed: list[str] = []
        for name, raw in (("Start", cols[4]), ("End", cols[5])):
            try:
                times[name] = parse_slurm_time(raw, ref)
            except SlurmTimeError:
                times[name] = None
                unparsed.append(f"{name}={raw.strip()!r}")
        if unparsed:
            log.warning("sacct line %d: unreadable %s; row skipped", lineno, ", ".join(unparsed))
        records.append(
            SacctRecord(
                job_id=cols[0].strip(),
                elapsed_s=elapsed,
                timelimit_s=limit,
                state=cols[3].strip(),
                start=times["Start"],
                end=times["End"],
                alloc_tres=_parse_tres(cols[6]),
                unparsed=tuple(unparsed),
            )
        )
    return records


@dataclass(frozen=True)
class Discount:
    """The walltime discount and the evidence behind it."""

    gamma: float
    jobs: int
    method: str  # "ratio", "median" or "default"
    unparsed: int = 0  # rows skipped for timestamps in no known format


def _comparable(a: datetime, b: datetime) -> tuple[datetime, datetime]:
    if (a.tzinfo is None) != (b.tzinfo is None):
        a, b = a.astimezone(), b.astimezone()
    return a, b


def walltime_discount(
    records: list[SacctRecord],
    now: datetime,
    *,
    window_s: float = 14 * 86400.0,
    method: str = "ratio",
    min_jobs: int = 3,
    floor: float = 0.05,
    default: float = 1.0,
) -> Discount:
    """gamma = realised / requested walltime over jobs that ended within ``window_s``."""
    if method not in {"ratio", "median"}:
        raise ValueError(f"unknown gamma method {method!r} (use 'ratio' or 'median')")
    used: list[tuple[float, float]] = []
    unparsed = sum(1 for r in records if r.unparsed)
    for r in records:
        state = r.state.split()[0].upper() if r.state else ""
        if state in _UNFINISHED or r.end is None or r.start is None:
            continue
        if r.timelimit_s is None or r.timelimit_s <= 0 or r.elapsed_s <= 0:
            continue
        end, ref = _comparable(r.end, now)
        if (ref - end).total_seconds() > window_s:
            continue
        used.append((min(r.elapsed_s, r.timelimit_s), r.timelimit_s))
    if len(used) < min_jobs:
        return Discount(gamma=default, jobs=len(used), method="default", unparsed=unparsed)
    if method == "ratio":
        g = sum(e for e, _ in used) / sum(t for _, t in used)
    else:
        g = statistics.median(e / t for e, t in used)
    g = min(1.0, max(floor, g))
    return Discount(gamma=g, jobs=len(used), method=method, unparsed=unparsed)


def run_sacct(
    start: datetime, *, sacct: str = "sacct", timeout_s: float = 60.0, extra: tuple[str, ...] = ()
) -> str:
    """Run sacct for allocations since ``start`` and return its raw text (ISO times)."""
    cmd = [sacct, "-X", "-P", "-n", "-o", ",".join(SACCT_FIELDS), "-S"]
    cmd += [start.strftime("%Y-%m-%dT%H:%M:%S"), *extra]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env=slurm_client_env()
        )
    except FileNotFoundError as exc:
        raise SacctUnavailableError(f"sacct not found: {sacct}") from exc
    except subprocess.TimeoutExpired as exc:
        raise SacctUnavailableError(f"sacct timed out after {timeout_s:g}s") from exc
    if proc.returncode != 0:
        raise SacctUnavailableError(f"sacct exited {proc.returncode}: {proc.stderr.strip()[:500]}")
    return proc.stdout


def sacct_window_start(now: datetime, window_s: float) -> datetime:
    """The ``-S`` argument for a trailing window ending at ``now``."""
    return now - timedelta(seconds=window_s)


# ----------------------------------------------------------------------------- rates

JOB_LOG_COLUMNS = ("site", "tokens", "seconds", "gpus")


@dataclass(frozen=True)
class Rate:
    """Per-GPU token rate of a site and where it came from."""

    tokens_per_s_per_gpu: float
    source: str  # "history" or "prior"
    rounds: int


def load_job_log(path: str | Path) -> pd.DataFrame:
    """Read completed rounds (CSV, or JSON list / ``{"rounds": [...]}``) into a table."""
    p = Path(path)
    if not p.is_file():
        raise JobLogError(f"job log not found: {p}")
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(p.read_text())
            if isinstance(data, Mapping):
                data = data.get("rounds")
            if not isinstance(data, list):
                raise JobLogError(f"{p}: expected a list of rounds or {{'rounds': [...]}}")
            df = pd.DataFrame(data)
        else:
            df = pd.read_csv(p)
    except (json.JSONDecodeError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise JobLogError(f"{p}: cannot parse job log: {exc}") from exc
    return validate_job_log(df, source=str(p))


def validate_job_log(df: pd.DataFrame, *, source: str = "job log") -> pd.DataFrame:
    """Check the columns and types of a job log table."""
    missing = [c for c in JOB_LOG_COLUMNS if c not in df.columns]
    if missing:
        raise JobLogError(f"{source}: missing columns {missing} (need {list(JOB_LOG_COLUMNS)})")
    out = df.copy()
    out["site"] = out["site"].astype(str)
    for col in ("tokens", "seconds", "gpus"):
        out[col] = pd.to_numeric(out[col], errors="coerce")
        if out[col].isna().any():
            raise JobLogError(f"{source}: non-numeric values in column {col!r}")
    return out


def per_gpu_rates(
    job_log: pd.DataFrame | None, priors: Mapping[str, float], *, min_rounds: int = 1
) -> dict[str, Rate]:
    """tokens / (seconds * gpus) per site from history, else the configured prior."""
    rates = {site: Rate(float(p), "prior", 0) for site, p in priors.items()}
    if job_log is None or job_log.empty:
        return rates
    good = job_log[(job_log["seconds"] > 0) & (job_log["gpus"] > 0) & (job_log["tokens"] >= 0)]
    for site, rows in good.groupby("site"):
        if len(rows) < min_rounds:
            continue
        gpu_s = float((rows["seconds"] * rows["gpus"]).sum())
        rates[str(site)] = Rate(float(rows["tokens"].sum()) / gpu_s, "history", len(rows))
    return rates
