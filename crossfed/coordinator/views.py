"""The coordinator's views: the run's status, its rounds, sites and ledger (Table 3).

Reads only. ``read_status`` and ``read_ledger`` answer the same from a state directory
without a server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crossfed.coordinator import store
from crossfed.coordinator.core import CoordinatorError, Core
from crossfed.coordinator.runspec import RunSpec
from crossfed.darl.blockspace import BlockSpace
from crossfed.darl.leases import Lease, LeaseBook
from crossfed.darl.ledger import LedgerStore


class Views(Core):
    """What the run looks like: status, rounds, sites and the ledger."""

    def status(self) -> dict[str, Any]:
        with self.lock:
            spec = self._require_run()
            assert self.book is not None and self.space is not None
            current = self.current_round()
            stored = spec.to_dict()  # the run as stored: every unset setting decided
            return {
                "round": current["round_no"],
                "generation": current["generation"],
                "global_step": store.get_meta(self.conn, "global_step", 0),
                "epoch": self.book.epoch,
                "blocks_total": self.space.n_blocks,
                "blocks_committed_in_epoch": self.book.committed_in_epoch,
                "blocks_committed_total": self.book.committed_total,
                "digest": self.space.digest(),
                "model": self._model_view(current["generation"]),
                "inner_steps": spec.round_steps(current["round_no"]),
                "inner_schedule": spec.inner_schedule(),
                "schedule": stored["schedule"],
                "outer": stored["outer"],
                "spec": stored,
                "active_leases": [self._lease_view(lease) for lease in self.book.active_leases()],
            }

    def _model_view(self, generation: int) -> dict[str, Any] | None:
        """The global model of ``generation``: its size and digest (a download needs to ask
        no more), or None when either is not at hand."""
        digest = store.get_meta(self.conn, f"global_digest:{generation}")
        if digest is None:
            return None
        size = self.model_bytes(generation)
        return None if size is None else {"generation": generation, "bytes": size, "digest": digest}

    def _lease_view(self, lease: Lease) -> dict[str, Any]:
        assert self.space is not None
        blocks = self.space.permutation(lease.epoch)[lease.start : lease.end].tolist()
        return {
            "lease_id": lease.lease_id,
            "site": lease.site,
            "round": lease.round_no,
            "epoch": lease.epoch,
            "blocks": blocks,
            "n_blocks": lease.end - lease.start,
            "consumed": lease.consumed,
            "ttl_s": lease.ttl_s,
            "expires_at": lease.expires_at,
            "status": lease.status,
        }

    def round_info(self, round_no: int) -> dict[str, Any]:
        with self.lock:
            self._require_run()
            row = store.round_row(self.conn, round_no)
            if row is None:
                current = self.current_round()["round_no"]
                raise CoordinatorError(
                    404, "unknown_round", f"round {round_no} does not exist (current: {current})"
                )
            row["deltas"] = [
                {k: d[k] for k in ("site", "tokens", "steps", "consumed", "loss", "compute_s")}
                for d in store.round_deltas(self.conn, round_no)
            ]
            return row

    def round_history(self) -> list[dict[str, Any]]:
        """Closed rounds in order: the merge report's figures and each contributor's loss."""
        with self.lock:
            self._require_run()
            losses = store.delta_losses(self.conn)
            history = []
            for round_no, report in store.closed_reports(self.conn):
                history.append(
                    {
                        "round": round_no,
                        "generation": report.get("generation"),
                        "reason": report.get("reason"),
                        "contributors": report.get("contributors", []),
                        "tokens": report.get("tokens"),
                        "global_step": report.get("global_step"),
                        "loss": report.get("loss"),
                        "merge_s": report.get("merge_s"),
                        "site_loss": losses.get(round_no, {}),
                    }
                )
            return history

    def sites_view(self) -> list[dict[str, Any]]:
        """Registered sites: ranks, RTT, last step time and when they were last heard from."""
        with self.lock:
            return store.sites(self.conn)

    def ledger_table(self) -> list[dict[str, Any]]:
        with self.lock:
            self._require_run()
            assert self.book is not None
            return _ledger_records(self.conn, self.ledger, self.book)


def _ledger_records(conn: Any, ledger: LedgerStore, book: LeaseBook) -> list[dict[str, Any]]:
    """Table 3 as JSON records, with ranks and RTT from the sites table."""
    rows = store.sites(conn)
    frame = ledger.table3(
        book, {r["site"]: r["ranks"] for r in rows}, {r["site"]: r["rtt_ms"] for r in rows}
    )
    return json.loads(frame.to_json(orient="records"))


@dataclass
class _StoredRun:
    """A coordinator's state directory, opened to read: its run, block space and the lease
    book its ledger replays to."""

    conn: Any
    run: RunSpec
    space: BlockSpace
    book: LeaseBook
    ledger: LedgerStore


@contextmanager
def _stored_run(state_dir: Path) -> Iterator[_StoredRun]:
    path = state_dir / "state.sqlite"
    if not path.exists():
        raise CoordinatorError(404, "no_state", f"no coordinator state at {path}")
    conn = store.connect(path)
    try:
        spec = store.get_meta(conn, "spec")
        if spec is None:
            raise CoordinatorError(409, "no_run", f"{path} holds no run")
        run = RunSpec.from_dict(spec)
        space = BlockSpace(run.n_windows, run.block_size, run.data_seed)
        book = LeaseBook(space.n_blocks)
        ledger = LedgerStore(conn)
        ledger.replay(book)
        yield _StoredRun(conn, run, space, book, ledger)
    finally:
        conn.close()


def read_ledger(state_dir: Path) -> list[dict[str, Any]]:
    """Table 3 straight from a coordinator's state directory (no server needed)."""
    with _stored_run(state_dir) as stored:
        return _ledger_records(stored.conn, stored.ledger, stored.book)


def read_status(state_dir: Path) -> dict[str, Any]:
    """What ``GET /v1/status`` answers, straight from a state directory (no server needed).

    Leases are as the ledger last recorded them: a stopped run's in-flight leases show with
    their old expiry times. Opens the database only to read it.
    """
    with _stored_run(state_dir) as stored:
        conn, run, space, book = stored.conn, stored.run, stored.space, stored.book
        current = store.current_round(conn)
        assert current is not None, f"{state_dir}: a run always has an open round"
        leases = []
        for lease in book.active_leases():
            leases.append(
                {
                    "lease_id": lease.lease_id,
                    "site": lease.site,
                    "round": lease.round_no,
                    "epoch": lease.epoch,
                    "n_blocks": lease.end - lease.start,
                    "consumed": lease.consumed,
                    "ttl_s": lease.ttl_s,
                    "expires_at": lease.expires_at,
                    "status": lease.status,
                }
            )
        return {
            "round": current["round_no"],
            "generation": current["generation"],
            "global_step": store.get_meta(conn, "global_step", 0),
            "epoch": book.epoch,
            "blocks_total": space.n_blocks,
            "blocks_committed_in_epoch": book.committed_in_epoch,
            "blocks_committed_total": book.committed_total,
            "digest": space.digest(),
            "inner_steps": run.round_steps(current["round_no"]),
            "inner_schedule": run.inner_schedule(),
            "schedule": run.to_dict()["schedule"],
            "active_leases": leases,
        }
