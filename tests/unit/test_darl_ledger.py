"""DARL ledger: event log and replay, commit audit, Table 3, and a stateful model check."""

import json
import math
import sqlite3

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from crossfed.darl.blockspace import BlockSpace
from crossfed.darl.leases import LeaseBook, LeaseError
from crossfed.darl.ledger import (
    CHECKPOINT_TABLE,
    TABLE3_COLUMNS,
    DuplicateCommitError,
    LedgerError,
    LedgerStore,
    apply_event,
)

TTL = 10.0


def store() -> LedgerStore:
    return LedgerStore(sqlite3.connect(":memory:"))


def run(book: LeaseBook, ledger: LedgerStore, op: str, **args):
    result = apply_event(book, op, args)
    ledger.record(op, args)
    return result


# ---- event log -----------------------------------------------------------------------------


def test_replay_rebuilds_the_same_book(tmp_path):
    path = tmp_path / "ledger.sqlite"
    conn = sqlite3.connect(path)
    ledger, book = LedgerStore(conn), LeaseBook(50)
    run(book, ledger, "register", site="a", now=0.0)
    run(book, ledger, "register", site="b", now=0.5)
    la = run(book, ledger, "grant", site="a", n_blocks=30, now=1.0, ttl_s=TTL, round_no=0)
    lb = run(book, ledger, "grant", site="b", n_blocks=30, now=1.0, ttl_s=TTL, round_no=0)
    run(book, ledger, "heartbeat", lease_id=la.lease_id, site="a", consumed=4, now=2.0)
    run(book, ledger, "commit", lease_id=lb.lease_id, site="b", consumed=20, now=3.0)
    run(book, ledger, "steal", site="b", now=3.5, ttl_s=TTL, round_no=1)
    run(book, ledger, "heartbeat", lease_id=la.lease_id, site="a", consumed=5, now=4, ttl_s=2.5)
    run(book, ledger, "expire", now=30.0)
    conn.commit()
    conn.close()

    conn = sqlite3.connect(path)
    fresh = LeaseBook(50)
    assert LedgerStore(conn).replay(fresh) == 9
    assert fresh.snapshot() == book.snapshot()


def test_replay_of_two_leases_per_site_rebuilds_the_same_book(tmp_path):
    """Overlapped rounds: a site's early lease of round 1 beside its lease of round 0,
    through steal, expiry and commit, replays (from scratch and from a checkpoint taken
    while both were live) to the same book, and the snapshot stays plain JSON."""
    path = tmp_path / "ledger.sqlite"
    conn = sqlite3.connect(path)
    ledger, book = LedgerStore(conn), LeaseBook(20)
    run(book, ledger, "register", site="a", now=0.0)
    run(book, ledger, "register", site="b", now=0.0)
    a0 = run(book, ledger, "grant", site="a", n_blocks=8, now=1.0, ttl_s=TTL, round_no=0)
    b0 = run(book, ledger, "grant", site="b", n_blocks=8, now=1.0, ttl_s=TTL, round_no=0)
    a1 = run(book, ledger, "grant", site="a", n_blocks=4, now=2.0, ttl_s=3.0, round_no=1)
    assert (a0.round_no, a1.round_no) == (0, 1) and a1.start == 16
    assert book.snapshot()["by_site"] == {"a": [a0.lease_id, a1.lease_id], "b": [b0.lease_id]}
    ledger.checkpoint(book)
    b1 = run(book, ledger, "steal", site="b", now=2.5, ttl_s=TTL, round_no=1)
    assert b1.start >= a0.start and b1.end == a0.end  # from a's round-0 lease, the largest
    run(book, ledger, "expire", now=5.0)  # a's early lease (TTL 3) dies, its round-0 one lives
    run(book, ledger, "commit", lease_id=a0.lease_id, site="a", consumed=2, now=6.0)
    a2 = run(book, ledger, "grant", site="a", n_blocks=4, now=6.0, ttl_s=TTL, round_no=1)
    conn.commit()
    assert book.snapshot()["by_site"] == {"a": [a2.lease_id], "b": [b0.lease_id, b1.lease_id]}
    for from_checkpoint in (True, False):
        if not from_checkpoint:
            conn.execute(f"DELETE FROM {CHECKPOINT_TABLE}")
            conn.commit()
        fresh = LeaseBook(20)
        assert LedgerStore(sqlite3.connect(path)).replay(fresh) == (4 if from_checkpoint else 9)
        assert fresh.snapshot() == book.snapshot()
        assert json.dumps(fresh.snapshot(), sort_keys=True) == json.dumps(
            book.snapshot(), sort_keys=True
        )


def _nine_events(ledger: LedgerStore, book: LeaseBook, checkpoint_after: int) -> None:
    """The nine commands of the replay test above, with a checkpoint after the first few."""
    steps = [
        ("register", dict(site="a", now=0.0)),
        ("register", dict(site="b", now=0.5)),
        ("grant", dict(site="a", n_blocks=30, now=1.0, ttl_s=TTL, round_no=0)),
        ("grant", dict(site="b", n_blocks=30, now=1.0, ttl_s=TTL, round_no=0)),
        ("heartbeat", dict(lease_id=1, site="a", consumed=4, now=2.0)),
        ("commit", dict(lease_id=2, site="b", consumed=20, now=3.0)),
        ("steal", dict(site="b", now=3.5, ttl_s=TTL, round_no=1)),
        ("heartbeat", dict(lease_id=1, site="a", consumed=5, now=4, ttl_s=2.5)),
        ("expire", dict(now=30.0)),
    ]
    for i, (op, args) in enumerate(steps, start=1):
        run(book, ledger, op, **args)
        if i == checkpoint_after:
            assert ledger.checkpoint(book) == i


def test_replay_starts_from_the_newest_checkpoint(tmp_path):
    path = tmp_path / "ledger.sqlite"
    conn = sqlite3.connect(path)
    ledger, book = LedgerStore(conn), LeaseBook(50)
    _nine_events(ledger, book, checkpoint_after=6)
    conn.commit()
    fresh = LeaseBook(50)
    assert LedgerStore(sqlite3.connect(path)).replay(fresh) == 3  # only the events after it
    assert fresh.snapshot() == book.snapshot()
    for either in (fresh, book):  # the restored book works on like the live one
        either.register("c", 31.0)
        either.grant("c", 5, 31.0, TTL, 2)
    assert fresh.snapshot() == book.snapshot()


@pytest.mark.parametrize("damage", ["garbage", "format", "n_blocks"])
def test_a_bad_checkpoint_falls_back_to_replaying_every_event(tmp_path, damage, caplog):
    path = tmp_path / "ledger.sqlite"
    conn = sqlite3.connect(path)
    ledger, book = LedgerStore(conn), LeaseBook(50)
    _nine_events(ledger, book, checkpoint_after=6)
    if damage == "garbage":
        conn.execute(f"UPDATE {CHECKPOINT_TABLE} SET state = ?", (b"not a checkpoint",))
    elif damage == "format":
        conn.execute(f"UPDATE {CHECKPOINT_TABLE} SET format = 'leasebook-pickle-0'")
    conn.commit()
    size = 60 if damage == "n_blocks" else 50  # a book of another size: not this one's state
    fresh = LeaseBook(size)
    with caplog.at_level("WARNING", logger="crossfed.darl"):
        assert LedgerStore(sqlite3.connect(path)).replay(fresh) == 9
    assert "checkpoint at event 6 ignored" in caplog.text
    if damage != "n_blocks":
        assert fresh.snapshot() == book.snapshot()


def test_maybe_checkpoint_keeps_only_the_newest_every_n_events():
    conn = sqlite3.connect(":memory:")
    ledger, book = LedgerStore(conn), LeaseBook(20)
    written = []
    for i in range(7):
        run(book, ledger, "register", site=f"s{i}", now=float(i))
        written.append(ledger.maybe_checkpoint(book, every=3))
    assert written == [False, False, True, False, False, True, False]
    assert conn.execute(f"SELECT seq FROM {CHECKPOINT_TABLE}").fetchall() == [(6,)]
    # a store opened later counts the events since the stored checkpoint
    later = LedgerStore(conn)
    run(book, later, "register", site="s7", now=7.0)  # event 8: two since the one at 6
    assert not later.maybe_checkpoint(book, every=3)
    run(book, later, "register", site="s8", now=8.0)  # event 9: three
    assert later.maybe_checkpoint(book, every=3)
    assert conn.execute(f"SELECT seq FROM {CHECKPOINT_TABLE}").fetchall() == [(9,)]
    fresh = LeaseBook(20)
    assert LedgerStore(conn).replay(fresh) == 0 and fresh.snapshot() == book.snapshot()


def test_uncommitted_events_are_not_durable(tmp_path):
    path = tmp_path / "ledger.sqlite"
    conn = sqlite3.connect(path)
    ledger = LedgerStore(conn)
    conn.commit()
    ledger.record("register", {"site": "a", "now": 0.0})
    conn.rollback()
    assert LedgerStore(sqlite3.connect(path)).events() == []


def test_refused_events_replay_as_no_ops():
    ledger, book = store(), LeaseBook(5)
    run(book, ledger, "register", site="a", now=0.0)
    bad = {"lease_id": 42, "site": "a", "consumed": 1, "now": 1.0}
    with pytest.raises(LeaseError):
        apply_event(book, "heartbeat", bad)
    ledger.record("heartbeat", bad)  # a caller that records before applying
    fresh = LeaseBook(5)
    assert ledger.replay(fresh) == 2
    assert fresh.snapshot() == book.snapshot()
    with pytest.raises(LeaseError):
        ledger.replay(LeaseBook(5), strict=True)


@pytest.mark.parametrize(
    ("op", "args", "match"),
    [
        ("launch", {"now": 0.0}, "unknown DARL op"),
        ("grant", {"site": "a", "now": 0.0}, "missing"),
        ("expire", {"now": math.nan}, "JSON"),
        ("expire", {"now": object()}, "JSON"),
    ],
)
def test_malformed_events_are_refused(op, args, match):
    ledger = store()
    with pytest.raises(LedgerError, match=match):
        ledger.record(op, args)
    assert ledger.events() == []


def test_apply_event_refuses_unknown_ops():
    with pytest.raises(LedgerError, match="unknown DARL op"):
        apply_event(LeaseBook(3), "explode", {"now": 0.0})


def test_bind_space():
    ledger = store()
    space = BlockSpace(100, 10, 1)
    ledger.bind_space(space.digest(), space.n_blocks)
    ledger.bind_space(space.digest(), space.n_blocks)
    with pytest.raises(LedgerError, match="space_digest"):
        ledger.bind_space(BlockSpace(100, 10, 2).digest(), space.n_blocks)


# ---- commit audit --------------------------------------------------------------------------


def test_audit_refuses_duplicates_without_partial_writes():
    ledger = store()
    ledger.record_commit_blocks(0, "a", 1, [5, 3, 9])
    ledger.record_commit_blocks(1, "a", 7, [5])  # another epoch is fine
    with pytest.raises(DuplicateCommitError, match="block 9 already committed by 'a'"):
        ledger.record_commit_blocks(0, "b", 2, [1, 2, 9])
    with pytest.raises(DuplicateCommitError, match="twice"):
        ledger.record_commit_blocks(0, "b", 2, [4, 4])
    assert ledger.audit_counts() == {"a": 4}
    assert ledger.audit_counts(epoch=0) == {"a": 3}
    ledger.record_commit_blocks(0, "b", 2, np.arange(10, 1200))  # chunked duplicate check
    assert ledger.audit_counts(epoch=0) == {"a": 3, "b": 1190}


# ---- Table 3 -------------------------------------------------------------------------------


def test_table3_identities():
    ledger, book = store(), LeaseBook(40)
    for site in ("frontier", "lumi", "snellius"):
        run(book, ledger, "register", site=site, now=0.0)
    lf = run(book, ledger, "grant", site="frontier", n_blocks=9, now=0.0, ttl_s=TTL, round_no=0)
    ll = run(book, ledger, "grant", site="lumi", n_blocks=10, now=0.0, ttl_s=TTL, round_no=0)
    run(book, ledger, "commit", lease_id=ll.lease_id, site="lumi", consumed=10, now=5.0)
    run(book, ledger, "expire", now=TTL)
    assert lf.lease_id not in [x.lease_id for x in book.active_leases()]
    run(book, ledger, "register", site="frontier", now=11.0)
    lf2 = run(book, ledger, "grant", site="frontier", n_blocks=4, now=11.0, ttl_s=TTL, round_no=1)
    run(book, ledger, "commit", lease_id=lf2.lease_id, site="frontier", consumed=4, now=12.0)
    run(book, ledger, "grant", site="snellius", n_blocks=3, now=12.0, ttl_s=TTL, round_no=1)

    table = ledger.table3(book, {"frontier": 8, "lumi": 8, "snellius": 4}, {"lumi": 70.0})
    assert list(table.columns) == TABLE3_COLUMNS
    assert table["site"].tolist() == ["frontier", "lumi", "snellius", "total"]
    sites, total = table.iloc[:-1], table.iloc[-1]
    for col in TABLE3_COLUMNS[3:]:
        assert total[col] == sites[col].sum()
    assert total["ranks"] == 20 and pd.isna(total["rtt_ms"])
    assert pd.isna(table.loc[0, "rtt_ms"]) and table.loc[1, "rtt_ms"] == 70.0
    assert total["blocks_committed"] == book.committed_total == 14
    frontier = table.iloc[0]
    assert (frontier["entries"], frontier["grants"], frontier["ttl_expiries"]) == (2, 2, 1)
    assert (frontier["blocks_granted"], frontier["blocks_lost"]) == (13, 9)
    held = {x.site: x.n_blocks for x in book.active_leases()}
    for _, row in sites.iterrows():
        lost_or_held = row["blocks_lost"] + held.get(row["site"], 0)
        assert row["blocks_granted"] == row["blocks_committed"] + lost_or_held


# ---- stateful model check ------------------------------------------------------------------


class LeaseModel(RuleBasedStateMachine):
    """LeaseBook against a set-based reference model, with crashes, steals and restarts.

    Sites hold up to two leases, one per round (overlapped rounds): a live lease of round r
    and an early one of round r + 1 while the coordinator's round moves on (`next_round`).
    An early lease leases ahead: with the epoch's pool dry it takes from the next epoch's,
    so two epochs may be open at once, each with its own pool and committed positions.
    """

    @initialize(n_blocks=st.integers(1, 30), seed=st.integers(0, 2**64 - 1))
    def setup(self, n_blocks, seed):
        self.n = n_blocks
        self.space = BlockSpace(n_blocks, 1, seed)
        self.conn = sqlite3.connect(":memory:")
        self.ledger = LedgerStore(self.conn)
        self.book = LeaseBook(n_blocks)
        self.now = 0.0
        self.epoch = 0
        self.pools = {0: set(range(n_blocks))}  # per open epoch
        self.done: dict[int, set[int]] = {0: set()}  # committed positions per open epoch
        self.leases: dict[int, dict] = {}  # active leases only
        self.expired: dict[int, dict] = {}  # leases the sweep expired, as they were
        self.last_commit: dict[str, tuple[int, int]] = {}  # site -> (lease_id, consumed)
        self.crashed: set[str] = set()
        self.stats: dict[str, dict[str, int]] = {}
        self.committed_total = 0
        self.round = 0  # the coordinator's current round

    # ---- helpers

    def do(self, op, **args):
        result = apply_event(self.book, op, args)
        self.ledger.record(op, args)
        return result

    def refused(self, code, op, **args):
        before = self.book.snapshot()
        with pytest.raises(LeaseError) as e:
            apply_event(self.book, op, args)
        assert e.value.code == code
        assert self.book.snapshot() == before

    def held(self, site):
        """The site's active leases as (lease_id, lease), oldest round first."""
        mine = [(i, v) for i, v in self.leases.items() if v["site"] == site]
        return sorted(mine, key=lambda item: item[1]["round"])

    def may_lease(self, site, round_no):
        """The book's rule: at most two leases, the new one for a later round than any held."""
        held = self.held(site)
        return len(held) < 2 and all(v["round"] < round_no for _, v in held)

    def bump(self, site, **deltas):
        for key, d in deltas.items():
            self.stats[site][key] += d

    def live_sites(self):
        return sorted(s for s in self.stats if s not in self.crashed)

    # ---- rules

    @rule()
    @precondition(lambda self: len(self.stats) < 5)
    def join(self):
        site = f"s{len(self.stats)}"
        self.do("register", site=site, now=self.now)
        self.stats[site] = dict(entries=1, grants=0, granted=0, committed=0, lost=0, expiries=0)

    @rule(data=st.data())
    @precondition(lambda self: self.crashed)
    def rejoin(self, data):
        site = data.draw(st.sampled_from(sorted(self.crashed)))
        self.do("register", site=site, now=self.now)
        self.crashed.discard(site)
        self.bump(site, entries=1)

    def grant_to(self, site, n, ttl, round_no, ahead=False):
        args = dict(site=site, n_blocks=n, now=self.now, ttl_s=ttl, round_no=round_no)
        if ahead:
            args["ahead"] = True
        if not self.may_lease(site, round_no):
            return self.refused("already_holding", "grant", **args)
        lease = self.do("grant", **args)
        epoch = self.epoch
        if not self.pools[epoch] and ahead:  # the next epoch's pool, opened by the first
            epoch += 1
            self.pools.setdefault(epoch, set(range(self.n)))
            self.done.setdefault(epoch, set())
        pool = self.pools[epoch]
        if not pool:
            assert lease is None
            return
        start = min(pool)
        end = start
        while end in pool and end - start < n:
            end += 1
        assert (lease.start, lease.end, lease.site, lease.epoch) == (start, end, site, epoch)
        pool -= set(range(start, end))
        self.leases[lease.lease_id] = dict(
            epoch=epoch,
            site=site,
            start=start,
            end=end,
            consumed=0,
            expires_at=self.now + ttl,
            ttl=ttl,
            round=round_no,
        )
        self.bump(site, grants=1, granted=end - start)

    def commit_lease(self, lease_id, full):
        lease = self.leases[lease_id]
        site, start, end = lease["site"], lease["start"], lease["end"]
        consumed = end - start if full else lease["consumed"]
        args = dict(lease_id=lease_id, site=site, consumed=consumed, now=self.now)
        if self.now >= lease["expires_at"]:
            return self.refused("expired", "commit", **args)
        res = self.do("commit", **args)
        assert (res.committed, res.returned, res.already) == (consumed, end - start - consumed, 0)
        epoch = lease["epoch"]
        blocks = self.space.blocks(start, start + consumed, epoch=epoch)
        self.ledger.record_commit_blocks(epoch, site, lease_id, blocks)
        del self.leases[lease_id]
        self.done[epoch] |= set(range(start, start + consumed))
        self.pools[epoch] |= set(range(start + consumed, end))
        self.committed_total += consumed
        self.last_commit[site] = (lease_id, consumed)
        self.bump(site, committed=consumed, lost=end - start - consumed)

    @rule(
        data=st.data(),
        n=st.integers(1, 16),
        ttl=st.sampled_from([1.0, 3.0, 10.0]),
        ahead=st.sampled_from([-1, 0, 1]),
    )
    @precondition(lambda self: self.live_sites())
    def grant(self, data, n, ttl, ahead):
        """A lease of the current round, the next (an early lease) or the one before."""
        site = data.draw(st.sampled_from(self.live_sites()))
        self.grant_to(site, n, ttl, max(0, self.round + ahead), ahead=ahead == 1)

    @rule(data=st.data(), n=st.integers(1, 16), ttl=st.sampled_from([1.0, 3.0, 10.0]))
    @precondition(lambda self: any(len(self.held(s)) == 1 for s in self.live_sites()))
    def early_grant(self, data, n, ttl):
        """A site that holds one lease takes its second, for the round after that lease's."""
        site = data.draw(st.sampled_from([s for s in self.live_sites() if len(self.held(s)) == 1]))
        self.grant_to(site, n, ttl, self.held(site)[0][1]["round"] + 1, ahead=True)

    @rule()
    def next_round(self):
        self.round += 1

    @rule(n=st.integers(1, 8))
    def work_round(self, n):
        """Every live site commits its oldest lease in full and takes one for the round after
        its newest (an early lease while the other is live), or one of this round if idle."""
        for site in self.live_sites():
            held = self.held(site)
            if not held:
                self.grant_to(site, n, 10.0, self.round)
                continue
            if len(held) == 1:
                self.grant_to(site, n, 10.0, held[0][1]["round"] + 1, ahead=True)
            self.commit_lease(held[0][0], full=True)

    @rule(data=st.data(), step=st.integers(0, 4), ttl=st.sampled_from([None, 2.0, 10.0]))
    @precondition(lambda self: any(v["site"] not in self.crashed for v in self.leases.values()))
    def heartbeat(self, data, step, ttl):
        ids = sorted(i for i, v in self.leases.items() if v["site"] not in self.crashed)
        lease_id = data.draw(st.sampled_from(ids))
        lease = self.leases[lease_id]
        consumed = min(lease["end"] - lease["start"], lease["consumed"] + step)
        args = dict(lease_id=lease_id, site=lease["site"], consumed=consumed, now=self.now)
        if ttl is not None:
            args["ttl_s"] = ttl
        if self.now >= lease["expires_at"]:
            return self.refused("expired", "heartbeat", **args)
        got = self.do("heartbeat", **args)
        lease["ttl"] = ttl if ttl is not None else lease["ttl"]
        lease["consumed"] = consumed
        lease["expires_at"] = self.now + lease["ttl"]
        assert (got.start, got.end, got.expires_at) == (
            lease["start"],
            lease["end"],
            lease["expires_at"],
        )

    @rule(data=st.data(), stale=st.booleans())
    @precondition(lambda self: self.leases)
    def adopt(self, data, stale):
        """A restarted job takes over a lease its site holds, at the progress it saw; one
        seen at other progress (``stale``: a late replay) is refused and changes nothing."""
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        lease = self.leases[lease_id]
        seen = lease["consumed"] + 1 if stale else lease["consumed"]
        args = dict(lease_id=lease_id, site=lease["site"], consumed=seen, now=self.now)
        if self.now >= lease["expires_at"]:
            return self.refused("expired", "adopt", **args)
        if stale:
            return self.refused("bad_progress", "adopt", **args)
        got = self.do("adopt", **args)
        self.crashed.discard(lease["site"])  # the job that adopts it is alive
        lease["consumed"], lease["expires_at"] = 0, self.now + lease["ttl"]
        assert (got.start, got.end, got.consumed, got.expires_at) == (
            lease["start"], lease["end"], 0, lease["expires_at"],
        )  # fmt: skip

    @rule(data=st.data())
    @precondition(lambda self: self.live_sites())
    def crash(self, data):
        self.crashed.add(data.draw(st.sampled_from(self.live_sites())))

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0]), then_expire=st.booleans())
    def tick(self, dt, then_expire):
        """Advance the fake clock; the coordinator's expiry sweep may or may not run yet."""
        self.now += dt
        if not then_expire:
            return
        dead = self.do("expire", now=self.now)
        want = sorted(i for i, v in self.leases.items() if v["expires_at"] <= self.now)
        assert sorted(x.lease_id for x in dead) == want
        for lease_id in want:
            lease = self.expired[lease_id] = self.leases.pop(lease_id)
            self.pools[lease["epoch"]] |= set(range(lease["start"], lease["end"]))
            self.bump(lease["site"], lost=lease["end"] - lease["start"], expiries=1)

    @rule(data=st.data(), ttl=st.sampled_from([3.0, 10.0]), ahead=st.sampled_from([0, 1]))
    @precondition(lambda self: self.live_sites())
    def steal(self, data, ttl, ahead):
        site = data.draw(st.sampled_from(self.live_sites()))
        round_no = self.round + ahead
        # blocks the coordinator judges a holder trained unheard, keyed as the ledger keeps them
        unheard = {str(i): data.draw(st.integers(0, 3)) for i in sorted(self.leases)}
        args = dict(site=site, now=self.now, ttl_s=ttl, round_no=round_no, ahead=unheard)
        if not self.may_lease(site, round_no):
            return self.refused("already_holding", "steal", **args)
        if self.pools[self.epoch]:
            return self.refused("pool_not_empty", "steal", **args)
        best, rest = None, 0
        for lease_id in sorted(self.leases):
            lease = self.leases[lease_id]
            trained = lease["consumed"] + unheard.get(str(lease_id), 0)
            r = lease["end"] - lease["start"] - trained - 1
            # never the thief's own other lease, never one of the next epoch
            if lease["site"] != site and lease["epoch"] == self.epoch and r > rest:
                best, rest = lease_id, r
        own = {i: (v["start"], v["end"]) for i, v in self.held(site)}
        got = self.do("steal", **args)
        assert {i: (self.book.lease(i).start, self.book.lease(i).end) for i in own} == own
        if best is None:
            assert got is None
            return
        victim = self.leases[best]
        tail = rest - rest // 2
        assert (got.start, got.end) == (victim["end"] - tail, victim["end"])
        victim["end"] -= tail
        assert victim["site"] != site and got.epoch == self.epoch
        self.leases[got.lease_id] = dict(
            epoch=self.epoch,
            site=site,
            start=got.start,
            end=got.end,
            consumed=0,
            expires_at=self.now + ttl,
            ttl=ttl,
            round=round_no,
        )
        self.bump(victim["site"], granted=-tail)
        self.bump(site, grants=1, granted=tail)

    @rule(data=st.data(), full=st.booleans())
    @precondition(lambda self: any(v["site"] not in self.crashed for v in self.leases.values()))
    def commit(self, data, full):
        ids = sorted(i for i, v in self.leases.items() if v["site"] not in self.crashed)
        self.commit_lease(data.draw(st.sampled_from(ids)), full)

    @rule(data=st.data())
    @precondition(lambda self: self.last_commit)
    def commit_again(self, data):
        site = data.draw(st.sampled_from(sorted(self.last_commit)))
        lease_id, consumed = self.last_commit[site]
        before = self.book.snapshot()
        res = self.do("commit", lease_id=lease_id, site=site, consumed=consumed, now=self.now)
        assert res.already and res.committed == consumed
        assert self.book.snapshot() == before

    @rule(data=st.data())
    @precondition(lambda self: any(v["site"] not in self.crashed for v in self.leases.values()))
    def release(self, data):
        ids = sorted(i for i, v in self.leases.items() if v["site"] not in self.crashed)
        lease_id = data.draw(st.sampled_from(ids))
        lease = self.leases.pop(lease_id)
        n = self.do("release", lease_id=lease_id, site=lease["site"], now=self.now)
        assert n == lease["end"] - lease["start"]
        self.pools[lease["epoch"]] |= set(range(lease["start"], lease["end"]))
        self.bump(lease["site"], lost=n)

    @rule(data=st.data(), step=st.integers(-2, 3))
    @precondition(lambda self: self.expired or self.leases)
    def revive(self, data, step):
        """A lease heard from after its TTL lives again at the progress it reports (or the
        one it had, if larger: a restarted job resuming its checkpoint), if its epoch is
        open and every position of it is still pooled; else nothing changes."""
        lease_id = data.draw(st.sampled_from(sorted(self.expired) + sorted(self.leases)))
        lease = self.expired.get(lease_id) or self.leases[lease_id]
        site, span = lease["site"], set(range(lease["start"], lease["end"]))
        reported = max(0, min(lease["end"] - lease["start"], lease["consumed"] + step))
        consumed = max(reported, lease["consumed"])
        args = dict(lease_id=lease_id, site=site, consumed=reported, now=self.now)
        if lease["epoch"] not in self.pools:
            return self.refused("stale_epoch", "revive", **args)
        if lease_id in self.expired:
            held = self.held(site)  # at most two, one per round, in any order
            if len(held) >= 2 or any(v["round"] == lease["round"] for _, v in held):
                return self.refused("already_holding", "revive", **args)
            if not span <= self.pools[lease["epoch"]]:
                return self.refused("expired", "revive", **args)
        got = self.do("revive", **args)
        if lease_id in self.expired:
            self.leases[lease_id] = self.expired.pop(lease_id)
            self.pools[lease["epoch"]] -= span
            self.bump(site, granted=len(span))
        lease["consumed"], lease["expires_at"] = consumed, self.now + lease["ttl"]
        assert (got.start, got.end, got.consumed, got.expires_at, got.status) == (
            lease["start"], lease["end"], consumed, lease["expires_at"], "active",
        )  # fmt: skip

    @rule(data=st.data())
    @precondition(lambda self: self.leases and len(self.stats) > 1)
    def impostor(self, data):
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        owner = self.leases[lease_id]["site"]
        other = data.draw(st.sampled_from(sorted(s for s in self.stats if s != owner)))
        args = dict(lease_id=lease_id, site=other, consumed=0, now=self.now)
        self.refused("not_owner", "commit", **args)
        self.ledger.record("commit", args)  # a refused command in the log replays as a no-op

    @rule()
    def checkpoint(self):
        """A checkpoint anywhere: later restarts replay from it and reach the same book."""
        self.ledger.checkpoint(self.book)

    @rule()
    def restart(self):
        self.conn.commit()
        fresh = LeaseBook(self.n)
        self.ledger.replay(fresh)
        assert fresh.snapshot() == self.book.snapshot()
        self.book = fresh

    @rule()
    def grace(self):
        """A coordinator restart renews every active lease from now (never shortens one)."""
        renewed = self.do("grace", now=self.now)
        assert sorted(x.lease_id for x in renewed) == sorted(self.leases)
        for lease in self.leases.values():
            lease["expires_at"] = max(lease["expires_at"], self.now + lease["ttl"])
        for got in renewed:
            assert got.expires_at == self.leases[got.lease_id]["expires_at"]

    @rule()
    @precondition(lambda self: len(self.done[self.epoch]) == self.n)
    def next_epoch(self):
        assert self.book.epoch_complete()
        audit = self.conn.execute(
            "SELECT COUNT(*), COUNT(DISTINCT block), MIN(block), MAX(block)"
            " FROM darl_committed WHERE epoch = ?",
            (self.epoch,),
        ).fetchone()
        assert audit == (self.n, self.n, 0, self.n - 1)  # every block exactly once
        self.do("next_epoch", now=self.now)
        del self.pools[self.epoch], self.done[self.epoch]
        self.epoch += 1  # the next epoch, as its leases ahead left it, or a full pool
        self.pools.setdefault(self.epoch, set(range(self.n)))
        self.done.setdefault(self.epoch, set())
        self.last_commit.clear()

    # ---- invariants

    @invariant()
    def partition(self):
        book = self.book
        assert book.open_epochs() == sorted(self.pools) and book.epoch == self.epoch
        for epoch in book.open_epochs():
            active: list[int] = []
            for lease in book.active_leases():
                if lease.epoch == epoch:
                    active.extend(range(lease.start, lease.end))
            assert len(active) == len(set(active))  # no position in two leases
            committed = {p for a, b in book.committed_spans(epoch) for p in range(a, b)}
            pool = {p for a, b in book.pool_spans(epoch) for p in range(a, b)}
            assert not committed & set(active) and not pool & set(active)
            assert not pool & committed
            assert committed | set(active) | pool == set(range(self.n))  # nothing lost
            assert committed == self.done[epoch] and pool == self.pools[epoch]
        assert book.pool_size == len(self.pools[self.epoch])
        assert book.committed_in_epoch == len(self.done[self.epoch])

    @invariant()
    def leases_match(self):
        got = {x.lease_id: x for x in self.book.active_leases()}
        assert set(got) == set(self.leases)
        for lease_id, want in self.leases.items():
            lease = got[lease_id]
            assert lease.epoch == want["epoch"]
            assert (lease.site, lease.start, lease.end, lease.consumed, lease.expires_at) == (
                want["site"],
                want["start"],
                want["end"],
                want["consumed"],
                want["expires_at"],
            )
            assert lease.round_no == want["round"]

    @invariant()
    def two_leases_at_most_one_per_round(self):
        by_site = self.book.snapshot()["by_site"]
        for site in self.stats:
            held = self.held(site)
            rounds = [v["round"] for _, v in held]
            assert len(held) <= 2 and rounds == sorted(set(rounds))
            assert by_site.get(site, []) == [i for i, _ in held]
        for round_no in {v["round"] for v in self.leases.values()} | {self.round}:
            want = sorted(v["site"] for v in self.leases.values() if v["round"] == round_no)
            assert sorted(self.book.active_sites(round_no)) == want

    @invariant()
    def accounting(self):
        stats = self.book.site_stats()
        assert sum(s.blocks_committed for s in stats.values()) == self.book.committed_total
        assert self.book.committed_total == self.committed_total
        held: dict[str, int] = {}
        for v in self.leases.values():  # summed over a site's (up to two) leases
            held[v["site"]] = held.get(v["site"], 0) + v["end"] - v["start"]
        for site, want in self.stats.items():
            s = stats[site]
            assert (s.entries, s.grants, s.blocks_granted) == (
                want["entries"],
                want["grants"],
                want["granted"],
            )
            assert (s.blocks_committed, s.blocks_lost, s.ttl_expiries) == (
                want["committed"],
                want["lost"],
                want["expiries"],
            )
            assert s.blocks_granted == s.blocks_committed + s.blocks_lost + held.get(site, 0)
        audited = sum(self.ledger.audit_counts().values())
        assert audited == self.committed_total


LeaseModel.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLeaseModel = LeaseModel.TestCase
