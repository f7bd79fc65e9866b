"""The round closing policy, case by case (pure function, no server)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from crossfed.coordinator.rounds import close_decision
from crossfed.coordinator.runspec import RoundPolicy

POLICY = RoundPolicy(join_window_s=10.0, deadline_s=100.0)


def decide(**kw) -> str | None:
    args = dict(
        opened_at=0.0,
        first_lease_at=5.0,
        now=50.0,
        deltas=1,
        active_leases=0,
        announced=0,
        policy=POLICY,
    )
    args.update(kw)
    return close_decision(**args)


def test_no_delta_keeps_the_round_open_forever() -> None:
    assert decide(deltas=0, now=1e9, active_leases=0) is None


def test_join_window_counts_from_the_first_lease_not_the_opening() -> None:
    assert decide(first_lease_at=45.0, now=50.0) is None
    assert decide(first_lease_at=45.0, now=55.0) == "all_in"
    assert decide(first_lease_at=None, now=9.0) is None  # no lease yet: from the opening


def test_active_leases_or_announced_sites_keep_it_open_until_the_deadline() -> None:
    assert decide(active_leases=1) is None
    assert decide(announced=1) is None
    assert decide(active_leases=1, now=100.0) == "deadline"
    assert decide(announced=2, now=150.0) == "deadline"


def test_everyone_in_closes() -> None:
    assert decide() == "all_in"


def test_when_every_site_of_the_run_delivered_the_join_window_is_not_waited_out() -> None:
    early = dict(first_lease_at=45.0, now=47.0, deltas=3)
    assert decide(**early) is None  # inside the window: a late starter might still join
    assert decide(**early, sites_left=1) is None  # one of the run's sites has not delivered
    assert decide(**early, sites_left=0) == "all_in"  # nobody is left to join
    assert decide(**early, sites_left=0, active_leases=1) is None  # a lease of it still live


@given(
    now=st.floats(0, 1e4),
    deltas=st.integers(0, 5),
    active=st.integers(0, 5),
    announced=st.integers(0, 5),
    first=st.one_of(st.none(), st.floats(0, 1e4)),
    left=st.one_of(st.none(), st.integers(0, 3)),
)
def test_never_closes_without_a_delta_or_inside_the_window(
    now, deltas, active, announced, first, left
) -> None:
    reason = decide(
        now=now, deltas=deltas, active_leases=active, announced=announced, first_lease_at=first,
        sites_left=left,
    )  # fmt: skip
    start = first if first is not None else 0.0
    if deltas == 0:
        assert reason is None
    elif now - start < POLICY.join_window_s:  # inside the window: only with every site in
        assert reason in (None, "all_in")
        assert (reason == "all_in") == (left == 0 and active == 0)
    if reason == "all_in":  # an announced site that already delivered has nothing to add
        assert active == 0 and (announced == 0 or left == 0)
    if reason == "deadline":
        assert now >= POLICY.deadline_s
