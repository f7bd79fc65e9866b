"""The coordinator's SQLite database: run spec, rounds, sites, accepted deltas, blob uploaders
and (with an object store) the verified objects.

One database file in WAL mode with ``synchronous=FULL``; the DARL ledger lives in the same
file so a delta's acceptance and its blocks' commit are one transaction.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (
    round_no INTEGER PRIMARY KEY,
    generation INTEGER NOT NULL,
    status TEXT NOT NULL,
    opened_at REAL NOT NULL,
    first_lease_at REAL,
    closed_at REAL,
    global_step INTEGER NOT NULL,
    close_reason TEXT,
    report TEXT
);
CREATE TABLE IF NOT EXISTS sites (
    site TEXT PRIMARY KEY,
    ranks INTEGER NOT NULL,
    rtt_ms REAL,
    t_step_s REAL,
    last_seen REAL,
    joined_round INTEGER,
    joined_at REAL
);
CREATE TABLE IF NOT EXISTS deltas (
    lease_id INTEGER PRIMARY KEY,
    round_no INTEGER NOT NULL,
    site TEXT NOT NULL,
    generation INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    steps INTEGER NOT NULL,
    consumed INTEGER NOT NULL,
    blob TEXT NOT NULL,
    loss REAL,
    compute_s REAL,
    accepted_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS blob_holders (
    blob TEXT NOT NULL,
    site TEXT NOT NULL,
    PRIMARY KEY (blob, site)
);
CREATE TABLE IF NOT EXISTS stored_objects (
    blob TEXT NOT NULL,
    owner TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    PRIMARY KEY (blob, owner)
);
CREATE TABLE IF NOT EXISTS checked_objects (
    blob TEXT NOT NULL,
    owner TEXT NOT NULL,
    PRIMARY KEY (blob, owner)
);
"""


def connect(path: Path) -> sqlite3.Connection:
    """Open the database with the durability settings every reply relies on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.executescript(SCHEMA)
    conn.row_factory = sqlite3.Row
    return conn


class Transaction:
    """``with Transaction(conn):`` — BEGIN IMMEDIATE ... COMMIT, rolled back on error."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type, exc, tb) -> None:
        self.conn.execute("ROLLBACK" if exc_type else "COMMIT")


def set_synchronous(conn: sqlite3.Connection, *, full: bool) -> None:
    """Commits fsync the WAL (``full``) or only hand it to the OS (NORMAL)."""
    conn.execute(f"PRAGMA synchronous={'FULL' if full else 'NORMAL'}")


def get_meta(conn: sqlite3.Connection, key: str, default: Any = None) -> Any:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return json.loads(row[0]) if row else default


def set_meta(conn: sqlite3.Connection, key: str, value: Any) -> None:
    conn.execute(
        "INSERT INTO meta (key, value) VALUES (?, ?) "
        "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        (key, json.dumps(value)),
    )


def round_row(conn: sqlite3.Connection, round_no: int) -> dict | None:
    row = conn.execute("SELECT * FROM rounds WHERE round_no = ?", (round_no,)).fetchone()
    if row is None:
        return None
    out = dict(row)
    out["report"] = json.loads(out["report"]) if out["report"] else None
    return out


def round_deltas(conn: sqlite3.Connection, round_no: int) -> list[dict]:
    rows = conn.execute(
        "SELECT * FROM deltas WHERE round_no = ? ORDER BY lease_id", (round_no,)
    ).fetchall()
    return [dict(r) for r in rows]


# ---------------------------------------------------------------------- rounds
def open_round(
    conn: sqlite3.Connection, round_no: int, generation: int, opened_at: float, global_step: int
) -> None:
    """Open round ``round_no`` on ``generation`` (inside the caller's transaction)."""
    conn.execute(
        "INSERT INTO rounds (round_no, generation, status, opened_at, global_step) "
        "VALUES (?, ?, 'open', ?, ?)",
        (round_no, generation, opened_at, global_step),
    )


def current_round(conn: sqlite3.Connection) -> dict | None:
    """The open round's row (the newest if several), or None before a run exists."""
    row = conn.execute(
        "SELECT * FROM rounds WHERE status = 'open' ORDER BY round_no DESC LIMIT 1"
    ).fetchone()
    return dict(row) if row is not None else None


def mark_first_lease(conn: sqlite3.Connection, round_no: int, now: float) -> None:
    """Record when round ``round_no`` granted its first lease (once)."""
    conn.execute(
        "UPDATE rounds SET first_lease_at = COALESCE(first_lease_at, ?) WHERE round_no = ?",
        (now, round_no),
    )


#: meta key: ``{"round_no", "seconds", "at"}``, the time the open round could not be worked
#: on (its deadline counts that much later), last held at ``at``
ROUND_PAUSE = "round_pause"


def last_activity(conn: sqlite3.Connection) -> float | None:
    """The latest moment the run's state records: a site heard from, a delta accepted, a
    round opened or leased, a pause held (None before a run exists)."""
    row = conn.execute(
        "SELECT MAX(t) FROM (SELECT MAX(last_seen) AS t FROM sites "
        "UNION ALL SELECT MAX(accepted_at) FROM deltas "
        "UNION ALL SELECT MAX(opened_at) FROM rounds "
        "UNION ALL SELECT MAX(first_lease_at) FROM rounds)"
    ).fetchone()
    pause = get_meta(conn, ROUND_PAUSE)
    times = [float(row[0])] if row is not None and row[0] is not None else []
    times += [float(pause["at"])] if pause else []
    return max(times, default=None)


def round_pause_s(conn: sqlite3.Connection, round_no: int) -> float:
    """Seconds round ``round_no`` could not be worked on since it opened (0: none)."""
    pause = get_meta(conn, ROUND_PAUSE)
    return float(pause["seconds"]) if pause and pause["round_no"] == round_no else 0.0


def hold_round(conn: sqlite3.Connection, round_no: int, seconds: float, at: float) -> None:
    """Round ``round_no`` could not be worked on for ``seconds`` more, up to ``at``."""
    total = round_pause_s(conn, round_no) + seconds
    set_meta(conn, ROUND_PAUSE, {"round_no": round_no, "seconds": total, "at": at})


def close_round(
    conn: sqlite3.Connection, round_no: int, closed_at: float, reason: str, report: dict
) -> None:
    """Mark round ``round_no`` closed with its merge report."""
    conn.execute(
        "UPDATE rounds SET status = 'closed', closed_at = ?, close_reason = ?, report = ? "
        "WHERE round_no = ?",
        (closed_at, reason, json.dumps(report), round_no),
    )


def closed_reports(conn: sqlite3.Connection) -> list[tuple[int, dict]]:
    """Each closed round's number and merge report ({} when none), in round order."""
    rows = conn.execute(
        "SELECT round_no, report FROM rounds WHERE status = 'closed' ORDER BY round_no"
    ).fetchall()
    return [(r["round_no"], json.loads(r["report"]) if r["report"] else {}) for r in rows]


# ---------------------------------------------------------------------- sites
def upsert_site(
    conn: sqlite3.Connection, site: str, ranks: int, rtt_ms: float | None, now: float
) -> None:
    """Register ``site`` or update its ranks, RTT (when given) and last contact."""
    conn.execute(
        "INSERT INTO sites (site, ranks, rtt_ms, last_seen) VALUES (?, ?, ?, ?) "
        "ON CONFLICT(site) DO UPDATE SET ranks = excluded.ranks, "
        "rtt_ms = COALESCE(excluded.rtt_ms, rtt_ms), last_seen = excluded.last_seen",
        (site, ranks, rtt_ms, now),
    )


def announce_site(conn: sqlite3.Connection, site: str, round_no: int, now: float) -> None:
    """``site`` means to lease in round ``round_no`` (registered for it at ``now``)."""
    conn.execute(
        "UPDATE sites SET joined_round = ?, joined_at = ? WHERE site = ?", (round_no, now, site)
    )


def site_seen(
    conn: sqlite3.Connection,
    site: str,
    now: float,
    *,
    t_step_s: float | None = None,
    rtt_ms: float | None = None,
) -> None:
    """Last contact of ``site``, with its step time and RTT where it sent them."""
    conn.execute(
        "UPDATE sites SET t_step_s = COALESCE(?, t_step_s), rtt_ms = COALESCE(?, rtt_ms), "
        "last_seen = ? WHERE site = ?",
        (t_step_s, rtt_ms, now, site),
    )


def site_rtt_ms(conn: sqlite3.Connection, site: str) -> float | None:
    """The RTT ``site`` last reported, if any."""
    row = conn.execute("SELECT rtt_ms FROM sites WHERE site = ?", (site,)).fetchone()
    return row["rtt_ms"] if row else None


def site_ranks(conn: sqlite3.Connection, site: str) -> int | None:
    """The ranks ``site`` last registered with, if it did."""
    row = conn.execute("SELECT ranks FROM sites WHERE site = ?", (site,)).fetchone()
    return row["ranks"] if row else None


def sites(conn: sqlite3.Connection) -> list[dict]:
    """Every registered site's ranks, RTT, step time and last contact, by name."""
    rows = conn.execute(
        "SELECT site, ranks, rtt_ms, t_step_s, last_seen FROM sites ORDER BY site"
    ).fetchall()
    return [dict(r) for r in rows]


def announced_sites(conn: sqlite3.Connection, round_no: int, since: float) -> int:
    """Sites that registered for round ``round_no`` after ``since`` and sent no delta to it."""
    return conn.execute(
        "SELECT COUNT(*) FROM sites WHERE joined_round = ? AND joined_at > ? "
        "AND site NOT IN (SELECT site FROM deltas WHERE round_no = ?)",
        (round_no, since, round_no),
    ).fetchone()[0]


# ---------------------------------------------------------------------- deltas
def add_delta(
    conn: sqlite3.Connection,
    *,
    lease_id: int,
    round_no: int,
    site: str,
    generation: int,
    tokens: int,
    steps: int,
    consumed: int,
    blob: str,
    loss: float | None,
    compute_s: float | None,
    accepted_at: float,
) -> None:
    """Record an accepted delta (inside the transaction that commits its blocks)."""
    conn.execute(
        "INSERT INTO deltas (lease_id, round_no, site, generation, tokens, steps, "
        "consumed, blob, loss, compute_s, accepted_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            lease_id, round_no, site, generation, tokens, steps, consumed, blob, loss,
            compute_s, accepted_at,
        ),
    )  # fmt: skip


def delta_of_lease(conn: sqlite3.Connection, lease_id: int) -> dict | None:
    """The delta lease ``lease_id`` carried, if it carried one."""
    row = conn.execute("SELECT * FROM deltas WHERE lease_id = ?", (lease_id,)).fetchone()
    return dict(row) if row is not None else None


def has_delta(conn: sqlite3.Connection, round_no: int, site: str) -> bool:
    """Whether ``site`` already contributed to round ``round_no``."""
    row = conn.execute(
        "SELECT 1 FROM deltas WHERE round_no = ? AND site = ?", (round_no, site)
    ).fetchone()
    return row is not None


def delta_losses(conn: sqlite3.Connection) -> dict[int, dict[str, float | None]]:
    """round -> site -> the loss its delta reported."""
    losses: dict[int, dict[str, float | None]] = {}
    for row in conn.execute("SELECT round_no, site, loss FROM deltas"):
        losses.setdefault(row["round_no"], {})[row["site"]] = row["loss"]
    return losses


def delta_blobs(conn: sqlite3.Connection, through_round: int) -> tuple[list[str], list[str]]:
    """Blob keys of the deltas of rounds up to ``through_round``, and of the later rounds."""
    merged = conn.execute(
        "SELECT DISTINCT blob FROM deltas WHERE round_no <= ?", (through_round,)
    ).fetchall()
    pending = conn.execute(
        "SELECT DISTINCT blob FROM deltas WHERE round_no > ?", (through_round,)
    ).fetchall()
    return [r["blob"] for r in merged], [r["blob"] for r in pending]


def delta_owner(conn: sqlite3.Connection, keys: list[str]) -> str | None:
    """The site whose accepted delta is stored under any of ``keys`` (spellings of one blob)."""
    marks = ", ".join("?" for _ in keys)
    row = conn.execute(f"SELECT site FROM deltas WHERE blob IN ({marks}) LIMIT 1", keys).fetchone()
    return row["site"] if row else None


# ---------------------------------------------------------------------- blob uploaders
def add_blob_holder(conn: sqlite3.Connection, key: str, site: str) -> None:
    """``site`` uploads (or uploaded) blob ``key``."""
    conn.execute("INSERT OR IGNORE INTO blob_holders (blob, site) VALUES (?, ?)", (key, site))


def blob_holders(conn: sqlite3.Connection, key: str) -> set[str]:
    """The sites that uploaded blob ``key``."""
    rows = conn.execute("SELECT site FROM blob_holders WHERE blob = ?", (key,)).fetchall()
    return {r["site"] for r in rows}


def forget_blob_holders(conn: sqlite3.Connection, keys: list[str]) -> None:
    """Drop the uploaders of deleted blobs."""
    conn.executemany("DELETE FROM blob_holders WHERE blob = ?", [(k,) for k in keys])


# ---------------------------------------------------------------------- object store
def add_stored_object(conn: sqlite3.Connection, key: str, owner: str, size: int) -> None:
    """Blob ``key``'s object uploaded by ``owner`` is complete and hashes to ``key``."""
    conn.execute(
        "INSERT OR REPLACE INTO stored_objects (blob, owner, bytes) VALUES (?, ?, ?)",
        (key, owner, size),
    )


def stored_objects(conn: sqlite3.Connection, key: str) -> dict[str, int]:
    """The verified objects of blob ``key``: owner -> size."""
    rows = conn.execute("SELECT owner, bytes FROM stored_objects WHERE blob = ?", (key,))
    return {r["owner"]: r["bytes"] for r in rows.fetchall()}


def all_stored_objects(conn: sqlite3.Connection) -> list[tuple[str, str]]:
    """Every verified object's ``(blob, owner)``."""
    rows = conn.execute("SELECT blob, owner FROM stored_objects").fetchall()
    return [(r["blob"], r["owner"]) for r in rows]


def forget_stored_object(conn: sqlite3.Connection, key: str, owner: str) -> None:
    conn.execute("DELETE FROM stored_objects WHERE blob = ? AND owner = ?", (key, owner))
    conn.execute("DELETE FROM checked_objects WHERE blob = ? AND owner = ?", (key, owner))


def add_checked_object(conn: sqlite3.Connection, key: str, owner: str) -> None:
    """Blob ``key``'s object of ``owner`` passed the delta check as it was hashed."""
    conn.execute("INSERT OR IGNORE INTO checked_objects (blob, owner) VALUES (?, ?)", (key, owner))


def is_checked_object(conn: sqlite3.Connection, key: str, owner: str) -> bool:
    row = conn.execute(
        "SELECT 1 FROM checked_objects WHERE blob = ? AND owner = ?", (key, owner)
    ).fetchone()
    return row is not None
