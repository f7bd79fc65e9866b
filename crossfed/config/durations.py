"""Slurm durations (``[D-]HH:MM:SS``, ``sbatch -t`` forms) to seconds and back; pure."""

from __future__ import annotations

import math
import re

_UNLIMITED = {"UNLIMITED", "PARTITION_LIMIT", "INFINITE", "NONE", "INVALID"}
_DURATION = re.compile(
    r"^(?:(?P<days>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+(?:\.\d+)?))?(?::(?P<c>\d+(?:\.\d+)?))?$"
)


class SlurmDurationError(ValueError):
    """A Slurm duration string that cannot be parsed."""


def parse_slurm_duration(text: str | float | int) -> float | None:
    """Seconds in a Slurm duration; ``None`` for UNLIMITED / Partition_Limit.

    Accepts sacct's ``[D-]HH:MM:SS`` and ``MM:SS`` (optionally with fractional seconds) and
    sbatch's ``-t`` forms: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``.
    A bare number is minutes, as for ``sbatch -t``.
    """
    if isinstance(text, bool):
        raise SlurmDurationError(f"not a Slurm duration: {text!r}")
    if isinstance(text, int | float):
        if not math.isfinite(text) or text < 0:
            raise SlurmDurationError(f"not a Slurm duration: {text!r}")
        return float(text) * 60.0
    s = str(text).strip()
    if s.upper() in _UNLIMITED:
        return None
    m = _DURATION.match(s)
    if not m:
        raise SlurmDurationError(f"not a Slurm duration: {text!r}")
    days, a, b, c = m.group("days"), m.group("a"), m.group("b"), m.group("c")
    parts = [float(p) for p in (a, b, c) if p is not None]
    if days is not None:
        # D-H, D-H:M, D-H:M:S
        h, mi, se = (parts + [0.0, 0.0])[:3]
        return int(days) * 86400.0 + h * 3600.0 + mi * 60.0 + se
    if len(parts) == 1:
        return parts[0] * 60.0
    if len(parts) == 2:
        return parts[0] * 60.0 + parts[1]
    return parts[0] * 3600.0 + parts[1] * 60.0 + parts[2]


def format_slurm_duration(seconds: float) -> str:
    """``[D-]HH:MM:SS`` for ``sbatch -t`` (rounded up to whole seconds)."""
    if not math.isfinite(seconds) or seconds < 0:
        raise SlurmDurationError(f"cannot format duration {seconds!r}")
    total = math.ceil(seconds - 1e-9)
    days, rest = divmod(total, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    hms = f"{h:02d}:{m:02d}:{s:02d}"
    return f"{days}-{hms}" if days else hms
