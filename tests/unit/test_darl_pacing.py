"""DARL pacing: commit rates, rate-proportional grant sizes, and the restart grace."""

import sqlite3

import pytest

from crossfed.darl.leases import RATE_WINDOW, LeaseBook, LeaseError
from crossfed.darl.ledger import LedgerStore, apply_event

TTL = 10.0


def book_with(*sites: str, n_blocks: int = 1000) -> LeaseBook:
    book = LeaseBook(n_blocks)
    for site in sites:
        book.register(site, 0.0)
    return book


def work(book: LeaseBook, site: str, n: int, start: float, seconds: float) -> None:
    """Lease n blocks at `start` and commit all of them `seconds` later."""
    lease = book.grant(site, n, start, seconds + 1.0, 1)
    assert lease is not None and lease.n_blocks == n
    book.commit(lease.lease_id, site, n, start + seconds)


def test_commit_rate_is_blocks_over_lease_time_of_the_last_commits():
    book = book_with("a")
    assert book.commit_rate("a") is None
    work(book, "a", 10, 0.0, 5.0)
    assert book.commit_rate("a") == pytest.approx(2.0)
    work(book, "a", 10, 5.0, 20.0)  # slower now: 20 blocks in 25 s over both commits
    assert book.commit_rate("a") == pytest.approx(20 / 25)
    for k in range(RATE_WINDOW):  # old commits fall out of the window
        work(book, "a", 4, 100.0 + k, 1.0)
    assert book.commit_rate("a") == pytest.approx(4.0)


def test_partial_commits_count_only_the_trained_blocks():
    book = book_with("a")
    lease = book.grant("a", 10, 0.0, TTL, 1)
    book.commit(lease.lease_id, "a", 3, 2.0)
    assert book.commit_rate("a") == pytest.approx(1.5)
    lease = book.grant("a", 10, 2.0, TTL, 2)
    book.commit(lease.lease_id, "a", 0, 3.0)  # an empty commit measures nothing
    assert book.commit_rate("a") == pytest.approx(1.5)


def test_grants_follow_commit_rates_and_equalise_lease_time():
    book = book_with("fast", "slow", "new")
    work(book, "fast", 10, 0.0, 2.0)  # 5 blocks/s
    work(book, "slow", 10, 0.0, 10.0)  # 1 block/s
    # mean pace (0.5 + 0.1) / 2 = 0.3 phases/s: grants 10*0.5/0.3 and 10*0.1/0.3
    assert book.grant_size("fast", 10, 11.0) == 17
    assert book.grant_size("slow", 10, 11.0) == 3
    assert 17 / 5.0 == pytest.approx(3 / 1.0, rel=0.15)  # both leases last about 3.3 s
    assert book.grant_size("new", 10, 11.0) == 10  # no rate yet: what it asked for


def test_step_rates_size_grants_before_any_commit_and_outrank_commit_rates():
    book = book_with("fast", "slow")
    book.grant("fast", 10, 0.0, TTL, 1)
    book.grant("slow", 10, 0.0, TTL, 1)
    # no commit yet: the step times alone (blocks per second of compute) size round 2
    rates = {"fast": 5.0, "slow": 1.0}
    assert book.grant_size("fast", 10, 1.0, step_rates=rates) == 17
    assert book.grant_size("slow", 10, 1.0, step_rates=rates) == 3
    # a commit rate that counts waiting and uploads gives way to the step rate
    lease = book.grant("fast", 10, 1.0, TTL, 2)
    book.commit(lease.lease_id, "fast", 10, 10.5)  # about 1 block/s of lease time
    assert book.grant_size("fast", 10, 12.0) == 10  # by commit rate: the only one
    assert book.grant_size("fast", 10, 12.0, step_rates=rates) == 17
    # a step rate that is no rate falls back to the commit rate (about 1 block/s: equal)
    assert book.grant_size("slow", 10, 12.0, step_rates={"slow": 1.0, "fast": -1.0}) == 10


def test_a_site_without_a_rate_gets_a_probe_of_its_phase_and_is_paced_once_it_has_one():
    book = book_with("fast", "slow")
    # the first round: no step time and no commit yet, so every site gets the probe share
    assert book.grant_size("fast", 40, 0.0, probe_share=0.25) == 10
    assert book.grant_size("slow", 40, 0.0, probe_share=0.25) == 10
    assert book.grant_size("slow", 3, 0.0, probe_share=0.25) == 1  # rounded, at least one block
    assert book.grant_size("slow", 6, 0.0, probe_share=0.25) == 2  # 1.5 rounds half up
    assert book.grant_size("slow", 40, 0.0) == 40  # share 1.0: the request whole
    # once step times are known the share no longer applies: grants follow the paces
    rates = {"fast": 5.0, "slow": 1.0}
    assert book.grant_size("fast", 40, 1.0, step_rates=rates, probe_share=0.25) == 67
    assert book.grant_size("slow", 40, 1.0, step_rates=rates, probe_share=0.25) == 13
    # a late joiner among paced sites is probed too, and so kept from holding the round
    book.register("late", 2.0)
    assert book.grant_size("late", 40, 2.0, step_rates=rates, probe_share=0.25) == 10
    for bad in (0.0, -0.5, 1.5, float("nan"), True):
        with pytest.raises(LeaseError) as err:
            book.grant_size("fast", 40, 1.0, probe_share=bad)
        assert err.value.code == "bad_argument"


def test_sizing_compares_paces_so_bigger_sites_are_not_counted_twice():
    book = book_with("big", "small")
    work(book, "big", 40, 0.0, 4.0)  # four times the ranks: asks 40, commits 10 blocks/s
    work(book, "small", 10, 0.0, 4.0)  # asks 10, commits 2.5 blocks/s
    assert book.grant_size("big", 40, 5.0) == 40
    assert book.grant_size("small", 10, 5.0) == 10


def test_grant_size_limits_and_liveness():
    book = book_with("fast", "slow")
    work(book, "fast", 10, 0.0, 1.0)  # 10 blocks/s
    work(book, "slow", 10, 0.0, 100.0)  # 0.1 blocks/s
    assert book.grant_size("fast", 10, 101.0, max_scale=1.5) == 15
    assert book.grant_size("slow", 10, 101.0) == 1  # never below one block
    # a site not seen for longer than live_s no longer counts towards the mean
    assert book.grant_size("fast", 10, 101.0 + 50, live_s=10.0) == 10
    with pytest.raises(LeaseError) as err:
        book.grant_size("nobody", 10, 1.0)
    assert err.value.code == "unknown_site"
    with pytest.raises(LeaseError) as err:
        book.grant_size("fast", 0, 1.0)
    assert err.value.code == "bad_argument"


def test_sizing_state_changes_only_on_accepted_commands():
    book = book_with("a", "b")
    lease = book.grant("a", 5, 0.0, TTL, 1, requested=4)
    before = book.snapshot()
    for bad in (
        lambda: book.grant("a", 5, 1.0, TTL, 1, requested=9),  # already holding
        lambda: book.commit(lease.lease_id, "b", 5, 1.0),  # not the owner
        lambda: book.grant("a", 5, 1.0, TTL, 1, requested=0),
    ):
        with pytest.raises(LeaseError):
            bad()
    assert book.snapshot() == before
    book.commit(lease.lease_id, "a", 5, 1.0)
    snap = book.snapshot()
    book.commit(lease.lease_id, "a", 5, 2.0)  # a repeated commit measures nothing again
    assert book.snapshot() == snap
    assert book.snapshot()["pacing"]["a"] == ([(5, 1.0)], 4, 1.0)


def test_grace_renews_every_active_lease_and_never_shortens_one():
    book = book_with("a", "b", "c")
    la = book.grant("a", 5, 0.0, 10.0, 1)
    lb = book.grant("b", 5, 0.0, 100.0, 1)
    lc = book.grant("c", 5, 0.0, 10.0, 1)
    book.commit(lc.lease_id, "c", 5, 1.0)
    renewed = {lease.lease_id: lease.expires_at for lease in book.grace(30.0)}
    assert renewed == {la.lease_id: 40.0, lb.lease_id: 130.0}
    assert book.expire(39.0) == []  # without the grace, lease a died at 10
    assert [lease.lease_id for lease in book.expire(40.0)] == [la.lease_id]
    assert book.lease(lb.lease_id).status == "active"
    assert book.lease(lc.lease_id).status == "committed"
    # a clock that stepped back does not shorten a lease
    assert [lease.expires_at for lease in book.grace(20.0)] == [130.0]


def test_pacing_and_grace_replay_from_the_ledger():
    ledger = LedgerStore(sqlite3.connect(":memory:"))
    book = LeaseBook(100)

    def run(op: str, **args):
        result = apply_event(book, op, args)
        ledger.record(op, args)
        return result

    run("register", site="a", now=0.0)
    run("register", site="b", now=0.0)
    la = run("grant", site="a", n_blocks=6, now=0.0, ttl_s=TTL, round_no=1, requested=4)
    lb = run("grant", site="b", n_blocks=4, now=0.0, ttl_s=TTL, round_no=1)
    run("heartbeat", lease_id=la.lease_id, site="a", consumed=2, now=1.0)
    run("commit", lease_id=lb.lease_id, site="b", consumed=4, now=2.0)
    run("grace", now=50.0)
    fresh = LeaseBook(100)
    ledger.replay(fresh, strict=True)
    assert fresh.snapshot() == book.snapshot()
    assert fresh.commit_rate("b") == pytest.approx(2.0)
    assert fresh.lease(la.lease_id).expires_at == 60.0


def test_next_expiry_and_active_sites_for_the_clock_tick():
    book = book_with("a", "b", "c")
    assert book.next_expiry() is None and book.active_sites() == []
    la = book.grant("a", 2, 0.0, 10.0, 1)
    lb = book.grant("b", 2, 0.0, 5.0, 2)
    assert book.next_expiry() == 5.0
    book.heartbeat(lb.lease_id, "b", 1, 4.0, ttl_s=20.0)  # refreshed: a's TTL is next now
    assert book.next_expiry() == 10.0
    assert book.active_sites() == ["a", "b"] and book.active_sites(2) == ["b"]
    book.commit(la.lease_id, "a", 2, 5.0)
    assert book.next_expiry() == 24.0 and book.active_sites(1) == []
    assert [x.lease_id for x in book.expire(24.0)] == [lb.lease_id]
    assert book.next_expiry() is None


def test_time_spent_waiting_for_a_merge_is_left_out_of_the_pace():
    """An overlapped round's early lease is held while its site waits for the previous
    merge; that wait is not the site's pace (else a fast site's grants shrink and it waits
    longer still). The commit event carries it, so a replay gives the same rates."""
    book = book_with("a", "b")
    lease = book.grant("a", 10, 0.0, 60.0, 2)
    book.commit(lease.lease_id, "a", 10, 9.0, idle_s=4.0)
    assert book.commit_rate("a") == pytest.approx(10 / 5.0)
    with pytest.raises(LeaseError, match="idle_s"):
        book.commit(book.grant("b", 1, 0.0, 60.0, 2).lease_id, "b", 1, 1.0, idle_s=float("nan"))
    replayed = book_with("a")
    grant = {"site": "a", "n_blocks": 10, "now": 0.0, "ttl_s": 60.0, "round_no": 2}
    commit = {"lease_id": lease.lease_id, "site": "a", "consumed": 10, "now": 9.0, "idle_s": 4.0}
    apply_event(replayed, "grant", grant)
    apply_event(replayed, "commit", commit)
    assert replayed.commit_rate("a") == book.commit_rate("a")
