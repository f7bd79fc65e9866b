"""The coordinator's intake: a delta's claim vetted, its blob checked, its blocks committed.

A claim (:class:`~crossfed.coordinator.claims.DeltaClaim`) is vetted against its lease
before any byte of an inline body is kept; the blob's tensors are checked outside the lock;
the commit of its blocks and its deltas row is one transaction. Also here: which site may
see or submit which blob.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from crossfed.coordinator import store
from crossfed.coordinator.blobs import BlobError, check_key
from crossfed.coordinator.claims import DeltaClaim
from crossfed.coordinator.core import CoordinatorError, Core, lease_errors
from crossfed.darl.blockspace import BlockSpace
from crossfed.darl.leases import Lease, LeaseError
from crossfed.darl.ledger import LedgerError
from crossfed.outer import DeltaError, validate_delta
from crossfed.wire.codecs import decoded, open_delta
from crossfed.wire.tensors import TensorFile


class Intake(Core):
    """Deltas in: vetting, blob checks and the commit; the blobs' holders."""

    def submit(
        self, claim: DeltaClaim | None = None, /, *, by: str | None = None, **fields: Any
    ) -> dict[str, Any]:
        """Accept a delta and commit its blocks in ONE transaction; idempotent per lease.

        ``claim`` is the delta, or ``fields`` are (a :class:`DeltaClaim`'s, as keywords).
        Its ``idle_s`` is how long the site held the lease waiting for the previous round's
        merge (an overlapped round's early lease): left out of its pace (DARL's grant sizing).

        ``by`` is the site whose token sent it (None: the admin): a site may submit only a
        blob it uploaded itself; anyone else's is, to it, a blob that does not exist.
        Steps: the numbers, the blob's tensors (outside the lock), the lease and the claim
        (:meth:`_vet`), the blob's verdict, then the commit (:meth:`_record`).
        """
        claim = _claim_of(claim, fields)
        for name in ("loss", "compute_s", "idle_s"):
            value = getattr(claim, name)
            if value is not None and not math.isfinite(value):
                raise CoordinatorError(422, "bad_number", f"{name} must be finite, got {value}")
        blob = claim.blob
        checked, rejected = self._check_blob_unlocked(blob, by)
        with self.lock:
            vetted = self._vet(claim)
            if isinstance(vetted, dict):
                return vetted  # the same delta again
            if not self._blob_stored(blob, by) or not self._may_use_blob(by, blob):
                raise CoordinatorError(404, "unknown_blob", f"no blob {blob}; upload it first")
            if not checked:  # it arrived while we were looking
                self._validate_stored(blob, by)
            if rejected is not None:
                raise rejected
            result = self._record(vetted, claim)
            return {
                "accepted": True,
                "already": False,
                "round": claim.round_no,
                "committed": result.committed,
                "returned": result.returned,
            }

    def vet_delta(self, claim: DeltaClaim | None = None, /, **fields: Any) -> None:
        """Every check of :meth:`submit` that needs not the blob's bytes, made before an
        inline body is stored: a delta refused here is refused before its first byte is kept."""
        claim = _claim_of(claim, fields)
        with self.lock:
            self._vet(claim)

    def _vet(self, claim: DeltaClaim) -> Lease | dict[str, Any]:
        """The lease behind a delta, checked (owner, round, generation, progress, claim), or
        the answer to a resend of an accepted delta. Refusals change nothing, except that a
        stale delta's lease is released (its blocks return to the pool). A delta for a round
        other than its lease's (``wrong_round``) or for a round not open yet, an early
        lease's (``round_not_open``), leaves the lease as it was. Holds the lock."""
        site, lease_id, round_no = claim.site, claim.lease_id, claim.round_no
        generation = claim.generation
        self._check_site(site)
        assert self.book is not None
        previous = store.delta_of_lease(self.conn, lease_id)
        if previous is not None:
            # a resend after a crash repeats the checkpointed request exactly; anything
            # else on a used lease is a forged or altered replay and changes nothing
            if not claim.repeats(previous):
                raise CoordinatorError(
                    409, "lease_used", f"lease {lease_id} already carried a different delta"
                )
            return {"accepted": True, "already": True, "round": previous["round_no"]}
        with lease_errors(404):
            lease = self.book.lease(lease_id)
        if lease.site != site:
            raise CoordinatorError(403, "not_owner", f"lease {lease_id} belongs to another site")
        if lease.round_no != round_no:  # e.g. an early lease's delta sent for the open round
            raise CoordinatorError(
                409,
                "wrong_round",
                f"lease {lease_id} is a lease of round {lease.round_no}, not of round "
                f"{round_no}: refused, the lease is left as it was",
            )
        current = self.current_round()
        if round_no > current["round_no"]:  # an early lease's round, not open yet
            state = "open" if self._closing is None else "closing"
            raise CoordinatorError(
                409,
                "round_not_open",
                f"delta for round {round_no}, which has not opened yet (round "
                f"{current['round_no']} is {state}): refused; lease {lease_id} stays yours, "
                f"submit again once round {round_no} opens",
            )
        if self._closing is not None and round_no == self._closing:
            self._release_quietly(lease_id, site)
            raise CoordinatorError(
                409,
                "stale_generation",
                f"delta for round {round_no}, which is closing (its merge is running; round "
                f"{round_no + 1} follows at generation {current['generation'] + 1}): "
                "rejected, its blocks return to the pool",
            )
        if generation != current["generation"] or round_no != current["round_no"]:
            self._release_quietly(lease_id, site)
            raise CoordinatorError(
                409,
                "stale_generation",
                f"delta trained from generation {generation} for round {round_no}; the current "
                f"round is {current['round_no']} at generation {current['generation']}: "
                "rejected, its blocks return to the pool",
            )
        if claim.tokens < 1 or claim.steps < 1:
            raise CoordinatorError(422, "bad_counts", "tokens and steps must be >= 1")
        if not 1 <= claim.consumed <= lease.end - lease.start:
            raise CoordinatorError(
                422,
                "bad_progress",
                f"consumed={claim.consumed} outside 1..{lease.end - lease.start} "
                f"for lease {lease_id}",
            )
        self._check_claim(lease, claim)
        return lease

    def _check_claim(self, lease: Lease, claim: DeltaClaim) -> None:
        """Tokens and steps no larger than the committed blocks hold: a site trains each
        window once (``seq_len`` tokens of it are predicted) and every inner step trains at
        least one window on each of the ranks the site leased with. The token count is a
        delta's weight in the average and the step count moves the global step, so an
        inflated claim is refused, never capped."""
        spec = self._require_run()
        assert self.space is not None
        tokens, steps, consumed = claim.tokens, claim.steps, claim.consumed
        windows = claim_windows(self.space, lease, consumed)
        limit = windows * spec.seq_len
        if tokens > limit:
            raise CoordinatorError(
                422,
                "implausible_claim",
                f"tokens={tokens} exceed what the {consumed} committed blocks of lease "
                f"{lease.lease_id} hold: {windows} windows x seq_len {spec.seq_len} = "
                f"{limit} tokens",
            )
        most = -(-windows // lease.ranks)
        if steps > most:
            raise CoordinatorError(
                422,
                "implausible_claim",
                f"steps={steps} exceed what the {windows} windows of the {consumed} committed "
                f"blocks of lease {lease.lease_id} can train on its {lease.ranks} rank(s): "
                f"{most} (every inner step trains at least one window per rank)",
            )

    def _release_quietly(self, lease_id: int, site: str) -> None:
        try:
            with self._mutation():
                self._event("release", {"lease_id": lease_id, "site": site, "now": self.clock()})
        except LeaseError:
            pass

    def _check_blob_unlocked(
        self, blob: str, by: str | None = None
    ) -> tuple[bool, CoordinatorError | None]:
        """Whether the delta check ran, and its refusal if it refused.

        The check reads every tensor: it runs before the lock is taken, so heartbeats and
        grants are not held up; it needs only the master's names and shapes, which never
        change. :meth:`submit` gives its verdict where the lease checks would have reached
        it (a blob not yet stored is checked under the lock instead).
        """
        if not (self._require_run() and self._blob_stored(blob, by)):  # immutable by key
            return False, None
        try:
            self._validate_stored(blob, by)
        except CoordinatorError as exc:
            return True, exc
        return True, None

    def _record(self, lease: Lease, claim: DeltaClaim) -> Any:
        """Commit the lease's first ``consumed`` blocks and record the claim's deltas row in
        one transaction; the next epoch starts when this one is done. Holds the lock;
        returns the lease book's commit result."""
        assert self.book is not None and self.space is not None
        now = self.clock()
        site, lease_id, consumed = claim.site, claim.lease_id, claim.consumed
        idle_s = claim.idle_s or 0.0
        self._phase_blocks.pop(lease_id, None)  # committed: no more heartbeats to rate
        try:
            with lease_errors(409), self._mutation():
                args = {"lease_id": lease_id, "site": site, "consumed": consumed, "now": now}
                result = self._event_or_revive(
                    "commit", {**args, "idle_s": idle_s} if idle_s else args
                )
                blocks = self.space.permutation(lease.epoch)[lease.start : lease.start + consumed]
                self.ledger.record_commit_blocks(lease.epoch, site, lease_id, blocks.tolist())
                store.add_delta(self.conn, **claim.row(), accepted_at=now)
                while self.book.epoch_complete():  # the next, leased ahead, may be done too
                    self._event("next_epoch", {"now": now})
        except LedgerError as exc:
            raise CoordinatorError(409, "duplicate_commit", str(exc)) from exc
        return result

    def _blob_stored(self, blob: str, by: str | None) -> bool:
        """Whether blob ``blob`` is complete: in the file store, or (object store) as an
        object of ``by``'s own (the admin, None: of anyone's) that hashed to its key."""
        if self.s3 is None:
            return self.blobs.exists(blob)
        return self._object_owner(blob, by) is not None

    def _object_owner(self, blob: str, by: str | None) -> str | None:
        """Whose stored object a delta sent by ``by`` refers to (None: none stored)."""
        assert self.s3 is not None
        stored = self.s3.stored(blob)
        if by is not None:
            return by if by in stored else None
        return next(iter(sorted(stored)), None)

    def _validate_stored(self, blob: str, by: str | None) -> None:
        """:meth:`_validate_delta_blob`, on the object store's object when there is one (not
        read again when it passed the check as it was hashed)."""
        if self.s3 is None:
            self._validate_delta_blob(blob)
            return
        owner = self._object_owner(blob, by)
        assert owner is not None
        if self.s3.checked(blob, owner):
            return
        self._validate_delta_tensors(lambda: self.s3.open(blob, owner))  # type: ignore[union-attr]

    def _validate_delta_tensors(self, open_file: Callable[[], TensorFile]) -> None:
        """:meth:`_validate_delta_blob` over a tensor file read in ranges (an object)."""
        try:
            with open_file() as handle:
                validate_delta(self._references(), decoded(handle))
        except DeltaError as exc:
            raise CoordinatorError(422, "bad_delta", f"delta rejected: {exc}") from exc
        except BlobError:
            raise
        except Exception as exc:  # a header that does not parse, a tensor cut short
            raise CoordinatorError(
                422, "bad_delta", f"delta blob is not a readable safetensors file: {exc}"
            ) from exc

    def _validate_delta_blob(self, blob: str) -> None:
        """Decode (any codec) and check a delta against the master before accepting it."""
        path = self.blobs.path(blob)
        try:
            with open_delta(path) as delta:
                validate_delta(self._references(), delta)
        except DeltaError as exc:
            raise CoordinatorError(422, "bad_delta", f"delta rejected: {exc}") from exc
        except Exception as exc:  # safetensors raises its own errors for bad headers
            raise CoordinatorError(
                422, "bad_delta", f"delta blob is not a readable safetensors file: {exc}"
            ) from exc

    def delta_site(self, key: str) -> str | None:
        """The site whose accepted delta is blob ``key`` (canonical ``algo:hex``), if any."""
        forms = [key, key.removeprefix("sha256:")]  # SHA-256 keys may be stored bare
        with self.lock:
            return store.delta_owner(self.conn, forms)

    def blob_holders(self, key: str) -> set[str]:
        """Sites that may see blob ``key``: those that uploaded it and the one whose accepted
        delta it is. Empty for a blob no site holds (never uploaded over the API)."""
        key = check_key(key)
        with self.lock:
            holders = store.blob_holders(self.conn, key)
        owner = self.delta_site(key)
        return holders | {owner} if owner is not None else holders

    def hold_blob(self, key: str, site: str) -> None:
        """Record ``site`` as an uploader of blob ``key`` (before its first byte is kept, so a
        restarted coordinator still lets it resume)."""
        key = check_key(key)
        with self.lock, store.Transaction(self.conn):
            store.add_blob_holder(self.conn, key, site)

    def drop_parts(self, parts: list[str], site: str, keep: str) -> list[str]:
        """Delete the parts of a joined upload that only ``site`` holds and no delta refers
        to (not ``keep``, the joined blob); returns the keys deleted."""
        deleted = []
        for part in dict.fromkeys(check_key(p) for p in parts):
            if part == keep or self.blob_holders(part) != {site} or self.delta_site(part):
                continue
            with self.lock, store.Transaction(self.conn):
                self.blobs.delete(part)
                store.forget_blob_holders(self.conn, [part])
            deleted.append(part)
        return deleted

    def _may_use_blob(self, site: str | None, key: str) -> bool:
        """Whether ``site`` (None: the admin) may see or submit blob ``key``."""
        if site is None:
            return True
        holders = self.blob_holders(key)
        return not holders or site in holders


def claim_windows(space: BlockSpace, lease: Lease, consumed: int) -> int:
    """Windows in the first ``consumed`` blocks of ``lease`` (the last block may be short)."""
    blocks = space.permutation(lease.epoch)[lease.start : lease.start + consumed]
    last = space.n_blocks - 1
    short = space.block_size - len(space.block_windows(last))
    return consumed * space.block_size - (short if bool((blocks == last).any()) else 0)


def _claim_of(claim: DeltaClaim | None, fields: dict[str, Any]) -> DeltaClaim:
    """``claim``, or the claim that a caller's keywords spell out."""
    if claim is None:
        return DeltaClaim(**fields)
    if fields:
        raise TypeError(f"a claim and its fields both given: {sorted(fields)}")
    return claim
