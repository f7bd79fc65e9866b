"""bench/soak_check.py on the soak's CI run: the faulted run checks out, and each kind of
damage done to a copy of its state is caught.

The run is bench/soak.py's CI preset (a real coordinator SIGKILLed anytime and mid-merge,
three real site processes SIGKILLed and restarted, per-site faulty proxies, a full disk),
its coordinator served with ``--keep-deltas``: the rebuild needs every merged delta and
generation 0's master, which retention otherwise deletes.
"""

from __future__ import annotations

import ast
import json
import random
import shutil
import sqlite3
import struct
import subprocess
import sys
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.soak_check import DeltaBlob, LedgerReplay, block_order, check, space_digest
from crossfed.coordinator.service import read_ledger
from crossfed.darl.blockspace import BlockSpace
from crossfed.darl.leases import LeaseBook, LeaseError
from crossfed.darl.ledger import apply_event
from crossfed.wire.codecs import open_delta, save_delta
from tests.e2e.conftest import SoakRun

REPO = Path(__file__).resolve().parents[2]
CHECKER = REPO / "bench" / "soak_check.py"
pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Campaign:
    state: Path
    model: Path
    figures: dict[str, Any]


@pytest.fixture(scope="module")
def campaign(soak_ci: SoakRun) -> Campaign:
    """The soak's CI run (its coordinator served with ``--keep-deltas``)."""
    return Campaign(soak_ci.state, soak_ci.model, soak_ci.result)


@pytest.fixture
def state(campaign: Campaign, tmp_path: Path) -> Path:
    """A copy of the campaign's state directory, free to damage."""
    return shutil.copytree(campaign.state, tmp_path / "state")


def execute(state: Path, sql: str, *params: Any) -> int:
    """Run one statement on the state database; returns the rows it changed."""
    with closing(sqlite3.connect(state / "state.sqlite")) as conn, conn:
        return conn.execute(sql, params).rowcount


def merged_delta(state: Path, round_no: int) -> dict[str, Any]:
    with closing(sqlite3.connect(state / "state.sqlite")) as conn:
        conn.row_factory = sqlite3.Row
        row = conn.execute(
            "SELECT * FROM deltas WHERE round_no = ? ORDER BY lease_id LIMIT 1", (round_no,)
        ).fetchone()
    assert row is not None, f"no delta was accepted for round {round_no}"
    return dict(row)


def blob_path(state: Path, key: str) -> Path:
    algo, _, hexdigest = key.partition(":")
    return state / "blobs" / algo / hexdigest[:2] / hexdigest


def first_tensor_offset(path: Path) -> int:
    """Byte offset of the first tensor's first value in a safetensors file."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header.pop("__metadata__", None)
    return 8 + size + min(entry["data_offsets"][0] for entry in header.values())


def add_to_bf16(path: Path, offset: int, amount: float) -> None:
    """Add ``amount`` to the bf16 value at ``offset`` of ``path``, in place."""
    raw = bytearray(path.read_bytes())
    (bits,) = struct.unpack("<H", raw[offset : offset + 2])
    value = np.array([bits << 16], dtype=np.uint32).view(np.float32)[0] + np.float32(amount)
    raw[offset : offset + 2] = struct.pack("<H", int(np.float32(value).view(np.uint32)) >> 16)
    path.write_bytes(bytes(raw))


def run_cli(*args: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, str(CHECKER), *args], capture_output=True, text=True, timeout=120
    )
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- the checker
def test_checker_shares_no_code_with_the_coordinator() -> None:
    tree = ast.parse(CHECKER.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import"
            imported.add((node.module or "").split(".")[0])
    assert "crossfed" not in imported
    assert imported <= set(sys.stdlib_module_names) | {"numpy", "safetensors"}, imported


@pytest.mark.parametrize(
    "n_windows, block_size, seed", [(1, 1, 0), (219, 16, 11), (5000, 3, 2**64 - 1)]
)
def test_block_order_is_the_coordinators(n_windows: int, block_size: int, seed: int) -> None:
    space = BlockSpace(n_windows, block_size, seed)
    assert space_digest(n_windows, block_size, seed) == space.digest()
    for epoch in range(3):
        order = block_order(space.n_blocks, seed, epoch)
        assert order.tolist() == space.permutation(epoch).tolist()


@pytest.mark.parametrize("encoding", ["none", "int8", "int4"])
def test_delta_decoding_is_the_coordinators(encoding: str, tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    shapes = {"a": (3, 5), "b": (7,), "c": (2, 3, 67)}
    reference = {n: torch.randn(s, generator=generator) for n, s in shapes.items()}
    trained = {
        n: t + 0.01 * torch.randn(t.shape, generator=generator) for n, t in reference.items()
    }
    path = tmp_path / "delta.safetensors"
    save_delta(trained, reference, path, codec=encoding)
    blob = DeltaBlob(path, "blake3:test")
    assert blob.encoding == encoding
    with open_delta(path) as delta:
        for name, shape in shapes.items():
            want = delta[name].float().reshape(-1).numpy()
            assert np.array_equal(blob.decode(name, shape), want), name


@pytest.mark.parametrize("seed", range(3))
def test_ledger_replay_is_the_coordinators_lease_book(seed: int) -> None:
    """Random commands (grants, early ones leasing ahead into the next epoch, steals,
    heartbeats, commits, releases, expiries, revivals, restarts' grace, epochs) on the
    coordinator's LeaseBook; the checker's replay of the ones it took ends with the same
    leases and the same per-site counts."""
    rng = random.Random(seed)
    book, taken, now, round_no = LeaseBook(23), [], 0.0, 1
    leased_ahead: list[tuple[Any, int]] = []  # each grant, with the epoch current at it
    leased: list[int] = []  # every lease id granted
    revived_expired = 0
    for _ in range(2000):
        now += rng.uniform(0.0, 3.0)
        round_no += rng.random() < 0.02
        site = rng.choice("abc")
        held = [lease for lease in book.active_leases() if lease.site == site]
        op = rng.choice(["register", "grant", "steal", "heartbeat", "commit", "release"] * 2
                        + ["expire", "grace", "revive"])  # fmt: skip
        args: dict[str, Any] = {"now": now, "site": site}
        if op == "revive":  # the site heard from again after its lease's TTL, maybe
            held = [book.lease(i) for i in leased[-6:] if book.lease(i).site == site]
        if op in ("grant", "steal"):
            args.update(ttl_s=rng.uniform(2, 20), round_no=round_no + rng.randint(0, 1))
            if op == "grant":
                args.update(n_blocks=rng.randint(1, 6))
                if rng.random() < 0.5:  # an early lease: from the next epoch at an epoch's end
                    args.update(ahead=True)
            else:  # blocks the coordinator judged each holder trained since its heartbeat
                unheard = {str(x.lease_id): rng.randint(0, 2) for x in book.active_leases()}
                args.update(ahead=unheard)
        elif op in ("heartbeat", "commit", "release", "revive"):
            if not held:
                continue
            lease = rng.choice(held)
            args.update(lease_id=lease.lease_id)
            if op != "release":
                args.update(consumed=rng.randint(lease.consumed, lease.end - lease.start))
        try:
            epoch = book.epoch
            was = book.lease(args["lease_id"]).status if op == "revive" else None
            got = apply_event(book, op, args)
        except LeaseError:
            continue
        revived_expired += was == "expired"
        if op == "grant" and got is not None:
            leased_ahead.append((got, epoch))
        if op in ("grant", "steal") and got is not None:
            leased.append(got.lease_id)
        taken.append((op, args))
        if book.epoch_complete():
            apply_event(book, "next_epoch", {"now": now})
            taken.append(("next_epoch", {"now": now}))
    replay = LedgerReplay(23)
    for seq, (op, args) in enumerate(taken, 1):
        replay.apply(seq, op, args)
    assert replay.refused == [] and replay.epoch == book.epoch > 1
    snapshot = book.snapshot()
    fields = ("site", "round_no", "epoch", "start", "end", "consumed", "status", "expires_at")
    assert {i: tuple(lease[f] for f in fields) for i, lease in snapshot["leases"].items()} == {
        i: tuple(getattr(lease, f) for f in fields) for i, lease in replay.leases.items()
    }
    assert sum(s["steals"] for s in snapshot["stats"].values()) > 0
    assert revived_expired > 0  # an expired lease lived again, its positions re-leased
    assert any(lease.epoch > epoch for lease, epoch in leased_ahead)  # the ahead path ran
    for site, stats in snapshot["stats"].items():
        mine = replay.figures(site)
        assert (mine.granted, mine.committed, mine.reclaimed) == (
            stats["blocks_granted"], stats["blocks_committed"], stats["blocks_lost"],
        )  # fmt: skip


# ---------------------------------------------------------------------------- a faulted run
def test_faulted_run_checks_out(campaign: Campaign) -> None:
    assert campaign.figures["faults_injected"] > 0  # a faulted run
    result = check(campaign.state, campaign.model)
    assert result["problems"] == []
    assert result["ok"] is True
    assert result["replay_max_error"] is not None and result["replay_max_error"] <= 1e-6
    assert result["replay_momentum_max_error"] <= 1e-6
    assert result["rounds_replayed"] == result["generation"] == campaign.figures["rounds"]
    for key in ("blocks_lost", "blocks_duplicated", "site_sum_mismatch", "granted_mismatch"):
        assert result[key] == 0, key
    assert result["late_commits"] == result["round_mismatches"] == 0
    assert result["deltas_accepted"] == campaign.figures["deltas_accepted"]
    assert result["blocks_committed"] == campaign.figures["blocks_committed"]
    table3 = {row["site"]: row for row in read_ledger(campaign.state) if row["site"] != "total"}
    assert set(table3) == set(result["sites"])
    for site, row in table3.items():
        mine = result["sites"][site]
        assert (mine["granted"], mine["committed"], mine["reclaimed"]) == (
            row["blocks_granted"], row["blocks_committed"], row["blocks_lost"],
        )  # fmt: skip
    code, printed = run_cli(str(campaign.state), "--model", str(campaign.model))
    assert code == 0 and printed["ok"] is True


def test_duplicated_commit_is_caught(state: Path) -> None:
    execute(
        state,
        "INSERT INTO darl_events (op, args) "
        "SELECT op, args FROM darl_events WHERE op = 'commit' ORDER BY seq LIMIT 1",
    )
    result = check(state)
    assert result["blocks_duplicated"] > 0
    assert result["ok"] is False
    code, printed = run_cli(str(state))
    assert code == 1 and printed["blocks_duplicated"] == result["blocks_duplicated"]


def test_removed_delta_is_caught(state: Path) -> None:
    delta = merged_delta(state, 2)
    assert execute(state, "DELETE FROM deltas WHERE lease_id = ?", delta["lease_id"]) == 1
    result = check(state, rebuild=False)
    assert result["blocks_lost"] >= delta["consumed"]
    assert result["granted_mismatch"] > 0
    assert result["site_sum_mismatch"] > 0
    assert result["round_mismatches"] > 0  # round 2's report names a delta that is gone
    assert result["ok"] is False


def test_changed_delta_blob_is_caught(state: Path) -> None:
    blob = blob_path(state, merged_delta(state, 2)["blob"])
    add_to_bf16(blob, first_tensor_offset(blob), 0.5)
    result = check(state)
    assert result["replay_max_error"] > 1e-3
    assert result["ok"] is False
    ledger = ("blocks_lost", "blocks_duplicated", "late_commits", "round_mismatches")
    assert all(result[key] == 0 for key in ledger)  # the bytes, not the ledger, are wrong


def test_perturbed_final_model_is_caught(campaign: Campaign, state: Path, tmp_path: Path) -> None:
    model = Path(shutil.copy(campaign.model, tmp_path / "final.safetensors"))
    add_to_bf16(model, first_tensor_offset(model), 0.01)
    result = check(state, model)
    assert result["replay_max_error"] > 1e-3
    assert result["ok"] is False


def test_final_second_moment_factors_are_the_token_weighted_mean_or_caught(
    campaign: Campaign, state: Path, tmp_path: Path
) -> None:
    """The run shares second moments (a new run's default): the last global model's
    factors are checked against its round's deltas' factors, and a changed one is caught."""
    assert check(campaign.state, campaign.model)["factors_max_rel_error"] <= 1e-5
    model = Path(shutil.copy(campaign.model, tmp_path / "final.safetensors"))
    raw = bytearray(model.read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    name = next(n for n in header if n.startswith("moments::") and header[n]["shape"])
    assert header[name]["dtype"] == "F32"
    at = 8 + size + header[name]["data_offsets"][0]
    (value,) = struct.unpack("<f", raw[at : at + 4])
    raw[at : at + 4] = struct.pack("<f", value * 1.5)
    model.write_bytes(bytes(raw))
    result = check(state, model)
    assert result["factors_max_rel_error"] > 0.1
    assert any("second-moment factors" in p for p in result["problems"])
    assert result["ok"] is False


def test_the_embedding_rows_are_replayed_weighted_by_the_sites_counts(state: Path) -> None:
    """The CI preset weights the embedding's rows by the sites' token counts: its deltas
    carry them, and a replay that weighted every row by the token shares instead would not
    rebuild the coordinator's master."""
    blob = DeltaBlob(blob_path(state, merged_delta(state, 2)["blob"]), "round 2")
    assert (
        blob.row_counts("tok_embeddings.weight", blob.shape("tok_embeddings.weight")[0]) is not None
    )
    with closing(sqlite3.connect(state / "state.sqlite")) as conn, conn:
        (value,) = conn.execute("SELECT value FROM meta WHERE key = 'spec'").fetchone()
        spec = json.loads(value)
        assert spec["embedding_rows"] == "counts"
        spec["embedding_rows"] = "shares"
        conn.execute("UPDATE meta SET value = ? WHERE key = 'spec'", (json.dumps(spec),))
    result = check(state)
    assert result["replay_max_error"] > 1e-4
    assert result["ok"] is False


def test_commit_moved_to_next_round_is_caught(state: Path) -> None:
    delta = merged_delta(state, 2)
    execute(state, "UPDATE deltas SET round_no = 3 WHERE lease_id = ?", delta["lease_id"])
    result = check(state, rebuild=False)
    assert result["late_commits"] >= 1
    assert any("its lease is of round 2" in p for p in result["problems"])
    assert result["ok"] is False


# ---------------------------------------------------------------------------- what it cannot read
def test_deleted_delta_blob_is_reported_not_raised(state: Path) -> None:
    key = merged_delta(state, 3)["blob"]
    blob_path(state, key).unlink()
    result = check(state)
    assert result["replay_max_error"] is None and result["rounds_replayed"] == 0
    assert any(f"cannot rebuild: delta blob {key}" in p and "retention" in p
               for p in result["problems"])  # fmt: skip
    assert check(state, rebuild=False)["ok"] is True


def test_unknown_delta_encoding_is_refused_by_name(state: Path) -> None:
    path = blob_path(state, merged_delta(state, 1)["blob"])
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header["__metadata__"] = {**header.get("__metadata__", {}), "crossfed.codec": "zstd"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size :])
    result = check(state)
    assert result["ok"] is False
    assert any("'zstd'" in p and "cannot rebuild" in p for p in result["problems"])
