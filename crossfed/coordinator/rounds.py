"""Round closing policy: pure, so its cases are tested without a server."""

from __future__ import annotations

from collections.abc import Iterable

from crossfed.coordinator.runspec import RoundPolicy


def next_global_step(global_step: int, delta_steps: Iterable[int], inner_steps: int) -> int:
    """The global step the round after one starting at ``global_step`` starts at: that round's
    longest inner phase among ``delta_steps`` (its deltas' step counts), ``inner_steps``
    while it has none. Exact for a round being merged; for an open round a forecast."""
    return global_step + max(delta_steps, default=inner_steps)


def close_decision(
    *,
    opened_at: float,
    first_lease_at: float | None,
    now: float,
    deltas: int,
    active_leases: int,
    announced: int,
    policy: RoundPolicy,
    sites_left: int | None = None,
) -> str | None:
    """Why the round should close now, or None to keep it open.

    - No accepted delta: the round stays open whatever the time (zero live sites is normal).
    - Every site of the run delivered (``sites_left`` 0: no site without a delta for the
      round) and no lease of the round is active: close at once ("all_in"); nobody is left
      to join, so the join window does not apply.
    - Within ``join_window_s`` of the round's first lease, late starters may still join.
    - A site that registered for this round but has not leased yet ("announced", counted by
      the caller only within ``join_window_s`` of its registration) keeps the round open.
    - Every lease of the round committed, released or expired, and nobody announced: close
      ("all_in").
    - ``deadline_s`` after the round opened, leases or announcements still outstanding: close
      without the stragglers ("deadline"); their later deltas are stale and rejected.
    """
    if deltas == 0:
        return None
    if sites_left == 0 and active_leases == 0:
        return "all_in"
    start = first_lease_at if first_lease_at is not None else opened_at
    if now - start < policy.join_window_s:
        return None
    if active_leases == 0 and announced == 0:
        return "all_in"
    if now - opened_at >= policy.deadline_s:
        return "deadline"
    return None
