"""DARL lease book: grants, heartbeats, steals, commits, expiry and the sizing helpers."""

import math
import tracemalloc

import pytest

from crossfed.darl.leases import (
    LeaseBook,
    LeaseError,
    LeaseSizingError,
    lease_blocks,
    lease_ttl,
    proportional_grant,
    round_end_grant,
)

TTL = 10.0


def book_with(*sites: str, n_blocks: int = 100) -> LeaseBook:
    book = LeaseBook(n_blocks)
    for site in sites:
        book.register(site, 0.0)
    return book


def code_of(excinfo) -> str:
    return excinfo.value.code


# ---- grant ---------------------------------------------------------------------------------


def test_grants_are_contiguous_disjoint_and_drain_the_pool():
    book = book_with("a", "b", n_blocks=10)
    la = book.grant("a", 4, 0.0, TTL, 0)
    lb = book.grant("b", 4, 0.0, TTL, 0)
    assert (la.start, la.end, lb.start, lb.end) == (0, 4, 4, 8)
    book.commit(la.lease_id, "a", 4, 1.0)
    la2 = book.grant("a", 4, 1.0, TTL, 1)
    assert (la2.start, la2.end) == (8, 10)  # shorter than asked: the pool had two left
    book.commit(la2.lease_id, "a", 2, 2.0)
    assert book.pool_size == 0
    assert book.grant("a", 4, 2.0, TTL, 2) is None


def test_returned_spans_are_granted_lowest_first_before_fresh_ones():
    book = book_with("a", "b", "c", n_blocks=100)
    la = book.grant("a", 10, 0.0, TTL, 0)  # [0, 10)
    lb = book.grant("b", 10, 0.0, TTL, 0)  # [10, 20)
    lc = book.grant("c", 10, 0.0, TTL, 0)  # [20, 30)
    book.commit(lb.lease_id, "b", 3, 1.0)  # [13, 20) returns
    book.release(la.lease_id, "a", 1.0)  # [0, 10) returns
    assert book.pool_spans() == [(0, 10), (13, 20), (30, 100)]
    first = book.grant("a", 4, 2.0, TTL, 1)
    assert (first.start, first.end) == (0, 4)
    second = book.grant("b", 50, 2.0, TTL, 1)
    assert (second.start, second.end) == (4, 10)  # one contiguous run only
    book.release(lc.lease_id, "c", 3.0)  # [20, 30) joins [13, 20) and the fresh tail
    assert book.pool_spans() == [(13, 100)]


def test_grant_errors():
    book = book_with("a")
    with pytest.raises(LeaseError) as e:
        book.grant("ghost", 1, 0.0, TTL, 0)
    assert code_of(e) == "unknown_site"
    book.grant("a", 5, 0.0, TTL, 0)
    with pytest.raises(LeaseError) as e:
        book.grant("a", 5, 0.0, TTL, 0)
    assert code_of(e) == "already_holding"
    for bad in [dict(n_blocks=0), dict(ttl_s=0.0), dict(ttl_s=math.inf), dict(now=math.nan)]:
        args = dict(site="a", n_blocks=1, now=0.0, ttl_s=TTL, round_no=0) | bad
        with pytest.raises(LeaseError) as e:
            book_with("a").grant(**args)
        assert code_of(e) == "bad_argument"


# ---- two leases per site (overlapped rounds) -----------------------------------------------


def held_sum(book: LeaseBook, site: str) -> int:
    return sum(v.n_blocks for v in book.active_leases() if v.site == site)


def test_a_second_lease_for_a_later_round_is_granted_beside_the_first():
    book = book_with("a", "b", n_blocks=20)
    first = book.grant("a", 6, 0.0, TTL, 1)
    other = book.grant("b", 4, 0.0, TTL, 1)
    early = book.grant("a", 5, 1.0, TTL, 2)  # the next round's, while round 1's is live
    assert (first.start, first.end, early.start, early.end) == (0, 6, 10, 15)
    assert (early.round_no, early.site) == (2, "a")
    assert sorted(book.active_sites(1)) == ["a", "b"] and book.active_sites(2) == ["a"]
    assert book.active_sites(3) == []
    assert book.snapshot()["by_site"] == {"a": [first.lease_id, early.lease_id], "b": [2]}
    assert other.lease_id == 2
    stats = book.site_stats()["a"]
    assert (stats.grants, stats.blocks_granted) == (2, 11)
    assert stats.blocks_granted == stats.blocks_committed + stats.blocks_lost + held_sum(book, "a")
    # each lease heartbeats and commits on its own
    assert book.heartbeat(first.lease_id, "a", 3, 2.0).consumed == 3
    assert book.heartbeat(early.lease_id, "a", 1, 2.0).consumed == 1
    book.commit(first.lease_id, "a", 6, 3.0)
    assert book.active_sites(1) == ["b"] and book.active_sites(2) == ["a"]
    assert book.lease(early.lease_id).status == "active"
    stats = book.site_stats()["a"]
    assert stats.blocks_granted == stats.blocks_committed + stats.blocks_lost + held_sum(book, "a")
    assert (stats.blocks_committed, held_sum(book, "a")) == (6, 5)


def test_a_second_lease_is_refused_for_the_same_or_an_earlier_round_and_a_third_always():
    book = book_with("a", n_blocks=30)
    held = book.grant("a", 4, 0.0, TTL, 2)
    for round_no in (2, 1, 0):  # the round it holds, or an earlier one
        before = book.snapshot()
        with pytest.raises(LeaseError) as e:
            book.grant("a", 4, 1.0, TTL, round_no)
        assert code_of(e) == "already_holding"
        assert f"lease {held.lease_id} of round 2" in str(e.value)
        assert book.snapshot() == before
    book.grant("a", 4, 1.0, TTL, 3)
    for round_no in (4, 9):  # two held: a third is refused whatever its round
        before = book.snapshot()
        with pytest.raises(LeaseError) as e:
            book.grant("a", 4, 2.0, TTL, round_no)
        assert code_of(e) == "already_holding" and "2 active leases" in str(e.value)
        assert book.snapshot() == before
    # once round 2's lease is committed, the site may lease for round 4, never for round 3
    book.commit(held.lease_id, "a", 4, 3.0)
    with pytest.raises(LeaseError) as e:
        book.grant("a", 4, 3.0, TTL, 3)
    assert code_of(e) == "already_holding"
    assert book.grant("a", 4, 3.0, TTL, 4).round_no == 4


def test_steal_never_takes_from_the_thiefs_own_other_lease():
    book = book_with("t", n_blocks=10)
    own = book.grant("t", 10, 0.0, TTL, 1)  # the pool is dry; only t's own lease has a rest
    assert book.steal("t", 1.0, TTL, 2) is None
    assert (book.lease(own.lease_id).end, book.site_stats()["t"].steals) == (10, 0)
    book = book_with("t", "v", n_blocks=20)
    own = book.grant("t", 12, 0.0, TTL, 1)  # rest 11: the largest, but the thief's own
    victim = book.grant("v", 8, 0.0, TTL, 1)  # rest 7
    stolen = book.steal("t", 1.0, TTL, 2)
    assert (stolen.start, stolen.end, stolen.round_no) == (16, 20, 2)
    assert book.lease(own.lease_id).end == 12 and book.lease(victim.lease_id).end == 16
    with pytest.raises(LeaseError) as e:  # a steal obeys the same rule as a grant
        book.steal("v", 1.0, TTL, 1)
    assert code_of(e) == "already_holding"
    for site in ("t", "v"):
        s = book.site_stats()[site]
        assert s.blocks_granted == s.blocks_committed + s.blocks_lost + held_sum(book, site)


def test_expiry_of_one_of_two_leases_returns_only_its_blocks():
    book = book_with("a", n_blocks=20)
    short = book.grant("a", 6, 0.0, 5.0, 1)
    long = book.grant("a", 4, 0.0, 50.0, 2)
    dead = book.expire(6.0)
    assert [d.lease_id for d in dead] == [short.lease_id]
    assert book.pool_spans() == [(0, 6), (10, 20)]
    assert [v.lease_id for v in book.active_leases()] == [long.lease_id]
    assert book.heartbeat(long.lease_id, "a", 2, 7.0).end == 10
    stats = book.site_stats()["a"]
    assert (stats.blocks_lost, stats.ttl_expiries) == (6, 1)
    assert stats.blocks_granted == stats.blocks_committed + stats.blocks_lost + held_sum(book, "a")
    # a release of the other returns its blocks alone as well
    assert book.release(long.lease_id, "a", 8.0) == 4
    assert book.pool_spans() == [(0, 20)] and book.snapshot()["by_site"] == {}


# ---- heartbeat -----------------------------------------------------------------------------


def test_heartbeat_extends_ttl_and_tracks_progress():
    book = book_with("a")
    lease = book.grant("a", 5, 0.0, TTL, 0)
    hb = book.heartbeat(lease.lease_id, "a", 2, 8.0)
    assert (hb.consumed, hb.expires_at) == (2, 18.0)
    hb = book.heartbeat(lease.lease_id, "a", 2, 9.0, ttl_s=30.0)
    assert (hb.expires_at, hb.ttl_s) == (39.0, 30.0)
    assert book.expire(38.9) == []
    assert [x.lease_id for x in book.expire(39.0)] == [lease.lease_id]


def test_a_restarted_job_adopts_its_live_lease_at_the_progress_it_saw():
    book = book_with("a", "b")
    lease = book.grant("a", 5, 0.0, TTL, 0)
    book.heartbeat(lease.lease_id, "a", 3, 2.0)  # the dead job's progress
    got = book.adopt(lease.lease_id, "a", 3, 4.0, ttl_s=20.0)
    assert (got.consumed, got.expires_at, got.ttl_s) == (0, 24.0, 20.0)
    assert (got.start, got.end) == (lease.start, lease.end)
    before = book.snapshot()
    for site, seen, code in [("a", 3, "bad_progress"), ("b", 0, "not_owner")]:
        with pytest.raises(LeaseError) as e:  # a late replay of the adoption; another site
            book.adopt(lease.lease_id, site, seen, 5.0)
        assert code_of(e) == code
    assert book.snapshot() == before
    book.heartbeat(lease.lease_id, "a", 1, 6.0)  # the new job's progress counts from 0
    assert book.commit(lease.lease_id, "a", 5, 7.0).committed == 5
    stats = book.site_stats()["a"]
    assert (stats.grants, stats.blocks_granted, stats.blocks_lost) == (1, 5, 0)
    with pytest.raises(LeaseError) as e:  # committed: nothing left to adopt
        book.adopt(lease.lease_id, "a", 5, 8.0)
    assert code_of(e) == "committed"


def test_an_expired_lease_cannot_be_adopted():
    book = book_with("a")
    lease = book.grant("a", 5, 0.0, TTL, 0)
    with pytest.raises(LeaseError) as e:
        book.adopt(lease.lease_id, "a", 0, TTL)
    assert code_of(e) == "expired"


def test_an_expired_lease_lives_again_when_none_of_its_blocks_was_granted_since():
    book = book_with("a", "b", n_blocks=20)
    first = book.grant("a", 4, 0.0, TTL, 0)
    lease = book.grant("a", 6, 0.0, TTL, 1)  # positions 4..10, then 10..20 stays pooled
    book.heartbeat(lease.lease_id, "a", 2, 1.0)
    book.commit(first.lease_id, "a", 4, 2.0)
    assert [x.lease_id for x in book.expire(11.0)] == [lease.lease_id]
    assert book.pool_size == 16
    got = book.revive(lease.lease_id, "a", 5, 12.0, ttl_s=20.0)
    assert (got.start, got.end, got.consumed, got.expires_at, got.status) == (
        4, 10, 5, 32.0, "active",
    )  # fmt: skip
    assert book.pool_spans() == [(10, 20)] and book.pool_size == 10
    assert book.active_sites(1) == ["a"]
    stats = book.site_stats()["a"]  # granted twice, lost once: the book still balances
    assert (stats.blocks_granted, stats.blocks_lost, stats.ttl_expiries) == (16, 6, 1)
    again = book.revive(lease.lease_id, "a", 0, 12.5)  # a resumed checkpoint's: lower
    assert (again.consumed, again.expires_at) == (5, 32.5)  # the larger progress stays
    with pytest.raises(LeaseError) as e:
        book.revive(lease.lease_id, "a", 7, 12.6)
    assert code_of(e) == "bad_progress"  # past the lease's end
    assert book.commit(lease.lease_id, "a", 6, 13.0).committed == 6
    stats = book.site_stats()["a"]
    assert stats.blocks_granted == stats.blocks_committed + stats.blocks_lost


def test_a_lease_past_its_ttl_before_the_sweep_is_renewed_by_a_revival():
    book = book_with("a")
    lease = book.grant("a", 5, 0.0, TTL, 0)
    with pytest.raises(LeaseError) as e:
        book.heartbeat(lease.lease_id, "a", 1, TTL)
    assert code_of(e) == "expired"
    got = book.revive(lease.lease_id, "a", 1, TTL)
    assert (got.consumed, got.expires_at) == (1, 2 * TTL)
    assert book.site_stats()["a"].blocks_granted == 5  # never back in the pool


def test_an_expired_lease_returned_in_the_middle_of_the_pool_is_cut_back_out():
    book = book_with("a", "b", n_blocks=20)
    lost = book.grant("a", 4, 0.0, 1.0, 0)  # 0..4
    book.grant("b", 4, 0.0, TTL, 0)  # 4..8
    book.expire(1.0)
    book.grant("a", 2, 2.0, TTL, 1)  # 0..2 of the expired lease's positions
    with pytest.raises(LeaseError) as e:
        book.revive(lost.lease_id, "a", 0, 3.0)
    assert code_of(e) == "expired"  # its own later lease took blocks of it
    book2 = book_with("a", "b", n_blocks=20)
    lost = book2.grant("a", 4, 0.0, 1.0, 0)
    book2.grant("b", 4, 0.0, TTL, 0)
    book2.expire(1.0)
    assert book2.pool_spans() == [(0, 4), (8, 20)]
    book2.revive(lost.lease_id, "a", 0, 2.0)
    assert book2.pool_spans() == [(8, 20)]


def test_a_lease_whose_commit_was_held_up_lives_again_beside_the_sites_early_lease():
    """Its commit held up past the TTL, the site took its early lease of the next round
    meanwhile: the late commit revives the lease beside it (two leases, one per round)."""
    book = book_with("a", "b", n_blocks=20)
    held_up = book.grant("a", 4, 0.0, 1.0, 1)  # 0..4, its last heartbeat
    book.grant("b", 4, 0.0, TTL, 1)  # 4..8
    early = book.grant("a", 3, 0.5, TTL, 2, ahead=True)  # 8..11, asked as the delta went
    assert [x.lease_id for x in book.expire(1.0)] == [held_up.lease_id]
    got = book.revive(held_up.lease_id, "a", 4, 2.0)
    assert (got.status, got.consumed) == ("active", 4)
    assert book.commit(held_up.lease_id, "a", 4, 2.5).committed == 4
    assert [x.lease_id for x in book.active_leases() if x.site == "a"] == [early.lease_id]


@pytest.mark.parametrize(
    "granted_since, code",
    [("overlapping", "expired"), ("released", "expired"), ("committed", "committed")],
)
def test_a_lease_is_not_revived_once_its_blocks_moved_on(granted_since, code):
    book = book_with("a", "b", n_blocks=10)
    lease = book.grant("a", 5, 0.0, 1.0, 0)
    if granted_since == "overlapping":
        book.expire(1.0)
        book.grant("b", 3, 2.0, TTL, 0)  # positions 0..3 of the expired lease
    elif granted_since == "released":
        book.release(lease.lease_id, "a", 0.5)
    else:
        book.commit(lease.lease_id, "a", 5, 0.5)
    before = book.snapshot()
    with pytest.raises(LeaseError) as e:
        book.revive(lease.lease_id, "a", 0, 3.0)
    assert code_of(e) == code
    assert book.snapshot() == before


def test_a_lease_of_a_closed_epoch_is_not_revived():
    book = book_with("a", "b", n_blocks=4)
    lease = book.grant("a", 2, 0.0, 1.0, 0)
    book.expire(1.0)
    rest = book.grant("b", 4, 2.0, TTL, 0)
    book.commit(rest.lease_id, "b", 4, 3.0)
    book.next_epoch()
    with pytest.raises(LeaseError) as e:
        book.revive(lease.lease_id, "a", 0, 4.0)
    assert code_of(e) == "stale_epoch"


@pytest.mark.parametrize(
    "pool, n, within, ahead, size",
    [
        (20, 16, 4, False, 20),  # an epoch's last 4 blocks join the grant before them
        (21, 16, 4, False, 16),  # 5 left: a lease of their own
        (16, 16, 4, False, 16),  # nothing left behind
        (10, 16, 4, False, 16),  # a short run: the grant is cut by the pool, not grown
        (0, 16, 4, False, 16),  # empty: nothing to grow into
        (0, 16, 4, True, 16),  # the next epoch's pool is a whole epoch
    ],
)
def test_a_grant_takes_the_crumb_it_would_leave_behind(pool, n, within, ahead, size):
    book = book_with("a", "b", n_blocks=40)
    if pool < 40:
        book.grant("b", 40 - pool, 0.0, TTL, 0)
    assert book.uncut_size(n, within, ahead) == size
    assert book.pool_size == pool  # a query: nothing moved


@pytest.mark.parametrize("consumed", [1, 6, -1])
def test_heartbeat_bad_progress(consumed):
    book = book_with("a")
    lease = book.grant("a", 5, 0.0, TTL, 0)
    book.heartbeat(lease.lease_id, "a", 2, 1.0)
    before = book.snapshot()
    with pytest.raises(LeaseError) as e:
        book.heartbeat(lease.lease_id, "a", consumed, 2.0)
    assert code_of(e) in {"bad_progress", "bad_argument"}
    assert book.snapshot() == before


def test_heartbeat_errors():
    book = book_with("a", "b")
    lease = book.grant("a", 5, 0.0, TTL, 0)
    cases = [
        ((999, "a", 0, 1.0), "unknown_lease"),
        ((lease.lease_id, "b", 0, 1.0), "not_owner"),
        ((lease.lease_id, "a", 0, TTL), "expired"),  # past its TTL, even before expire()
    ]
    for args, code in cases:
        with pytest.raises(LeaseError) as e:
            book.heartbeat(*args)
        assert code_of(e) == code
    book.commit(lease.lease_id, "a", 5, 1.0)
    with pytest.raises(LeaseError) as e:
        book.heartbeat(lease.lease_id, "a", 5, 2.0)
    assert code_of(e) == "committed"
    lb = book.grant("b", 5, 2.0, TTL, 0)
    book.expire(2.0 + TTL)
    with pytest.raises(LeaseError) as e:
        book.heartbeat(lb.lease_id, "b", 0, 13.0)
    assert code_of(e) == "expired"


# ---- steal ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "consumed", "victim_keeps", "thief_gets"),
    [(20, 0, 10, 10), (20, 5, 13, 7), (10, 7, 9, 1), (10, 3, 7, 3), (9, 0, 5, 4)],
)
def test_steal_arithmetic(size, consumed, victim_keeps, thief_gets):
    book = book_with("v", "t", n_blocks=size)
    lease = book.grant("v", size, 0.0, TTL, 0)
    book.heartbeat(lease.lease_id, "v", consumed, 1.0)
    stolen = book.steal("t", 2.0, 5.0, 1)
    assert stolen.n_blocks == thief_gets
    assert (stolen.start, stolen.end, stolen.expires_at) == (victim_keeps, size, 7.0)
    victim = book.heartbeat(lease.lease_id, "v", consumed, 3.0)
    assert (victim.start, victim.end) == (0, victim_keeps)
    stats = book.site_stats()
    assert (stats["v"].blocks_granted, stats["v"].stolen_from) == (victim_keeps, 1)
    assert (stats["t"].blocks_granted, stats["t"].steals, stats["t"].grants) == (thief_gets, 1, 1)


def test_a_steal_leaves_the_victim_what_it_trained_unheard():
    """``ahead``: blocks the coordinator judges a holder trained since its last heartbeat. The
    victim keeps them as if reported; a lease whose projected rest is nil is not stolen from."""
    book = book_with("v", "w", "t", n_blocks=30)
    lv = book.grant("v", 20, 0.0, TTL, 0)  # consumed 2, 10 unheard: rest 20-12-1 = 7
    lw = book.grant("w", 10, 0.0, TTL, 0)  # rest 10-0-1 = 9, the largest without ahead
    book.heartbeat(lv.lease_id, "v", 2, 1.0)
    stolen = book.steal("t", 1.5, TTL, 0, ahead={lv.lease_id: 10, lw.lease_id: 4})
    # w's rest is now 10-4-1 = 5 and v's 7: v is the victim and keeps 2+10+1+3 = 16
    assert (stolen.start, stolen.end) == (lv.start + 16, lv.end)
    assert book.lease(lv.lease_id).end == lv.start + 16 and book.lease(lw.lease_id).end == lw.end
    book = book_with("v", "t", n_blocks=8)
    lv = book.grant("v", 8, 0.0, TTL, 0)
    assert book.steal("t", 0.5, TTL, 0, ahead={lv.lease_id: 7}) is None  # nothing untouched
    assert book.lease(lv.lease_id).end == 8 and book.site_stats()["t"].steals == 0


def test_steal_takes_from_the_largest_untouched_rest():
    book = book_with("a", "b", "c", "t", n_blocks=30)
    la = book.grant("a", 12, 0.0, TTL, 0)  # rest 12-8-1 = 3
    lb = book.grant("b", 10, 0.0, TTL, 0)  # rest 10-0-1 = 9
    book.grant("c", 8, 0.0, TTL, 0)  # rest 7
    book.heartbeat(la.lease_id, "a", 8, 1.0)
    stolen = book.steal("t", 1.0, TTL, 0)
    assert (stolen.start, stolen.end) == (lb.start + 5, lb.end)
    assert book.lease(lb.lease_id).end == lb.start + 5


def test_steal_refusals():
    book = book_with("v", "t", n_blocks=4)
    with pytest.raises(LeaseError) as e:
        book.steal("t", 0.0, TTL, 0)
    assert code_of(e) == "pool_not_empty"
    lease = book.grant("v", 4, 0.0, TTL, 0)
    book.heartbeat(lease.lease_id, "v", 3, 1.0)  # nothing beyond the block in progress
    assert book.steal("t", 1.0, TTL, 0) is None
    with pytest.raises(LeaseError) as e:
        book.steal("ghost", 1.0, TTL, 0)
    assert code_of(e) == "unknown_site"


def test_steal_never_takes_from_self():
    book = book_with("v", n_blocks=10)
    book.grant("v", 10, 0.0, TTL, 0)
    with pytest.raises(LeaseError) as e:
        book.steal("v", 1.0, TTL, 0)
    assert code_of(e) == "already_holding"


# ---- commit / release / expire -------------------------------------------------------------


def test_commit_is_idempotent_and_returns_the_rest():
    book = book_with("a", n_blocks=10)
    lease = book.grant("a", 6, 0.0, TTL, 0)
    res = book.commit(lease.lease_id, "a", 4, 1.0)
    assert (res.committed, res.returned, res.already) == (4, 2, False)
    snap = book.snapshot()
    again = book.commit(lease.lease_id, "a", 4, 50.0)  # a retry, even past the TTL
    assert (again.committed, again.returned, again.already) == (4, 2, True)
    assert book.snapshot() == snap
    assert [book.is_committed(p) for p in range(6)] == [True] * 4 + [False] * 2
    assert book.pool_spans() == [(4, 10)]
    with pytest.raises(LeaseError) as e:
        book.commit(lease.lease_id, "a", 3, 2.0)
    assert code_of(e) == "commit_mismatch"


def test_commit_errors():
    book = book_with("a", "b", n_blocks=10)
    lease = book.grant("a", 5, 0.0, TTL, 0)
    for args, code in [
        ((lease.lease_id, "b", 5, 1.0), "not_owner"),
        ((lease.lease_id, "a", 6, 1.0), "bad_progress"),
        ((lease.lease_id, "a", 5, TTL + 1), "expired"),
        ((77, "a", 5, 1.0), "unknown_lease"),
    ]:
        with pytest.raises(LeaseError) as e:
            book.commit(*args)
        assert code_of(e) == code
    assert book.release(lease.lease_id, "a", 2.0) == 5
    with pytest.raises(LeaseError) as e:
        book.commit(lease.lease_id, "a", 5, 3.0)
    assert code_of(e) == "expired"
    assert book.release(lease.lease_id, "a", 3.0) == 0  # releasing twice is harmless


def test_expire_returns_every_block_and_counts_the_loss():
    book = book_with("a", "b", n_blocks=20)
    la = book.grant("a", 9, 0.0, TTL, 0)
    lb = book.grant("b", 5, 0.0, 100.0, 0)
    book.heartbeat(la.lease_id, "a", 6, 5.0)  # trained but never committed
    dead = book.expire(15.0)
    assert [(d.lease_id, d.status) for d in dead] == [(la.lease_id, "expired")]
    assert book.pool_spans() == [(0, 9), (14, 20)]
    stats = book.site_stats()["a"]
    assert (stats.blocks_lost, stats.ttl_expiries, stats.blocks_committed) == (9, 1, 0)
    assert [x.lease_id for x in book.active_leases()] == [lb.lease_id]
    assert book.expire(15.0) == []


def test_crashed_site_blocks_are_regranted_and_committed_once():
    # paper: a site died holding nine blocks; five went to LUMI, four to its own restart
    book = book_with("frontier", "lumi", n_blocks=9)
    dead = book.grant("frontier", 9, 0.0, TTL, 0)
    book.register("frontier", 5.0)  # the restarted job joins again
    assert book.expire(TTL) and book.pool_spans() == [(0, 9)]
    lumi = book.grant("lumi", 5, TTL, TTL, 1)
    frontier = book.grant("frontier", 4, TTL, TTL, 1)
    book.commit(lumi.lease_id, "lumi", 5, 12.0)
    book.commit(frontier.lease_id, "frontier", 4, 12.0)
    assert book.epoch_complete()
    with pytest.raises(LeaseError) as e:
        book.commit(dead.lease_id, "frontier", 9, 12.0)
    assert code_of(e) == "expired"
    stats = book.site_stats()
    assert stats["frontier"].entries == 2
    assert (stats["frontier"].blocks_granted, stats["frontier"].blocks_lost) == (13, 9)
    assert sum(s.blocks_committed for s in stats.values()) == book.committed_total == 9


def test_epochs():
    book = book_with("a", n_blocks=3)
    lease = book.grant("a", 3, 0.0, TTL, 0)
    with pytest.raises(LeaseError) as e:
        book.next_epoch()
    assert code_of(e) == "epoch_incomplete"
    book.commit(lease.lease_id, "a", 3, 1.0)
    book.next_epoch()
    assert (book.epoch, book.committed_in_epoch, book.committed_total) == (1, 0, 3)
    assert book.pool_spans() == [(0, 3)] and not book.is_committed(0)
    assert book.commit(lease.lease_id, "a", 3, 2.0).already  # retry from the old epoch
    with pytest.raises(LeaseError) as e:
        book.heartbeat(lease.lease_id, "a", 3, 2.0)
    assert code_of(e) == "stale_epoch"
    nxt = book.grant("a", 3, 2.0, TTL, 1)
    assert nxt.epoch == 1


def test_an_epoch_leased_ahead_can_finish_first_and_then_rolls_over_at_once():
    """Early leases take the next epoch's blocks once the current epoch's are all out; if a
    dead site's lease holds the current epoch up long enough, the next one can be committed
    whole first. When the current epoch ends, the next becomes current already complete, and
    another roll starts a fresh one (the coordinator rolls while the epoch is complete)."""
    book = book_with("a", "b", n_blocks=3)
    stuck = book.grant("a", 3, 0.0, TTL, 1)  # the whole of epoch 0, its site about to die
    ahead = book.grant("b", 3, 0.0, TTL, 2, ahead=True)
    assert (ahead.epoch, ahead.start, ahead.end) == (1, 0, 3)
    assert book.grant("b", 1, 0.5, TTL, 3, ahead=True) is None  # both pools dry: no third
    book.commit(ahead.lease_id, "b", 3, 1.0)
    assert book.open_epochs() == [0, 1] and not book.epoch_complete()
    book.expire(TTL + 1.0)  # the dead site's lease: epoch 0's blocks back, granted first
    again = book.grant("b", 3, TTL + 1.0, TTL, 3, ahead=True)
    assert (again.epoch, again.start, again.end) == (0, 0, 3)
    book.commit(again.lease_id, "b", 3, TTL + 2.0)
    book.next_epoch()
    assert book.epoch == 1 and book.epoch_complete()  # the next epoch, done already
    book.next_epoch()
    assert (book.epoch, book.committed_total, book.pool_spans()) == (2, 6, [(0, 3)])
    assert stuck.epoch == 0


def test_is_committed_bounds():
    with pytest.raises(LeaseError) as e:
        LeaseBook(3).is_committed(3)
    assert code_of(e) == "bad_argument"
    with pytest.raises(LeaseError):
        LeaseBook(0)


def test_returned_leases_are_copies():
    book = book_with("a")
    lease = book.grant("a", 5, 0.0, TTL, 0)
    lease.end = 100
    assert book.lease(lease.lease_id).end == 5


def test_hot_paths_do_not_allocate_per_block():
    big = book_with("a", "b", n_blocks=10**7)
    la = big.grant("a", 1000, 0.0, TTL, 0)
    big.grant("b", 1000, 0.0, TTL, 0)
    big.commit(la.lease_id, "a", 500, 1.0)  # leaves a returned run below the cursor
    tracemalloc.start()
    try:
        for r in range(50):
            now = 2.0 + r
            lease = big.grant("a", 1000, now, TTL, r)
            big.heartbeat(lease.lease_id, "a", lease.n_blocks // 2, now + 0.5)
            big.commit(lease.lease_id, "a", lease.n_blocks - 1, now + 0.9)
            big.expire(now + 0.9)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200_000  # far below one byte per block (10 MB)


# ---- sizing helpers ------------------------------------------------------------------------


def test_lease_blocks():
    assert lease_blocks(1000, 8, 8, 1, 1024) == 63  # ceil(64000 / 1024)
    assert lease_blocks(100, 8, 8, 5, 1024) == 32  # exact division
    assert lease_blocks(1, 1, 1, 1, 1024) == 1
    for bad in [(0, 1, 1, 1, 1), (1, 1, 1, 1, 0), (1.5, 1, 1, 1, 1)]:
        with pytest.raises(LeaseSizingError):
            lease_blocks(*bad)


def test_lease_ttl():
    assert lease_ttl(2.0, 0.347) == pytest.approx(2.5 * 2.0 + 2.0 * 0.347)
    assert lease_ttl(4.0, 0.1, alpha=3.0, beta_rtt=0.0) == pytest.approx(12.0)
    with pytest.raises(LeaseSizingError):
        lease_ttl(0.0, 0.0)
    with pytest.raises(LeaseSizingError):
        lease_ttl(-1.0, 0.1)


def test_round_end_grant():
    # 6 blocks paced, 2 blocks a second: 1.5 s left adds 3 blocks, at most half of 6
    assert round_end_grant(6, 2.0, 1.5, 3600.0, 24) == 9
    assert round_end_grant(6, 2.0, 10.0, 3600.0, 24) == 9  # a long wait: still half
    assert round_end_grant(6, 2.0, 0.4, 3600.0, 24) == 6  # under a block's worth: none
    assert round_end_grant(6, 2.0, 1.5, 3600.0, 8) == 8  # the grant's cap
    # a deadline of 6 s: the lease ends at most 3 s after its round opens (1.5 s from now),
    # 4.5 s at 2 blocks a second: 9 blocks fit; with a deadline of 4 s, 3.5 s: 7
    assert round_end_grant(6, 2.0, 1.5, 6.0, 24) == 9
    assert round_end_grant(6, 2.0, 1.5, 4.0, 24) == 7
    # a paced phase already past the deadline's half keeps its size, never less
    assert round_end_grant(6, 2.0, 0.5, 1.0, 24) == 6
    for bad in ((0, 2.0, 1.0, 60.0), (6, 0.0, 1.0, 60.0), (6, 2.0, -1.0, 60.0), (6, 2.0, 1.0, 0)):
        with pytest.raises(LeaseSizingError):
            round_end_grant(*bad, 24)


def test_proportional_grant():
    assert proportional_grant(10, None, 2.0) == 10
    assert proportional_grant(10, 3.0, None) == 10
    assert proportional_grant(10, 3.0, 2.0) == 15
    assert proportional_grant(10, 1.0, 4.0) == 3  # 2.5 rounds half up
    assert proportional_grant(10, 0.0, 4.0) == 1
    assert proportional_grant(10, 0.0, 4.0, lo=2) == 2
    assert proportional_grant(10, 9.0, 1.0, hi=40) == 40
    assert proportional_grant(10, 1.0, 0.0) == 10
    with pytest.raises(LeaseSizingError):
        proportional_grant(0, 1.0, 1.0)
    with pytest.raises(LeaseSizingError):
        proportional_grant(10, -1.0, 1.0)
    with pytest.raises(LeaseSizingError):
        proportional_grant(10, 1.0, 1.0, lo=5, hi=4)
