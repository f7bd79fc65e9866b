"""The coordinator's leasing: sites register, lease blocks, beat and release.

A grant is sized by the site's pace (``LeaseBook.grant_size``), an early lease also to end
with its round (``_to_round_end``), and takes the rest of the pooled run it cuts when that
rest is a crumb (``CRUMB_SHARE``); a lease's TTL by its step time and the RTT this
coordinator measures itself from the heartbeats' echoes.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

from crossfed.coordinator import store
from crossfed.coordinator.core import CoordinatorError, lease_errors, log
from crossfed.coordinator.rounds import next_global_step
from crossfed.coordinator.views import Views
from crossfed.darl.leases import LeaseError, lease_ttl, round_end_grant

MAX_RTT_MS = 60_000.0  # a measured RTT sample is clamped to this
ECHOES_PER_SITE = 4  # outstanding RTT nonces kept per site (a site may beat for two leases)
PACE_LIVE_S = 3600.0  # sites seen within this long count towards the mean pace
PACE_MAX_SCALE = 4.0  # a grant is at most this many times the requested phase
#: a grant that would leave at most this share of its size behind in the pooled run it cuts
#: takes that rest too: no lease of a few steps at an epoch's end, with a merge to wait for
CRUMB_SHARE = 0.25


class Leasing(Views):
    """Register, lease, heartbeat and release: the requests that keep blocks moving."""

    def register(
        self, site: str, digest: str, ranks: int, rtt_ms: float | None, round_no: int | None = None
    ) -> dict[str, Any]:
        """A site (re)joins: its block-space digest must match; it adopts the current state."""
        with self.lock:
            spec = self._check_site(site)
            assert self.space is not None
            if digest != self.space.digest():
                raise CoordinatorError(
                    409,
                    "digest_mismatch",
                    f"dataset digest {digest[:16]}... does not match the run's block space "
                    f"{self.space.digest()[:16]}... (N={spec.n_windows}, K={spec.block_size}, "
                    f"seed={spec.data_seed}); prepare the same data with the same settings",
                )
            if ranks < 1:
                raise CoordinatorError(422, "bad_ranks", f"ranks must be >= 1, got {ranks}")
            now = self.clock()
            with self._mutation():
                self._event("register", {"site": site, "now": now})
                store.upsert_site(self.conn, site, ranks, rtt_ms, now)
                if round_no is not None and round_no == self.current_round()["round_no"]:
                    # an announcement: this site means to lease in the open round
                    store.announce_site(self.conn, site, round_no, now)
            return {
                "site": site,
                "n_windows": spec.n_windows,
                "block_size": spec.block_size,
                "data_seed": spec.data_seed,
                "flavour": spec.flavour,
                "vocab_size": spec.vocab_size,
                **self.status(),
            }

    def lease(
        self, site: str, round_no: int, n_blocks: int, t_step_s: float | None, rtt_ms: float | None
    ) -> dict[str, Any]:
        """Grant a span of blocks for ``round_no`` (or steal one when the pool is dry).

        ``n_blocks`` is the site's inner phase; the grant is sized by its measured step or
        commit rate (``LeaseBook.grant_size``), so it may be larger or smaller: in a run of
        several sites, a site with neither rate yet gets a probe, ``leases.probe_share`` of it.

        ``round_no`` is the current round or, as an *early lease* (overlapped rounds), the
        next one: the round after the open one, or after the one being merged. An early
        lease only takes from the pool, never steals: with the epoch's pool dry it takes
        from the next epoch's (``LeaseBook.grant``'s ``ahead``), and only with both dry is
        the answer ``pool_empty`` (the site waits for its round to open). It does not mark a first
        lease on a round that does not exist yet (``_publish`` does when the round opens)
        and does not keep the open round from closing. Every reply carries ``early`` and
        the ``global_step`` the lease's round starts at (for an early lease a forecast
        while the round before is open, see ``next_global_step``).
        """
        with self.lock:
            spec = self._check_site(site)
            assert self.book is not None
            current = self.current_round()
            if self._closing is not None and round_no == self._closing:
                raise CoordinatorError(
                    409,
                    "round_closed",
                    f"round {round_no} is closing (its merge is running); round "
                    f"{round_no + 1} opens when it is done",
                )
            early = round_no == current["round_no"] + 1
            if round_no != current["round_no"] and not early:
                raise CoordinatorError(
                    409,
                    "round_closed" if round_no < current["round_no"] else "round_not_open",
                    f"round {round_no} is not open; the current round is {current['round_no']} "
                    f"(leases are for it or, early, for round {current['round_no'] + 1})",
                )
            if n_blocks < 1:
                raise CoordinatorError(422, "bad_size", f"n_blocks must be >= 1, got {n_blocks}")
            if store.has_delta(self.conn, round_no, site):
                raise CoordinatorError(
                    409,
                    "already_contributed",
                    f"site {site} already contributed to round {round_no}",
                )
            now = self.clock()
            ttl = self._ttl(site, t_step_s, rtt_ms)
            with lease_errors(409):
                size = self.book.grant_size(
                    site, n_blocks, now, live_s=PACE_LIVE_S, max_scale=PACE_MAX_SCALE,
                    step_rates=self._step_rates,
                    probe_share=spec.leases.probe_share if len(spec.sites) > 1 else 1.0,
                )  # fmt: skip
                if early:
                    size = self._to_round_end(
                        site, size, n_blocks, current["round_no"], now, spec.rounds.deadline_s
                    )
                size = self.book.uncut_size(size, math.floor(CRUMB_SHARE * size), early)
                ranks = store.site_ranks(self.conn, site) or 1
                with self._mutation():
                    args = {"site": site, "now": now, "ttl_s": ttl, "round_no": round_no}
                    grant = {**args, "n_blocks": size, "requested": n_blocks, "ranks": ranks}
                    if early:  # at an epoch's end, from the next epoch (LeaseBook: ahead)
                        grant["ahead"] = True
                    lease = self._event("grant", grant)
                    if lease is None and not early:  # an early lease never steals
                        ahead = self._trained_unheard(site, now)
                        lease = self._event("steal", {**args, "ranks": ranks, "ahead": ahead})
                    store.site_seen(self.conn, site, now, t_step_s=t_step_s, rtt_ms=rtt_ms)
                    if lease is not None:
                        self._phase_blocks[lease.lease_id] = n_blocks
                    if lease is not None and not early:
                        store.mark_first_lease(self.conn, round_no, now)
            reply = self._grant_reply(current, early)
            if lease is None:
                return {"lease": None, "reason": "pool_empty", **reply}
            return {"lease": self._lease_view(lease), **reply}

    def adopt(
        self, lease_id: int, site: str, consumed: int, t_step_s: float | None,
        rtt_ms: float | None,
    ) -> dict[str, Any]:  # fmt: skip
        """A restarted job of ``site`` takes over the live lease ``lease_id`` its dead
        predecessor held (``consumed``: the progress it saw in the status), to train it from
        its first block, instead of waiting for the lease's TTL and leasing anew. The reply
        is a grant's (``LeaseBook.adopt``)."""
        with self.lock:
            self._check_site(site)
            assert self.book is not None
            current = self.current_round()
            with lease_errors(404):
                held = self.book.lease(lease_id)
            if held.round_no < current["round_no"]:
                raise CoordinatorError(
                    409, "round_closed",
                    f"lease {lease_id} is of round {held.round_no}; the current round is "
                    f"{current['round_no']}",
                )  # fmt: skip
            now = self.clock()
            ttl = self._ttl(site, t_step_s, rtt_ms)
            with lease_errors(409), self._mutation():
                args = {"lease_id": lease_id, "site": site, "consumed": consumed}
                lease = self._event("adopt", {**args, "now": now, "ttl_s": ttl})
                store.site_seen(self.conn, site, now, t_step_s=t_step_s, rtt_ms=rtt_ms)
            log.info("%s took over its lease %d of round %d (%d blocks) after a restart",
                     site, lease_id, lease.round_no, lease.end - lease.start)  # fmt: skip
            reply = self._grant_reply(current, lease.round_no == current["round_no"] + 1)
            return {"lease": self._lease_view(lease), **reply}

    def _grant_reply(self, current: dict[str, Any], early: bool) -> dict[str, Any]:
        """What a grant's reply carries beside the lease: the generation, whether it is an
        early lease, and the global step its round starts at (forecast for an early one)."""
        step = current["global_step"]
        if early:
            deltas = store.round_deltas(self.conn, current["round_no"])
            inner_steps = self._require_run().round_steps(current["round_no"])
            step = next_global_step(step, [d["steps"] for d in deltas], inner_steps)
        return {"generation": current["generation"], "early": early, "global_step": step}

    def heartbeat(
        self,
        lease_id: int,
        site: str,
        consumed: int,
        t_step_s: float | None,
        echo: int | None = None,
        echo_held_s: float | None = None,
    ) -> dict[str, Any]:
        """Refresh a lease's TTL and record progress; the reply shows any steal.

        The reply's ``echo`` nonce comes back with the next heartbeat (with ``echo_held_s``,
        how long the site held it) so the coordinator measures the RTT itself. A heartbeat
        is committed without fsync (``_mutation(fsync=False)``): it survives a SIGKILL, and
        a restart renews every active lease anyway (the ``grace`` event).
        """
        with self.lock:
            self._check_site(site)
            self._measure_rtt(site, echo, echo_held_s)
            now = self.clock()
            ttl = self._ttl(site, t_step_s, store.site_rtt_ms(self.conn, site))
            renewed_at = self._renewed_at(lease_id)
            with lease_errors(409), self._mutation(fsync=False):
                lease = self._event_or_revive(
                    "heartbeat",
                    {
                        "lease_id": lease_id,
                        "site": site,
                        "consumed": consumed,
                        "now": now,
                        "ttl_s": ttl,
                    },
                )
                store.site_seen(self.conn, site, now, t_step_s=t_step_s)
                self._note_step_rate(site, lease_id, t_step_s)
                if renewed_at is not None:
                    self._beat_gaps[lease_id] = now - renewed_at
            return {
                "lease": self._lease_view(lease),
                "round": self.current_round()["round_no"],
                "echo": self._echo(site),
                "rtt_ms": self._rtt_ms.get(site),
            }

    def release(self, lease_id: int, site: str) -> dict[str, Any]:
        with self.lock:
            self._check_site(site)
            with lease_errors(409), self._mutation():
                returned = self._event(
                    "release", {"lease_id": lease_id, "site": site, "now": self.clock()}
                )
            return {"lease_id": lease_id, "returned": returned}

    def _ttl(self, site: str, t_step_s: float | None, rtt_ms: float | None) -> float:
        """TTL = max(min_ttl_s, alpha * t_step + beta_rtt * RTT); initial_ttl_s before the
        site has reported a step time. RTT is the larger of the site's own figure and the
        one this coordinator measured (``_measure_rtt``)."""
        policy = self._require_run().leases
        if not t_step_s:
            return policy.initial_ttl_s
        rtt = max(rtt_ms or 0.0, self._rtt_ms.get(site, 0.0))
        ttl = lease_ttl(t_step_s, rtt / 1000.0, policy.alpha, policy.beta_rtt)
        return max(policy.min_ttl_s, ttl)

    def _echo(self, site: str) -> int:
        """A nonce for the reply; the site returns it with its next heartbeat. A site's last
        ``ECHOES_PER_SITE`` nonces stay good, so heartbeats of its two leases (overlapped
        rounds) do not spoil each other's measurement; each is good for one sample."""
        nonce = secrets.randbits(52)
        sent = self._echoes.setdefault(site, {})
        sent[nonce] = self.monotonic()
        while len(sent) > ECHOES_PER_SITE:
            del sent[next(iter(sent))]  # the oldest
        return nonce

    def _measure_rtt(self, site: str, echo: int | None, held_s: float | None) -> None:
        """RTT as the coordinator sees it, NTP-style: the time from our reply carrying
        ``echo`` to the request returning it, minus the ``held_s`` the site kept it
        (between receiving that reply and sending this request). It covers the network both
        ways plus this server's own queueing, which is what a heartbeat must get through
        within a TTL. Smoothed like TCP's SRTT (weight 1/4 on the new sample)."""
        sent_at = self._echoes.get(site, {}).pop(echo, None) if echo is not None else None
        if sent_at is None or held_s is None:
            return
        sample = (self.monotonic() - sent_at - held_s) * 1000.0
        sample = min(max(sample, 0.0), MAX_RTT_MS)
        old = self._rtt_ms.get(site)
        self._rtt_ms[site] = sample if old is None else 0.75 * old + 0.25 * sample

    def _renewed_at(self, lease_id: int) -> float | None:
        """When ``lease_id`` was last granted, renewed or taken over (None if unknown)."""
        assert self.book is not None
        try:
            return self.book.lease(lease_id).renewed_at
        except LeaseError:
            return None

    def _trained_unheard(self, thief: str, now: float) -> dict[str, int]:
        """Per live lease of another site (by id, as the ledger keeps it): the blocks its
        holder has likely trained beyond the progress it last reported, which a steal must
        leave it. A holder hears of a steal only at its next heartbeat and trains on until
        then: its pace (step rate, else commit rate) times the longer of the time since its
        last heartbeat and its heartbeat period, in whole blocks (the block in progress the
        victim keeps anyway). Leases whose holder's pace is unknown get none."""
        assert self.book is not None
        live = self.book.active_leases()
        for gone in set(self._beat_gaps) - {lease.lease_id for lease in live}:
            del self._beat_gaps[gone]
        ahead: dict[str, int] = {}
        for lease in live:
            if lease.site == thief:
                continue
            rate = self._pace(lease.site)
            if not rate:
                continue
            gap = self._beat_gaps.get(lease.lease_id, 0.0)
            unheard_s = max(now - lease.renewed_at, gap)
            blocks = min(math.floor(rate * unheard_s), lease.n_blocks - lease.consumed)
            if blocks > 0:
                ahead[str(lease.lease_id)] = blocks
        return ahead

    def _pace(self, site: str) -> float | None:
        """``site``'s blocks per second: its step rate, else its commit rate (None: unknown)."""
        assert self.book is not None
        return self._step_rates.get(site) or self.book.commit_rate(site)

    def _to_round_end(
        self, site: str, size: int, requested: int, open_round: int, now: float, deadline_s: float
    ) -> int:
        """An early lease's size, ``size`` paced, grown to end with its round
        (``round_end_grant``): the round it belongs to starts only when the open one closes,
        so it also covers the seconds the open round's other live leases likely still need
        (each holder's untrained blocks at its pace, less what it likely trained since its
        last heartbeat). Paced alone, a site that started its phases ahead of the others
        (after a restart, or a short lease at an epoch's end) stayed ahead round after round
        and waited for every merge."""
        assert self.book is not None
        rate = self._pace(site)
        if not rate:
            return size
        left_s = 0.0
        for lease in self.book.active_leases():
            pace = self._pace(lease.site)
            if lease.site != site and lease.round_no == open_round and pace:
                untrained = lease.n_blocks - lease.consumed - pace * (now - lease.renewed_at)
                left_s = max(left_s, untrained / pace)
        hi = max(1, math.floor(PACE_MAX_SCALE * requested))
        return round_end_grant(size, rate, left_s, deadline_s, hi)

    def _note_step_rate(self, site: str, lease_id: int, t_step_s: float | None) -> None:
        """The site's compute rate from a heartbeat's mean step time: the lease's phase (the
        blocks it asked for, its round's H steps' worth) over those H steps. Grants are sized by it
        (``LeaseBook.grant_size``): unlike a commit rate it leaves out uploads, merges and
        waits, and it is known from a site's first steps on."""
        blocks = self._phase_blocks.get(lease_id)
        if not t_step_s or not blocks or self.spec is None or self.book is None:
            return
        steps = self.spec.round_steps(self.book.lease(lease_id).round_no)
        self._step_rates[site] = blocks / (steps * t_step_s)
