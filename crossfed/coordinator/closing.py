"""The coordinator's closing: generations written, rounds closed, merged and published.

A run starts at generation 0 (:meth:`Closing.init_run`); each round's close (:meth:`Closing.tick`)
merges its deltas into the next generation's files outside the lock, then commits it and
opens the next round, then prunes what retention no longer keeps.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from crossfed import moments, rowcounts
from crossfed.coordinator import store
from crossfed.coordinator.blobs import BlobError
from crossfed.coordinator.core import CoordinatorError, log
from crossfed.coordinator.faults import crash_point
from crossfed.coordinator.merger import Written, shape_pairs
from crossfed.coordinator.rounds import close_decision, next_global_step
from crossfed.coordinator.runspec import EXTENSIBLE, RunSpec, describe, differences, resolve_unset
from crossfed.coordinator.views import Views

BLOB_GRACE_S = 3600.0  # an uploaded blob no delta refers to is deleted after this long


class Closing(Views):
    """The run's generations: the first at ``init_run``, each next one at a round's close."""

    def init_run(self, spec: RunSpec) -> dict[str, Any]:
        """Create the run (generation 0 from the model seed); the same spec again is a no-op."""
        with self.lock:
            existing = store.get_meta(self.conn, "spec")
            if existing is not None:
                current = RunSpec.from_dict(existing)
                return self._resume_run(current, resolve_unset(spec, current))
            spec = resolve_unset(spec, None)
            written = self.merger.initial(
                spec.flavour, spec.vocab_size, spec.model_seed, self._model_object(0)
            )
            self.shapes, digest = written.shapes, written.digest
            self._published(0)
            now = self.clock()
            with store.Transaction(self.conn):
                store.set_meta(self.conn, "global_digest:0", digest)
                store.set_meta(self.conn, "global_bytes:0", written.model_bytes)
                store.set_meta(self.conn, "shapes", shape_pairs(self.shapes))
                store.set_meta(self.conn, "spec", spec.to_dict())
                store.set_meta(self.conn, "generation", 0)
                store.set_meta(self.conn, "global_step", 0)
                store.open_round(self.conn, 1, 0, now, 0)
            self._load(spec)
            return {"created": True, **self.status()}

    def _resume_run(self, current: RunSpec, spec: RunSpec) -> dict[str, Any]:
        """The same run again, or the same run with more rounds (a longer LR schedule).

        Only ``schedule.total_steps`` may change, and only upwards: the rounds already
        trained keep the learning rates they had; later rounds follow the longer schedule.
        Any other difference would change what the finished rounds mean, so it is refused.
        """
        changes = differences(current, spec)
        if not changes:
            return {"created": False, "extended": False, **self.status()}
        refused = {k: v for k, v in changes.items() if k not in EXTENSIBLE}
        if refused:
            raise CoordinatorError(
                409,
                "run_exists",
                f"this coordinator serves a run that differs from this config in "
                f"{describe(refused)}; a run in progress keeps its data, model, sites and "
                f"settings: use the run's config, or start a new run in a new state dir",
            )
        old_total, new_total = changes["schedule.total_steps"]
        if new_total < old_total:
            raise CoordinatorError(
                409,
                "run_exists",
                f"the run's schedule is {old_total} inner steps long; a run can be extended "
                f"(more rounds), not shortened to {new_total}",
            )
        with store.Transaction(self.conn):
            store.set_meta(self.conn, "spec", spec.to_dict())
        self.spec = spec
        log.info("run extended: schedule %d -> %d inner steps", old_total, new_total)
        assert self.book is not None
        if not self.book.active_leases():  # the run had ended: its next round waited unworked
            self._hold_round_clock(store.last_activity(self.conn))
        return {"created": False, "extended": True, **self.status()}

    def tick(self) -> dict[str, Any] | None:
        """Expire leases and close the round if the policy says so; returns a merge report."""
        with self.lock:
            if self.spec is None:
                return None
            assert self.book is not None
            now = self.clock()
            next_expiry = self.book.next_expiry()
            if next_expiry is not None and next_expiry <= now:
                with self._mutation():
                    expired = self._event("expire", {"now": now})
                for lease in expired:
                    log.warning(
                        "lease %d of %s expired: %d blocks back to the pool",
                        lease.lease_id,
                        lease.site,
                        lease.end - lease.start,
                    )
            current = self.current_round()
            if self._closing is not None:
                return None  # a merge in another thread is closing this round
            deltas = store.round_deltas(self.conn, current["round_no"])
            active = self.book.active_sites(current["round_no"])
            since = now - self.spec.rounds.join_window_s
            announced = store.announced_sites(self.conn, current["round_no"], since)
            announced -= len(set(active))
            paused = store.round_pause_s(self.conn, current["round_no"])
            reason = close_decision(
                # the deadline counts only time in which the round could be worked on
                opened_at=current["opened_at"] + paused,
                first_lease_at=current["first_lease_at"],
                now=now,
                deltas=len(deltas),
                active_leases=len(active),
                announced=max(0, announced),
                policy=self.spec.rounds,
                sites_left=len(set(self.spec.sites) - {d["site"] for d in deltas}),
            )
            if reason is None:
                return None
            self._closing = current["round_no"]
            if self.merge_holds_lock:  # the old way, for the benchmark's "before" only
                try:
                    return self._close_round(current, deltas, reason)
                finally:
                    self._closing = None
        try:
            return self._close_round(current, deltas, reason)
        finally:
            with self.lock:
                self._closing = None

    def _close_round(self, current: dict, deltas: list[dict], reason: str) -> dict[str, Any]:
        """Apply Eq. 1 to the round's deltas, persist generation g+1 and open the next round.

        Runs without the lock (``_closing`` names the round meanwhile, so no delta joins
        it and no second merge starts) until the commit. The merge reads generation g's
        files and writes g+1's; nothing in memory changes before the commit, so a merge
        that fails (a full disk, a bad delta, SQLite) leaves the run as it was and the next
        attempt steps from generation g again.
        """
        assert self.spec is not None
        started = self.monotonic()
        generation = current["generation"] + 1
        written = self.merger.merge(
            current["generation"],
            self.shapes,
            self._delta_sources(deltas),
            [d["tokens"] for d in deltas],
            self.spec.outer,
            shared_moments=self.spec.second_moment == moments.SHARED,
            sites=[d["site"] for d in deltas],
            model_object=self._model_object(generation),
            row_counts=self.spec.embedding_rows == rowcounts.COUNTS,
        )
        self._published(generation)
        merge_s = self.monotonic() - started - written.checkpoint_s
        with self.lock:
            return self._publish(current, deltas, reason, written, merge_s)

    def _model_object(self, generation: int) -> str | None:
        """The object a generation's global model goes up to (None: the file store)."""
        return None if self.s3 is None else self.s3.model_name(generation)

    def _published(self, generation: int) -> None:
        if self.s3 is not None:
            self.s3.published(generation)

    def _delta_sources(self, deltas: list[dict[str, Any]]) -> list[Path | str]:
        """Where the merge reads the accepted deltas: their files, or their objects by name."""
        if self.s3 is None:
            return [self.blobs.path(delta["blob"]) for delta in deltas]
        names: list[Path | str] = []
        for delta in deltas:
            owner = self.s3.owner_for(delta["blob"], delta["site"])
            if owner is None:
                raise CoordinatorError(
                    500, "missing_object", f"accepted delta {delta['blob']} has no stored object"
                )
            names.append(self.s3.blob_name(delta["blob"], owner))
        return names

    def _publish(
        self,
        current: dict,
        deltas: list[dict],
        reason: str,
        written: Written,
        merge_s: float,
    ) -> dict[str, Any]:
        """Commit generation g+1 (its files are in place) and open the next round."""
        generation = current["generation"] + 1
        report, digest, checkpoint_s = written.report, written.digest, written.checkpoint_s
        assert report is not None
        assert self.spec is not None and self.book is not None
        steps = [d["steps"] for d in deltas]
        global_step = next_global_step(
            current["global_step"], steps, self.spec.round_steps(current["round_no"])
        )
        following = current["round_no"] + 1
        now = self.clock()
        summary = {
            "round": current["round_no"],
            "generation": generation,
            "reason": reason,
            "contributors": [d["site"] for d in deltas],
            "tokens": sum(d["tokens"] for d in deltas),
            "shares": report.shares,
            "eta": report.eta_used,
            "global_step": global_step,
            "merge_s": merge_s,
            "checkpoint_s": checkpoint_s,
            "loss": _weighted_loss(deltas),
        }
        with store.Transaction(self.conn):
            store.close_round(self.conn, current["round_no"], now, reason, summary)
            store.set_meta(self.conn, f"global_digest:{generation}", digest)
            store.set_meta(self.conn, f"global_bytes:{generation}", written.model_bytes)
            store.set_meta(self.conn, "generation", generation)
            store.set_meta(self.conn, "global_step", global_step)
            store.open_round(self.conn, following, generation, now, global_step)
            if self.book.active_sites(following):  # early leases: as if taken at the opening
                store.mark_first_lease(self.conn, following, now)
        self.generation, self.open_round_no = generation, following
        crash_point("after_close_commit")
        self._retain(generation, current["round_no"])
        log.info(
            "round %d closed (%s): %d contributors, %d tokens, generation %d, merge %.2fs",
            current["round_no"],
            reason,
            len(deltas),
            summary["tokens"],
            generation,
            merge_s,
        )
        return summary

    def _retain(self, generation: int, closed_round: int) -> None:
        """Retention once generation ``generation`` is committed: keep the last
        ``keep_generations`` generations' masters and ``keep_models`` generations' global
        models, delete the merged rounds' delta blobs (kept with ``keep_deltas``, as is
        generation 0's master), and blobs or partial uploads no delta refers to after
        ``BLOB_GRACE_S``."""
        oldest = {
            "master": generation - max(1, self.keep_generations) + 1,
            "global": generation - self.keep_models + 1 if self.keep_models > 0 else 0,
        }
        if self.keep_models > 0:
            oldest["global"] = min(oldest["global"], oldest["master"])
        try:
            self.merger.retain(oldest["master"], oldest["global"], self.keep_deltas)
        except BlobError as exc:  # the generation is committed: retention waits a round
            log.warning("retention of the generations' files skipped this round: %s", exc)
        merged, pending = store.delta_blobs(self.conn, closed_round)
        if self.keep_deltas:
            merged, pending = [], [*merged, *pending]
        if self.s3 is not None:
            try:
                deleted = self.s3.prune(merged, pending, oldest["global"], BLOB_GRACE_S)
            except BlobError as exc:  # the generation is committed: retention waits a round
                log.warning("object store retention skipped this round: %s", exc)
                deleted = []
        else:
            deleted = self.blobs.prune(drop=merged, keep=pending, grace_s=BLOB_GRACE_S)
        if deleted:
            with store.Transaction(self.conn):
                store.forget_blob_holders(self.conn, deleted)


def _weighted_loss(deltas: list[dict]) -> float | None:
    pairs = [(d["loss"], d["tokens"]) for d in deltas if d["loss"] is not None]
    if not pairs:
        return None
    total = sum(t for _, t in pairs)
    value = sum(loss * t for loss, t in pairs) / total
    return value if math.isfinite(value) else None
