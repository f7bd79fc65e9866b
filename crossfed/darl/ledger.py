"""DARL ledger: the durable event log of lease commands, the commit audit table, Table 3.

Event sourcing: every lease command goes through `apply_event`, and the coordinator records
the same (op, args) with `LedgerStore.record` inside the transaction it commits before
replying. A restarted coordinator replays the log into a fresh `LeaseBook` built with the
same n_blocks and gets the identical book. The store never opens, commits or configures the
connection (WAL and synchronous=FULL are the caller's pragmas).

The log grows with every heartbeat (a site beats about once a second), so a long run's
restart would replay millions of events. `checkpoint` stores the book as it stands after the
last recorded event (in the same transaction); `replay` starts from the newest checkpoint and
applies only the events after it. A checkpoint is a cache: the full log is kept, and one that
cannot be read or comes from another book layout (`CHECKPOINT_FORMAT`) is ignored in favour
of a full replay. Checkpoints are pickles: only the coordinator writes its state database.
"""

from __future__ import annotations

import json
import logging
import pickle
import sqlite3
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from crossfed.darl.leases import LeaseBook, LeaseError

if TYPE_CHECKING:  # pandas is imported where a table is made: a site job never makes one
    import pandas as pd

__all__ = [
    "OPS",
    "TABLE3_COLUMNS",
    "DuplicateCommitError",
    "LedgerError",
    "LedgerStore",
    "apply_event",
]

log = logging.getLogger("crossfed.darl")

EVENTS_TABLE = "darl_events"
CHECKPOINT_TABLE = "darl_checkpoints"
#: the LeaseBook layout a checkpoint holds; change it when LeaseBook's attributes change
CHECKPOINT_FORMAT = "leasebook-pickle-3"  # 2: a site holds a list of leases; 3: two open epochs
#: events between checkpoints by default (replaying them takes about a tenth of a second)
CHECKPOINT_EVERY = 10_000
COMMITTED_TABLE = "darl_committed"
META_TABLE = "darl_meta"

TABLE3_COLUMNS = [
    "site",
    "ranks",
    "rtt_ms",
    "entries",
    "grants",
    "blocks_granted",
    "blocks_committed",
    "blocks_lost",
    "ttl_expiries",
]

# op -> (required args, optional args); every op carries `now` so replay is deterministic
OPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "register": (("site", "now"), ()),
    "grant": (("site", "n_blocks", "now", "ttl_s", "round_no"), ("requested", "ranks", "ahead")),
    "heartbeat": (("lease_id", "site", "consumed", "now"), ("ttl_s",)),
    "adopt": (("lease_id", "site", "consumed", "now"), ("ttl_s",)),
    "revive": (("lease_id", "site", "consumed", "now"), ("ttl_s",)),
    "steal": (("site", "now", "ttl_s", "round_no"), ("ranks", "ahead")),
    "commit": (("lease_id", "site", "consumed", "now"), ()),
    "release": (("lease_id", "site", "now"), ()),
    "expire": (("now",), ()),
    "grace": (("now",), ()),
    "next_epoch": (("now",), ()),
}

_SQL_CHUNK = 500


class LedgerError(Exception):
    """A malformed event or an inconsistent ledger."""


class DuplicateCommitError(LedgerError):
    """A block was about to be committed a second time in the same epoch."""


def _check_event(op: str, args: Mapping[str, object]) -> None:
    spec = OPS.get(op)
    if spec is None:
        raise LedgerError(f"unknown DARL op {op!r}; expected one of {sorted(OPS)}")
    if not isinstance(args, Mapping):
        raise LedgerError(f"{op}: args must be a mapping, got {type(args).__name__}")
    missing = [k for k in spec[0] if k not in args]
    if missing:
        raise LedgerError(f"{op}: missing argument(s) {missing}")


def apply_event(book: LeaseBook, op: str, args: Mapping[str, object]) -> object:
    """Run one lease command on `book`: the one code path for live calls and replay.

    Keys of `args` other than the op's parameters are ignored (free for context such as an
    RTT). Raises LedgerError for a malformed event, LeaseError when the book refuses.
    """
    _check_event(op, args)
    a = args
    if op == "register":
        return book.register(a["site"], a["now"])
    if op == "grant":
        return book.grant(
            a["site"], a["n_blocks"], a["now"], a["ttl_s"], a["round_no"], a.get("requested"),
            a.get("ranks"), bool(a.get("ahead", False)),
        )  # fmt: skip
    if op == "heartbeat":
        return book.heartbeat(a["lease_id"], a["site"], a["consumed"], a["now"], a.get("ttl_s"))
    if op == "adopt":
        return book.adopt(a["lease_id"], a["site"], a["consumed"], a["now"], a.get("ttl_s"))
    if op == "revive":
        return book.revive(a["lease_id"], a["site"], a["consumed"], a["now"], a.get("ttl_s"))
    if op == "steal":
        ahead = {int(k): int(v) for k, v in (a.get("ahead") or {}).items()}  # JSON: str keys
        return book.steal(a["site"], a["now"], a["ttl_s"], a["round_no"], a.get("ranks"), ahead)
    if op == "commit":
        return book.commit(a["lease_id"], a["site"], a["consumed"], a["now"], a.get("idle_s", 0.0))
    if op == "release":
        return book.release(a["lease_id"], a["site"], a["now"])
    if op == "expire":
        return book.expire(a["now"])
    if op == "grace":
        return book.grace(a["now"])
    return book.next_epoch()


class LedgerStore:
    """DARL tables on a caller-owned SQLite connection; writes join the caller's transaction."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {EVENTS_TABLE} ("
            " seq INTEGER PRIMARY KEY AUTOINCREMENT, op TEXT NOT NULL, args TEXT NOT NULL)"
        )
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {COMMITTED_TABLE} ("
            " epoch INTEGER NOT NULL, block INTEGER NOT NULL, site TEXT NOT NULL,"
            " lease_id INTEGER NOT NULL, PRIMARY KEY (epoch, block))"
        )
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {META_TABLE} (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
        )
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {CHECKPOINT_TABLE} ("
            " seq INTEGER PRIMARY KEY, format TEXT NOT NULL, state BLOB NOT NULL)"
        )
        self._since_checkpoint: int | None = None  # events recorded since; None: not counted

    # ---- event log -----------------------------------------------------------------------

    def record(self, op: str, args: Mapping[str, object]) -> None:
        """Append one event; made durable by the caller's commit."""
        _check_event(op, args)
        try:
            text = json.dumps(dict(args), sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as err:
            raise LedgerError(f"{op}: args are not plain finite JSON: {err}") from err
        self.conn.execute(f"INSERT INTO {EVENTS_TABLE} (op, args) VALUES (?, ?)", (op, text))

    def events(self) -> list[tuple[int, str, dict]]:
        """All recorded events as (seq, op, args), in order."""
        rows = self.conn.execute(f"SELECT seq, op, args FROM {EVENTS_TABLE} ORDER BY seq")
        return [(seq, op, json.loads(text)) for seq, op, text in rows]

    def replay(self, book: LeaseBook, *, strict: bool = False) -> int:
        """Bring a fresh `book` to the logged state; returns how many events were applied.

        Starts from the newest usable checkpoint (then only the events after it are read)
        or from the first event. A refused command changes nothing, live or replayed, so an
        event the book refuses (LeaseError) is skipped unless `strict`: a caller that records
        before applying still replays to the same book.
        """
        start = self._restore_checkpoint(book)
        rows = self.conn.execute(
            f"SELECT op, args FROM {EVENTS_TABLE} WHERE seq > ? ORDER BY seq", (start,)
        )
        n = 0
        for op, text in rows:  # streamed: the log may be far larger than memory allows
            try:
                apply_event(book, op, json.loads(text))
            except LeaseError:
                if strict:
                    raise
            n += 1
        return n

    def checkpoint(self, book: LeaseBook) -> int:
        """Store `book` as the state after the last recorded event (joins the caller's
        transaction; older checkpoints are dropped); returns that event's seq."""
        seq = self._last_seq()
        blob = zlib.compress(pickle.dumps(vars(book), protocol=pickle.HIGHEST_PROTOCOL), 1)
        self.conn.execute(f"DELETE FROM {CHECKPOINT_TABLE}")
        self.conn.execute(
            f"INSERT INTO {CHECKPOINT_TABLE} (seq, format, state) VALUES (?, ?, ?)",
            (seq, CHECKPOINT_FORMAT, blob),
        )
        self._since_checkpoint = 0
        return seq

    def maybe_checkpoint(self, book: LeaseBook, every: int = CHECKPOINT_EVERY) -> bool:
        """Call after recording an event: a checkpoint once `every` events have passed."""
        if self._since_checkpoint is None:
            row = self.conn.execute(f"SELECT MAX(seq) FROM {CHECKPOINT_TABLE}").fetchone()
            self._since_checkpoint = self._last_seq() - (row[0] or 0)
        else:
            self._since_checkpoint += 1
        if every < 1 or self._since_checkpoint < every:
            return False
        self.checkpoint(book)
        return True

    def _last_seq(self) -> int:
        return self.conn.execute(f"SELECT COALESCE(MAX(seq), 0) FROM {EVENTS_TABLE}").fetchone()[0]

    def _restore_checkpoint(self, book: LeaseBook) -> int:
        """Load the newest checkpoint into `book`; the seq it stands at (0: none usable)."""
        row = self.conn.execute(
            f"SELECT seq, format, state FROM {CHECKPOINT_TABLE} ORDER BY seq DESC LIMIT 1"
        ).fetchone()
        if row is None:
            return 0
        seq, fmt, blob = row
        why = None
        if fmt != CHECKPOINT_FORMAT:
            why = f"format {fmt!r}, this version reads {CHECKPOINT_FORMAT!r}"
        else:
            try:
                state = pickle.loads(zlib.decompress(blob))
            except Exception as exc:  # any damage: the full log still holds the truth
                why = f"unreadable ({type(exc).__name__}: {exc})"
            else:
                if not isinstance(state, dict) or set(state) != set(vars(book)):
                    why = "another lease-book layout"
                elif state.get("n_blocks") != book.n_blocks:
                    why = f"n_blocks {state.get('n_blocks')}, the book has {book.n_blocks}"
        if why is not None:
            log.warning("DARL checkpoint at event %d ignored (%s): replaying every event", seq, why)
            return 0
        vars(book).update(state)
        return seq

    # ---- block-space binding -------------------------------------------------------------

    def bind_space(self, digest: str, n_blocks: int) -> None:
        """Remember the block space this ledger belongs to; refuse a different one later."""
        want = {"space_digest": digest, "n_blocks": str(n_blocks)}
        have = dict(self.conn.execute(f"SELECT key, value FROM {META_TABLE}"))
        for key, value in want.items():
            if key in have and have[key] != value:
                raise LedgerError(f"ledger belongs to {key}={have[key]}, not {value}")
            if key not in have:
                self.conn.execute(
                    f"INSERT INTO {META_TABLE} (key, value) VALUES (?, ?)", (key, value)
                )

    # ---- commit audit --------------------------------------------------------------------

    def record_commit_blocks(
        self, epoch: int, site: str, lease_id: int, blocks: Sequence[int]
    ) -> None:
        """Add committed block ids to the audit table; a block already there is refused.

        Checks before writing, so a refused call adds no rows.
        """
        ids = [int(b) for b in blocks]
        if len(set(ids)) != len(ids):
            raise DuplicateCommitError(f"epoch {epoch}: lease {lease_id} lists a block twice")
        for i in range(0, len(ids), _SQL_CHUNK):
            chunk = ids[i : i + _SQL_CHUNK]
            marks = ",".join("?" * len(chunk))
            hit = self.conn.execute(
                f"SELECT block, site, lease_id FROM {COMMITTED_TABLE}"
                f" WHERE epoch = ? AND block IN ({marks}) LIMIT 1",
                (int(epoch), *chunk),
            ).fetchone()
            if hit is not None:
                raise DuplicateCommitError(
                    f"epoch {epoch}: block {hit[0]} already committed by {hit[1]!r} "
                    f"(lease {hit[2]}); {site!r} lease {lease_id} tried again"
                )
        try:
            self.conn.executemany(
                f"INSERT INTO {COMMITTED_TABLE} (epoch, block, site, lease_id) VALUES (?, ?, ?, ?)",
                [(int(epoch), b, site, int(lease_id)) for b in ids],
            )
        except sqlite3.IntegrityError as err:  # pragma: no cover - guarded by the check above
            raise DuplicateCommitError(f"epoch {epoch}: duplicate commit: {err}") from err

    def audit_counts(self, epoch: int | None = None) -> dict[str, int]:
        """Committed blocks per site in the audit table (one epoch, or all)."""
        sql = f"SELECT site, COUNT(*) FROM {COMMITTED_TABLE}"
        params: tuple = ()
        if epoch is not None:
            sql += " WHERE epoch = ?"
            params = (int(epoch),)
        return dict(self.conn.execute(sql + " GROUP BY site ORDER BY site", params))

    # ---- report --------------------------------------------------------------------------

    def table3(
        self, book: LeaseBook, ranks: Mapping[str, int], rtt_ms: Mapping[str, float]
    ) -> pd.DataFrame:
        """Paper Table 3: one row per site (sorted by name), then a "total" row.

        Counts come from the book. The total row sums every count and ranks; its rtt_ms is
        NaN (blank), since a run has no single round trip time. Sites missing from `ranks`
        or `rtt_ms` get NA there.
        """
        import pandas as pd

        stats = book.site_stats()
        rows = [
            {
                "site": site,
                "ranks": ranks.get(site),
                "rtt_ms": rtt_ms.get(site),
                "entries": s.entries,
                "grants": s.grants,
                "blocks_granted": s.blocks_granted,
                "blocks_committed": s.blocks_committed,
                "blocks_lost": s.blocks_lost,
                "ttl_expiries": s.ttl_expiries,
            }
            for site, s in sorted(stats.items())
        ]
        frame = pd.DataFrame(rows, columns=TABLE3_COLUMNS)
        total = {c: frame[c].sum() for c in TABLE3_COLUMNS[3:]}
        known = frame["ranks"].dropna()
        total |= {"site": "total", "ranks": known.sum() if len(known) else None, "rtt_ms": None}
        frame = pd.concat([frame, pd.DataFrame([total], columns=TABLE3_COLUMNS)], ignore_index=True)
        frame["ranks"] = frame["ranks"].astype("Int64")
        frame["rtt_ms"] = frame["rtt_ms"].astype("float64")
        for c in TABLE3_COLUMNS[3:]:
            frame[c] = frame[c].astype("int64")
        return frame
