"""DARL leases: the pure state machine of which block positions are pooled, leased or committed.

No I/O and no clocks: every command takes `now` (seconds), so replaying the same commands
gives the same book. Positions index the epoch's block permutation
(`BlockSpace.permutation(epoch)`); a lease is one contiguous span [start, end) of positions
whose first `consumed` are trained. A lease is live while now < expires_at; it dies when
`expire(now)` runs (or is released), and only then do its blocks return to the pool.

Two leases per site (overlapped rounds): a site holds at most `MAX_LEASES_PER_SITE` active
leases, at most one per round, and takes its second only for a later round than the one it
holds (the lease of round r uploading and committing while round r+1's trains). A grant or a
steal for round r is refused (`already_holding`) while the site holds a lease of round r or
later, or holds two. A steal never takes from the thief's own other lease. A restarted job
takes over the live lease its dead predecessor held (`adopt`) rather than waiting for its TTL.
A lease whose TTL ran out while its holder trained on, its heartbeats cut off, lives again
when the holder is heard from (`revive`), if none of its blocks was granted meanwhile.

Leasing ahead (overlapped rounds): a grant asked with ``ahead=True`` (the coordinator's early
leases of the next round) that finds the epoch's pool empty takes from the next epoch's
positions instead, so a site that finishes at an epoch's end trains on while the epoch's
last leases are committed, rather than idling until the epoch ends. Two epochs are then open:
the current one and the next; every other grant and every steal still takes from the
current epoch alone, a block that goes back to the current epoch's pool is granted before
any further block of the next, and when the current epoch's last block is committed the
next one becomes current, its leases as they are. Exactly once holds per (epoch, block).

Per-site accounting (paper Table 3): steals move the stolen tail from the victim's
`blocks_granted` to the thief's, so for every site
`blocks_granted == blocks_committed + blocks_lost + blocks held in its active leases`, where
`blocks_lost` counts every granted block that went back to the pool uncommitted (TTL expiry,
clean release, or the untrained rest of a commit).

Grant sizing (`LeaseBook.grant_size`): a site's rate is the blocks per second its measured
step times show (the coordinator passes them in: compute alone, known from a site's first
steps, so the second round is already sized), else its commit rate: the blocks it committed
over the seconds its leases were held (grant to commit), over its last `RATE_WINDOW`
commits. Its grant is its requested phase scaled by how fast it works through a phase
relative to the mean of the live sites, so every site's lease takes about the same wall
time: fast sites are not starved and slow ones do not hoard (see `proportional_grant`).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from sortedcontainers import SortedDict

__all__ = [
    "RATE_WINDOW",
    "CommitResult",
    "Lease",
    "LeaseBook",
    "LeaseError",
    "LeaseSizingError",
    "MAX_LEASES_PER_SITE",
    "SiteStats",
    "lease_blocks",
    "lease_ttl",
    "proportional_grant",
]

ACTIVE, COMMITTED, EXPIRED, RELEASED = "active", "committed", "expired", "released"
RATE_WINDOW = 4  # a site's commit rate is measured over its last RATE_WINDOW commits
MAX_LEASES_PER_SITE = 2  # one committing while the next round's trains (overlapped rounds)


class LeaseError(Exception):
    """A lease command the book refuses; `code` names the reason, the state is unchanged.

    Codes: unknown_site, unknown_lease, not_owner, stale_epoch, expired, committed,
    bad_progress, commit_mismatch, already_holding, pool_not_empty, epoch_incomplete,
    bad_argument.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class LeaseSizingError(ValueError):
    """Invalid input to a lease sizing helper."""


@dataclass
class Lease:
    """One contiguous span [start, end) of an epoch's positions held by one site."""

    lease_id: int
    site: str
    round_no: int
    epoch: int
    start: int
    end: int
    consumed: int
    granted_at: float
    expires_at: float
    ttl_s: float
    status: str  # active | committed | expired | released
    #: the site's ranks when it was granted: every inner step of its phase trains at least
    #: this many windows (one per rank), so its delta claims at most windows / ranks steps
    ranks: int = 1

    @property
    def n_blocks(self) -> int:
        return self.end - self.start

    @property
    def renewed_at(self) -> float:
        """When the lease was last granted, renewed or taken over: its TTL runs from here."""
        return self.expires_at - self.ttl_s


@dataclass
class CommitResult:
    lease_id: int
    committed: int
    returned: int
    already: bool


@dataclass
class SiteStats:
    """Per-site ledger counters (cumulative over epochs)."""

    entries: int = 0
    grants: int = 0  # leases received, steals included
    blocks_granted: int = 0
    blocks_committed: int = 0
    blocks_lost: int = 0
    ttl_expiries: int = 0
    steals: int = 0
    stolen_from: int = 0
    releases: int = 0


def _finite(name: str, value: float, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LeaseError("bad_argument", f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or (positive and value <= 0):
        need = "a positive finite number" if positive else "finite"
        raise LeaseError("bad_argument", f"{name} must be {need}, got {value!r}")
    return float(value)


def _count(name: str, value: int, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < lo:
        raise LeaseError("bad_argument", f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


class _Positions:
    """One epoch's positions: committed ones, and the pool (never granted or returned)."""

    def __init__(self, n_blocks: int, epoch: int) -> None:
        self.n_blocks, self.epoch = n_blocks, epoch
        self.committed = np.zeros(n_blocks, dtype=bool)
        self.n_committed = 0
        self.cursor = 0  # positions >= cursor have never been granted this epoch
        self.returned: SortedDict = SortedDict()  # start -> end, maximal runs below cursor
        self.pooled = n_blocks

    def complete(self) -> bool:
        return self.n_committed == self.n_blocks

    def pool_spans(self) -> list[tuple[int, int]]:
        spans = list(self.returned.items())
        if self.cursor < self.n_blocks:
            spans.append((self.cursor, self.n_blocks))
        return spans

    def committed_spans(self) -> list[tuple[int, int]]:
        edges = np.flatnonzero(np.diff(self.committed.astype(np.int8), prepend=0, append=0))
        return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]

    def snapshot(self) -> dict:
        return {
            "epoch": self.epoch,
            "committed_in_epoch": self.n_committed,
            "committed": self.committed_spans(),
            "pool": self.pool_spans(),
        }

    def commit(self, start: int, end: int) -> None:
        self.committed[start:end] = True
        self.n_committed += end - start

    def lowest_run(self) -> int:
        """The length of the pooled run ``take`` cuts from (0: the pool is empty)."""
        if self.returned:
            start, end = self.returned.peekitem(0)
            return end - start
        return self.n_blocks - self.cursor

    def take(self, n: int) -> tuple[int, int] | None:
        """Remove and return the lowest pooled run, cut to at most n positions."""
        if self.returned:
            start, end = self.returned.popitem(0)
            if end - start > n:
                self.returned[start + n] = end
                end = start + n
        elif self.cursor < self.n_blocks:
            start = self.cursor
            end = self.cursor = min(self.n_blocks, start + n)
        else:
            return None
        self.pooled -= end - start
        return start, end

    def take_span(self, start: int, end: int) -> bool:
        """Remove exactly [start, end) from the pool if every position of it is pooled."""
        if start >= self.cursor:  # never granted since: what lies before it stays pooled
            if start > self.cursor:  # no returned run ends at the cursor (give_back merges)
                self.returned[self.cursor] = start
            self.cursor = end
        else:
            i = self.returned.bisect_right(start) - 1
            if i < 0:
                return False
            first, last = self.returned.peekitem(i)
            if last < end:
                return False
            del self.returned[first]
            if first < start:
                self.returned[first] = start
            if end < last:
                self.returned[end] = last
        self.pooled -= end - start
        return True

    def give_back(self, start: int, end: int) -> None:
        """Put [start, end) back in the pool, merging with neighbouring runs and the cursor."""
        if end <= start:
            return
        self.pooled += end - start
        runs = self.returned
        i = runs.bisect_left(start)
        if i > 0:
            before = runs.peekitem(i - 1)
            if before[1] == start:
                start = before[0]
                del runs[start]
        after = runs.get(end)
        if after is not None:
            del runs[end]
            end = after
        if end == self.cursor:
            self.cursor = start
        else:
            runs[start] = end


class LeaseBook:
    """The coordinator's authoritative map of pooled, leased and committed positions."""

    def __init__(self, n_blocks: int, epoch: int = 0) -> None:
        self.n_blocks = _count("n_blocks", n_blocks, 1)
        self._current = _Positions(self.n_blocks, _count("epoch", epoch))
        self._ahead: _Positions | None = None  # the next epoch, once a grant leased ahead
        self._committed_before = 0  # committed in earlier epochs
        self._leases: dict[int, Lease] = {}
        self._active: dict[int, Lease] = {}
        self._by_site: dict[str, list[Lease]] = {}  # a site's active leases, oldest round first
        self._expiry: list[tuple[float, int]] = []  # (expires_at, lease_id), lazily deleted
        self._stats: dict[str, SiteStats] = {}
        self._next_id = 1
        # pacing: last commits as (blocks, seconds held), last requested size, last command time
        self._rates: dict[str, deque[tuple[int, float]]] = {}
        self._requested: dict[str, int] = {}
        self._seen: dict[str, float] = {}

    # ---- queries -------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The current epoch: the oldest with a block not yet committed."""
        return self._current.epoch

    def open_epochs(self) -> list[int]:
        """The current epoch, and the next one once a grant has leased ahead into it."""
        return [p.epoch for p in self._open()]

    @property
    def committed_in_epoch(self) -> int:
        return self._current.n_committed

    @property
    def committed_total(self) -> int:
        """Blocks committed over all epochs, the open ones included."""
        return self._committed_before + sum(p.n_committed for p in self._open())

    @property
    def pool_size(self) -> int:
        """Positions of the current epoch neither leased nor committed."""
        return self._current.pooled

    def pool_spans(self, epoch: int | None = None) -> list[tuple[int, int]]:
        """An open epoch's pool (default the current one) as sorted, disjoint,
        non-adjacent [start, end) spans."""
        return self._positions(epoch).pool_spans()

    def committed_spans(self, epoch: int | None = None) -> list[tuple[int, int]]:
        """An open epoch's committed positions (default the current one) as sorted
        [start, end) spans (O(M); for audits)."""
        return self._positions(epoch).committed_spans()

    def is_committed(self, position: int) -> bool:
        position = _count("position", position)
        if position >= self.n_blocks:
            raise LeaseError("bad_argument", f"position {position} >= n_blocks {self.n_blocks}")
        return bool(self._current.committed[position])

    def epoch_complete(self) -> bool:
        return self._current.complete()

    def lease(self, lease_id: int) -> Lease:
        return dataclasses.replace(self._get(lease_id))

    def active_leases(self) -> list[Lease]:
        return [dataclasses.replace(lease) for lease in self._active.values()]

    def active_sites(self, round_no: int | None = None) -> list[str]:
        """Sites holding an active lease (of `round_no`, if given); no copies made."""
        return [v.site for v in self._active.values() if round_no is None or v.round_no == round_no]

    def next_expiry(self) -> float | None:
        """When the next active lease expires (None without one): O(1) amortised, so a
        clock tick can ask every fraction of a second however many leases are out."""
        while self._expiry:
            at, lease_id = self._expiry[0]
            lease = self._active.get(lease_id)
            if lease is not None and lease.expires_at == at:
                return at
            heapq.heappop(self._expiry)  # stale: closed or refreshed since
        return None

    def sites(self) -> list[str]:
        return list(self._stats)

    def site_stats(self) -> dict[str, SiteStats]:
        return {site: dataclasses.replace(s) for site, s in self._stats.items()}

    def snapshot(self) -> dict:
        """Everything that defines the book's behaviour, as plain data (for replay checks)."""
        return {
            "n_blocks": self.n_blocks,
            **self._current.snapshot(),
            "committed_before": self._committed_before,
            "ahead": None if self._ahead is None else self._ahead.snapshot(),
            "next_id": self._next_id,
            "leases": {i: dataclasses.asdict(v) for i, v in self._leases.items()},
            "active": sorted(self._active),
            "by_site": {s: [v.lease_id for v in held] for s, held in sorted(self._by_site.items())},
            "stats": {s: dataclasses.asdict(v) for s, v in self._stats.items()},
            "pacing": {
                s: (list(self._rates.get(s, ())), self._requested.get(s), self._seen.get(s))
                for s in sorted(self._stats)
            },
        }

    def commit_rate(self, site: str) -> float | None:
        """Blocks per second of lease time over the site's last RATE_WINDOW commits (None if
        it has not committed a block yet)."""
        history = self._rates.get(site)
        if not history:
            return None
        blocks = sum(b for b, _ in history)
        seconds = sum(t for _, t in history)
        return blocks / seconds if seconds > 0 else None

    def grant_size(
        self,
        site: str,
        requested: int,
        now: float,
        *,
        live_s: float = 3600.0,
        max_scale: float = 4.0,
        step_rates: Mapping[str, float] | None = None,
        probe_share: float = 1.0,
    ) -> int:
        """Blocks to grant a site that asks for `requested` (its inner phase), by its rate.

        A site's rate is the blocks per second of compute its step times show
        (`step_rates`, measured by the sites as they train) or, for a site without one, its
        commit rate. Its pace is that rate over its last requested size: inner phases per
        second. The grant is `requested * pace / mean pace`, the mean taken over the sites
        seen within `live_s` that have a rate, rounded half up and kept in
        [1, max_scale * requested]. With equal requests that is proportional to the rate; in
        general every site's lease then lasts about 1 / mean pace seconds. A site without a
        rate gets a probe: `probe_share` of what it asked for (rounded half up, at least one
        block; 1.0, the default, grants the request whole).
        """
        self._site(site)
        requested = _count("requested", requested, 1)
        now = _finite("now", now)
        live_s = _finite("live_s", live_s, positive=True)
        max_scale = _finite("max_scale", max_scale, positive=True)
        probe_share = _finite("probe_share", probe_share, positive=True)
        if probe_share > 1.0:
            raise LeaseError("bad_argument", f"probe_share must be in (0, 1], got {probe_share!r}")
        hi = max(1, math.floor(max_scale * requested))
        step_rates = step_rates or {}

        def rate_of(name: str) -> float | None:
            measured = step_rates.get(name)
            if measured is not None and math.isfinite(measured) and measured > 0:
                return float(measured)
            return self.commit_rate(name)

        rate = rate_of(site)
        if rate is None:
            return min(max(1, math.floor(probe_share * requested + 0.5)), hi)
        paces = []
        for other in sorted(set(self._rates) | set(step_rates)):
            other_rate = rate_of(other) if other in self._stats else None
            if other == site or other_rate is None:
                continue
            if now - self._seen.get(other, -math.inf) > live_s:
                continue
            paces.append(other_rate / self._requested.get(other, requested))
        own = rate / requested
        mean = (own + sum(paces)) / (1 + len(paces))
        return proportional_grant(requested, own, mean, lo=1, hi=hi)

    # ---- commands ------------------------------------------------------------------------

    def uncut_size(self, n_blocks: int, within: int, ahead: bool = False) -> int:
        """The size to grant instead of ``n_blocks`` so that a grant leaves no crumb: the
        whole pooled run it would cut from when at most ``within`` positions of that run
        would be left behind (an epoch's last blocks, a lost lease's tail), else
        ``n_blocks``. ``ahead`` as in `grant`. A pure query."""
        n_blocks, within = _count("n_blocks", n_blocks, 1), _count("within", within)
        run = self._current.lowest_run()
        if not run and ahead:
            run = self.n_blocks if self._ahead is None else self._ahead.lowest_run()
        return run if n_blocks < run <= n_blocks + within else n_blocks

    def register(self, site: str, now: float) -> None:
        """A site joins (again): counts one entry. Its old leases, if any, live on their TTL."""
        self._check_site_name(site)
        now = _finite("now", now)
        self._stats.setdefault(site, SiteStats()).entries += 1
        self._seen[site] = now

    def grant(
        self,
        site: str,
        n_blocks: int,
        now: float,
        ttl_s: float,
        round_no: int,
        requested: int | None = None,
        ranks: int | None = None,
        ahead: bool = False,
    ) -> Lease | None:
        """Lease one contiguous span of up to n_blocks from the lowest pooled position.

        `requested` is what the site asked for before sizing (default n_blocks); the book
        keeps it to measure the site's pace (see `grant_size`). `ranks`: the site's ranks
        (default 1), kept on the lease. `ahead`: with the current epoch's pool empty, take
        from the next epoch's (see the module's "Leasing ahead"). Refused
        (`already_holding`) while the site holds a lease of `round_no` or a later round, or
        two leases.
        """
        stats = self._site(site)
        n_blocks = _count("n_blocks", n_blocks, 1)
        requested = n_blocks if requested is None else _count("requested", requested, 1)
        now, ttl_s = _finite("now", now), _finite("ttl_s", ttl_s, positive=True)
        round_no = _count("round_no", round_no)
        self._check_not_holding(site, round_no)
        self._requested[site] = requested
        self._seen[site] = now
        positions = self._current
        span = positions.take(n_blocks)
        if span is None and ahead:
            if self._ahead is None:
                self._ahead = _Positions(self.n_blocks, self.epoch + 1)
            positions = self._ahead
            span = positions.take(n_blocks)
        if span is None:
            return None
        stats.grants += 1
        stats.blocks_granted += span[1] - span[0]
        return self._new_lease(site, round_no, span, now, ttl_s, ranks, positions.epoch)

    def heartbeat(
        self, lease_id: int, site: str, consumed: int, now: float, ttl_s: float | None = None
    ) -> Lease:
        """Report progress and extend the TTL; returns the lease (its end may have shrunk)."""
        lease = self._live(lease_id, site, now)
        consumed = _count("consumed", consumed)
        if consumed < lease.consumed or consumed > lease.n_blocks:
            raise LeaseError(
                "bad_progress",
                f"lease {lease_id}: consumed {consumed} outside [{lease.consumed}, "
                f"{lease.n_blocks}]",
            )
        return self._renew(lease, consumed, now, ttl_s)

    def _renew(self, lease: Lease, consumed: int, now: float, ttl_s: float | None) -> Lease:
        """Set ``lease``'s progress and start its TTL anew (``ttl_s``, when given, replaces
        it); its holder was seen ``now``. A copy of the lease."""
        if ttl_s is not None:
            lease.ttl_s = _finite("ttl_s", ttl_s, positive=True)
        lease.consumed = consumed
        lease.expires_at = now + lease.ttl_s
        self._push_expiry(lease)
        self._seen[lease.site] = now
        return dataclasses.replace(lease)

    def steal(
        self,
        site: str,
        now: float,
        ttl_s: float,
        round_no: int,
        ranks: int | None = None,
        ahead: Mapping[int, int] | None = None,
    ) -> Lease | None:
        """A drained site takes the untouched tail of another site's largest live lease of the
        current epoch.

        The victim keeps its consumed blocks, the ones its holder has likely trained since it
        last said so (``ahead``, per lease id: the caller's projection from the holder's pace,
        since a holder hears of a steal only at its next heartbeat and trains on meanwhile),
        the one in progress and half (rounded down) of the rest; the thief gets the
        remaining tail. "Largest" means the largest stealable rest (n_blocks - consumed -
        ahead - 1), ties to the lowest lease id. None when no lease has a rest of at least
        one block. The victim is another site's lease, never the thief's own (a thief may
        hold a lease of an earlier round: see `grant` for when it may not).
        """
        stats = self._site(site)
        now, ttl_s = _finite("now", now), _finite("ttl_s", ttl_s, positive=True)
        round_no = _count("round_no", round_no)
        self._check_not_holding(site, round_no)
        if self._current.pooled:
            pooled = self._current.pooled
            raise LeaseError("pool_not_empty", f"{pooled} blocks are pooled; grant instead")
        self._seen[site] = now
        ahead = ahead or {}
        victim, rest = None, 0
        for lease in self._active.values():  # ascending lease id, so ties keep the oldest
            trained = lease.consumed + max(0, int(ahead.get(lease.lease_id, 0)))
            lease_rest = lease.n_blocks - trained - 1
            off_limits = lease.site == site or lease.epoch != self.epoch
            if not off_limits and lease_rest > rest:
                victim, rest = lease.lease_id, lease_rest
        if victim is None:
            return None
        lease = self._active[victim]
        tail = rest - rest // 2
        span = (lease.end - tail, lease.end)
        lease.end -= tail
        victim_stats = self._stats[lease.site]
        victim_stats.stolen_from += 1
        victim_stats.blocks_granted -= tail
        stats.steals += 1
        stats.grants += 1
        stats.blocks_granted += tail
        return self._new_lease(site, round_no, span, now, ttl_s, ranks, lease.epoch)

    def commit(
        self, lease_id: int, site: str, consumed: int, now: float, idle_s: float = 0.0
    ) -> CommitResult:
        """Commit the first `consumed` blocks, pool the rest; repeating it changes nothing.

        `idle_s`: seconds the site held the lease waiting, not working (an overlapped
        round's wait for the previous merge); they are left out of its commit rate.
        """
        lease = self._owned(lease_id, site)
        consumed = _count("consumed", consumed)
        idle_s = _finite("idle_s", idle_s)
        if lease.status == COMMITTED:
            if consumed != lease.consumed:
                raise LeaseError(
                    "commit_mismatch",
                    f"lease {lease_id} was committed with {lease.consumed} blocks, not {consumed}",
                )
            return CommitResult(lease_id, lease.consumed, lease.n_blocks - lease.consumed, True)
        lease = self._live(lease_id, site, now)
        if consumed > lease.n_blocks:
            raise LeaseError(
                "bad_progress", f"lease {lease_id}: consumed {consumed} > {lease.n_blocks} blocks"
            )
        cut = lease.start + consumed
        positions = self._positions(lease.epoch)
        positions.commit(lease.start, cut)
        positions.give_back(cut, lease.end)
        stats = self._stats[site]
        stats.blocks_committed += consumed
        stats.blocks_lost += lease.end - cut
        lease.consumed = consumed
        self._close(lease, COMMITTED)
        held = now - lease.granted_at - max(0.0, idle_s)
        if consumed and held > 0:
            self._rates.setdefault(site, deque(maxlen=RATE_WINDOW)).append((consumed, held))
        self._seen[site] = now
        return CommitResult(lease_id, consumed, lease.end - cut, False)

    def release(self, lease_id: int, site: str, now: float) -> int:
        """Clean departure: all the lease's blocks return to the pool (its work is not merged).

        Returns how many blocks returned; 0 for a lease that is no longer active.
        """
        lease = self._owned(lease_id, site)
        _finite("now", now)
        if lease.status != ACTIVE:
            return 0
        self._positions(lease.epoch).give_back(lease.start, lease.end)
        stats = self._stats[site]
        stats.blocks_lost += lease.n_blocks
        stats.releases += 1
        self._close(lease, RELEASED)
        return lease.n_blocks

    def expire(self, now: float) -> list[Lease]:
        """Every active lease with expires_at <= now dies; all its blocks return to the pool."""
        now = _finite("now", now)
        dead = []
        while self._expiry and self._expiry[0][0] <= now:
            at, lease_id = heapq.heappop(self._expiry)
            lease = self._active.get(lease_id)
            if lease is None or lease.expires_at != at:
                continue  # stale entry: closed or refreshed since
            self._positions(lease.epoch).give_back(lease.start, lease.end)
            stats = self._stats[lease.site]
            stats.blocks_lost += lease.n_blocks
            stats.ttl_expiries += 1
            self._close(lease, EXPIRED)
            dead.append(dataclasses.replace(lease))
        return dead

    def grace(self, now: float) -> list[Lease]:
        """Every active lease gets a fresh TTL from `now` (never a shorter one).

        For a coordinator restart: its sites could not heartbeat while it was down, so a lease
        must not die for the coordinator's absence; a site that really died loses its lease
        one TTL later. Returns the renewed leases.
        """
        now = _finite("now", now)
        renewed = []
        for lease in self._active.values():
            lease.expires_at = max(lease.expires_at, now + lease.ttl_s)
            self._push_expiry(lease)
            renewed.append(dataclasses.replace(lease))
        return renewed

    def next_epoch(self) -> None:
        """The next epoch becomes the current one (its leases ahead as they are, else a full
        pool); only once every block of this one is committed."""
        if not self.epoch_complete():
            raise LeaseError(
                "epoch_incomplete",
                f"epoch {self.epoch}: {self._current.n_committed}/{self.n_blocks} committed",
            )
        self._committed_before += self._current.n_committed
        following = self._ahead or _Positions(self.n_blocks, self.epoch + 1)
        self._current, self._ahead = following, None

    # ---- internals -----------------------------------------------------------------------

    @staticmethod
    def _check_site_name(site: str) -> None:
        if not isinstance(site, str) or not site:
            raise LeaseError("bad_argument", f"site must be a non-empty string, got {site!r}")

    def _site(self, site: str) -> SiteStats:
        self._check_site_name(site)
        stats = self._stats.get(site)
        if stats is None:
            raise LeaseError("unknown_site", f"site {site!r} has not registered")
        return stats

    def _check_not_holding(self, site: str, round_no: int) -> None:
        """Refuse a site's new lease for `round_no` unless it is the site's second at most and
        for a later round than the one it holds."""
        held = self._by_site.get(site, [])
        if len(held) >= MAX_LEASES_PER_SITE:
            ids = ", ".join(str(v.lease_id) for v in held)
            raise LeaseError(
                "already_holding",
                f"site {site!r} holds {len(held)} active leases ({ids}), the most a site may",
            )
        later = [v for v in held if v.round_no >= round_no]
        if later:
            raise LeaseError(
                "already_holding",
                f"site {site!r} holds active lease {later[0].lease_id} of round "
                f"{later[0].round_no}; a second lease must be for a later round than "
                f"{later[0].round_no}, not {round_no}",
            )

    def adopt(
        self, lease_id: int, site: str, consumed: int, now: float, ttl_s: float | None = None
    ) -> Lease:
        """A restarted job of ``site`` takes over its live lease ``lease_id``: nothing of it
        is trained any more (what the dead job trained died with it), so ``consumed`` goes
        back to 0 and the TTL starts anew. ``consumed`` is the progress the adopting job saw:
        an adoption asked against other progress (a late replay, after the new job's first
        heartbeat) is refused (``bad_progress``) and changes nothing."""
        lease = self._live(lease_id, site, now)
        consumed = _count("consumed", consumed)
        if consumed != lease.consumed:
            raise LeaseError(
                "bad_progress",
                f"lease {lease_id}: adopted at consumed {consumed}, but it is at {lease.consumed}",
            )
        return self._renew(lease, 0, now, ttl_s)

    def revive(
        self, lease_id: int, site: str, consumed: int, now: float, ttl_s: float | None = None
    ) -> Lease:
        """Its holder is heard from after its lease's TTL ran out (its heartbeats were cut
        off, or a restarted job resumes its checkpoint): the lease lives again if none of
        its blocks was granted since; else it stays expired. Its progress becomes
        ``consumed`` (a heartbeat's or a commit's) or what it last reported, the larger.

        An expired lease's blocks went back to the pool: they come out again, and count as
        granted again (``blocks_granted``; its expiry stays in ``blocks_lost``). A lease
        still active past its TTL (the expiry sweep had not run yet) is renewed. Refused
        (and nothing changes) for a released or committed lease, a closed epoch, progress
        past the lease's end, blocks granted since (``expired``), or a site that holds two
        leases or another of the lease's round (``already_holding``); one of a later round
        (an early lease taken while this one's commit was held up) may stay beside it.
        """
        lease = self._owned(lease_id, site)
        now = _finite("now", now)
        consumed = _count("consumed", consumed)
        if lease.epoch not in self.open_epochs():
            raise LeaseError("stale_epoch", f"lease {lease_id} is from epoch {lease.epoch}")
        if lease.status == COMMITTED:
            raise LeaseError("committed", f"lease {lease_id} is already committed")
        if lease.status not in (ACTIVE, EXPIRED):
            raise LeaseError("expired", f"lease {lease_id} is {lease.status}")
        if consumed > lease.n_blocks:
            raise LeaseError(
                "bad_progress", f"lease {lease_id}: consumed {consumed} > {lease.n_blocks} blocks"
            )
        if lease.status == EXPIRED:
            held = self._by_site.get(site, [])
            if len(held) >= MAX_LEASES_PER_SITE or any(v.round_no == lease.round_no for v in held):
                ids = ", ".join(str(v.lease_id) for v in held)
                raise LeaseError(
                    "already_holding",
                    f"site {site!r} holds active leases ({ids}): lease {lease_id} of round "
                    f"{lease.round_no} would be one too many, or a second of its round",
                )
            positions = self._positions(lease.epoch)
            if not positions.take_span(lease.start, lease.end):
                raise LeaseError(
                    "expired",
                    f"lease {lease_id} expired and blocks of it were granted since",
                )
            lease.status = ACTIVE
            self._active[lease.lease_id] = lease
            # beside a later round's (the early lease its site took while the commit was
            # held up): oldest round first, as the site's leases are kept
            self._by_site[site] = sorted([*held, lease], key=lambda v: v.round_no)
            self._stats[site].blocks_granted += lease.n_blocks
        return self._renew(lease, max(consumed, lease.consumed), now, ttl_s)

    def _get(self, lease_id: int) -> Lease:
        ok = isinstance(lease_id, int | np.integer) and not isinstance(lease_id, bool)
        lease = self._leases.get(int(lease_id)) if ok else None
        if lease is None:
            raise LeaseError("unknown_lease", f"no lease {lease_id!r}")
        return lease

    def _owned(self, lease_id: int, site: str) -> Lease:
        lease = self._get(lease_id)
        if lease.site != site:
            raise LeaseError(
                "not_owner", f"lease {lease_id} belongs to {lease.site!r}, not {site!r}"
            )
        return lease

    def _live(self, lease_id: int, site: str, now: float) -> Lease:
        lease = self._owned(lease_id, site)
        now = _finite("now", now)
        if lease.epoch not in self.open_epochs():
            raise LeaseError("stale_epoch", f"lease {lease_id} is from epoch {lease.epoch}")
        if lease.status == COMMITTED:
            raise LeaseError("committed", f"lease {lease_id} is already committed")
        if lease.status != ACTIVE:
            raise LeaseError("expired", f"lease {lease_id} is {lease.status}")
        if now >= lease.expires_at:
            raise LeaseError("expired", f"lease {lease_id} expired at {lease.expires_at} <= {now}")
        return lease

    def _new_lease(
        self,
        site: str,
        round_no: int,
        span: tuple[int, int],
        now: float,
        ttl_s: float,
        ranks: int | None,
        epoch: int,
    ) -> Lease:
        lease = Lease(
            lease_id=self._next_id,
            site=site,
            round_no=round_no,
            epoch=epoch,
            start=span[0],
            end=span[1],
            consumed=0,
            granted_at=now,
            expires_at=now + ttl_s,
            ttl_s=ttl_s,
            status=ACTIVE,
            ranks=1 if ranks is None else _count("ranks", ranks, 1),
        )
        self._next_id += 1
        self._leases[lease.lease_id] = lease
        self._active[lease.lease_id] = lease
        self._by_site.setdefault(site, []).append(lease)  # a later round than any it holds
        self._push_expiry(lease)
        return dataclasses.replace(lease)

    def _close(self, lease: Lease, status: str) -> None:
        lease.status = status
        del self._active[lease.lease_id]
        held = [v for v in self._by_site[lease.site] if v is not lease]
        if held:
            self._by_site[lease.site] = held
        else:
            del self._by_site[lease.site]

    def _push_expiry(self, lease: Lease) -> None:
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
        if len(self._expiry) > 4 * len(self._active) + 64:
            self._expiry = [(v.expires_at, i) for i, v in self._active.items()]
            heapq.heapify(self._expiry)

    def _open(self) -> list[_Positions]:
        return [self._current] if self._ahead is None else [self._current, self._ahead]

    def _positions(self, epoch: int | None) -> _Positions:
        """An open epoch's positions (None: the current epoch's)."""
        for positions in self._open():
            if epoch is None or positions.epoch == epoch:
                return positions
        raise LeaseError("stale_epoch", f"epoch {epoch} is not open ({self.open_epochs()})")


def lease_blocks(h: int, b: int, w: int, a: int, k: int) -> int:
    """Blocks per lease for one inner phase: max(1, ceil(H*B*W*A / K))."""
    for name, v in (("h", h), ("b", b), ("w", w), ("a", a), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise LeaseSizingError(f"{name} must be a positive integer, got {v!r}")
    return max(1, -(-(h * b * w * a) // k))


def lease_ttl(t_step_s: float, rtt_s: float, alpha: float = 2.5, beta_rtt: float = 2.0) -> float:
    """Lease TTL in seconds: alpha * mean step time + beta_rtt * round-trip time."""
    for name, v in (("t_step_s", t_step_s), ("rtt_s", rtt_s), ("alpha", alpha)):
        if not math.isfinite(v) or v < 0:
            raise LeaseSizingError(f"{name} must be finite and >= 0, got {v!r}")
    if not math.isfinite(beta_rtt) or beta_rtt < 0:
        raise LeaseSizingError(f"beta_rtt must be finite and >= 0, got {beta_rtt!r}")
    ttl = alpha * t_step_s + beta_rtt * rtt_s
    if ttl <= 0:
        raise LeaseSizingError("TTL must be positive: give a step time or an RTT above zero")
    return ttl


def proportional_grant(
    base_blocks: int,
    site_rate: float | None,
    mean_rate: float | None,
    lo: int = 1,
    hi: int | None = None,
) -> int:
    """Lease size scaled by the site's commit rate over the live sites' mean, in [lo, hi].

    base_blocks when either rate is unknown (None) or the mean is not positive; the scaled
    size rounds half up.
    """
    if isinstance(base_blocks, bool) or not isinstance(base_blocks, int) or base_blocks < 1:
        raise LeaseSizingError(f"base_blocks must be a positive integer, got {base_blocks!r}")
    if lo < 1 or (hi is not None and hi < lo):
        raise LeaseSizingError(f"need 1 <= lo <= hi, got lo={lo!r} hi={hi!r}")
    size = base_blocks
    if site_rate is not None and mean_rate is not None and mean_rate > 0:
        if not math.isfinite(site_rate) or site_rate < 0 or not math.isfinite(mean_rate):
            raise LeaseSizingError(f"rates must be finite, >= 0: {site_rate!r}, {mean_rate!r}")
        size = math.floor(base_blocks * site_rate / mean_rate + 0.5)
    size = max(lo, size)
    return size if hi is None else min(hi, size)


def round_end_grant(size: int, rate: float, left_s: float, deadline_s: float, hi: int) -> int:
    """An early lease of ``size`` blocks (paced), grown to end with its round: by the blocks
    the site trains at ``rate`` (blocks a second) in the ``left_s`` seconds the open round
    likely still needs, at most half of ``size`` more, never past half the round's
    ``deadline_s`` from its forecast opening (``left_s`` from now), and at most ``hi``; never
    below ``size``."""
    if size < 1 or not (rate > 0 and math.isfinite(rate)) or left_s < 0 or deadline_s <= 0:
        raise LeaseSizingError(
            f"need size >= 1, rate > 0, left_s >= 0, deadline_s > 0: "
            f"{size!r}, {rate!r}, {left_s!r}, {deadline_s!r}"
        )
    grown = size + min(size // 2, math.floor(rate * left_s))
    within = math.floor(rate * (left_s + deadline_s / 2))
    return max(size, min(grown, within, hi))
