"""The coordinator's SQLite database: run spec, rounds, sites, accepted deltas, blob uploaders.

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
