"""Round closing policy: pure, so its cases are tested without a server."""

from __future__ import annotations

from crossfed.coordinator.runspec import RoundPolicy


def close_decision(
    *, opened_at: float, now: float, deltas: int, active_leases: int, policy: RoundPolicy
) -> str | None:
    """Why round should close now, or None to keep it open.

    - No accepted delta: the round stays open whatever the time (zero live sites is normal).
    - Within ``join_window_s`` of opening, late starters may still lease: stay open.
    - Every lease of the round committed, released or expired: close ("all_in").
    - Past ``deadline_s`` with leases still out: close without the stragglers ("deadline");
      their later submissions are stale and rejected.
    """
    if deltas == 0:
        return None
    age = now - opened_at
    if age < policy.join_window_s:
        return None
    if active_leases == 0:
        return "all_in"
    if age >= policy.deadline_s:
        return "deadline"
    return None
