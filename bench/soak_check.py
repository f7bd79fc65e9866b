"""Independent check of a finished (or stopped) run's coordinator state.

Reads what ``crossfed coordinator serve --state-dir DIR`` leaves behind (``state.sqlite``, the
blob store, the model generations) and re-derives, with code of its own (the standard
library and numpy only, nothing of ``crossfed``), what the coordinator claims:

* ledger replay: the DARL event log (``darl_events``) is replayed into a lease book written
  here from the documented rules (lowest pooled run first, steals take half the largest
  rest, TTL expiry, the revival of an expired lease whose positions are all still pooled,
  release, commit of a prefix); an event the rules refuse is a problem;
* exactly once: every (epoch, block) is committed once by the replayed commit events, once
  by the accepted deltas (``deltas``, through their leases) and once in the commit audit
  table (``darl_committed``); in finished epochs no block is missing from any of the three
  (``blocks_duplicated``, ``blocks_lost``). Block ids come from the block permutation
  (splitmix64, Lemire, Durstenfeld), recomputed here;
* sums: the sites' committed blocks and tokens add up to the run's totals (the epochs'
  blocks, the merge reports' tokens) (``site_sum_mismatch``); per site, blocks granted =
  committed (accepted deltas) + reclaimed (expired, released, untrained tails) + held by
  leases still live at the end (``granted_mismatch``);
* rounds: each accepted delta belongs to the round of its lease, was accepted while that
  round was open, from that round's generation, and its commit event is its acceptance
  (``late_commits``); each merge report names exactly the deltas accepted for its round,
  their tokens, shares and the outer rate (``round_mismatches``);
* rebuild: generation 0's master plus every accepted delta, merged round by round with the
  token-weighted Nesterov outer step (paper Eq. 1, the run spec's outer preset), gives the
  final master; ``replay_max_error`` is the largest difference from the coordinator's final
  fp32 master and from the final model (a bf16 model's own rounding is allowed for).

Retention: the rebuild needs ``models/master-000000.safetensors`` and every merged delta
blob, which the coordinator deletes after each merge unless it is served with
``crossfed coordinator serve --keep-deltas``. Without them the checker reports "cannot
rebuild: ... deleted by retention" (a problem) and still runs every other check;
``--no-rebuild`` leaves the rebuild out on purpose.

Run: ``python bench/soak_check.py STATE_DIR [--model FILE]``; the last line printed is one
JSON object, and the exit status is 1 when a problem was found.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sqlite3
import struct
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TOLERANCE = 1e-6
MOMENTUM_PREFIX = "momentum::"
#: the sites' second-moment factors, in delta files and (averaged) in global models
MOMENTS_PREFIX = "moments::"
ROWS_PREFIX = "rows::"  # a site's count of each embedding row's token in its phase
PERMUTATION_VERSION = "crossfed.darl.blockspace/v1:splitmix64+lemire64+durstenfeld"
DELTA_ENCODINGS = ("none", "int8", "int4")
MAX_PROBLEMS = 200
CHUNK = 1 << 20  # elements per float64 slice of the outer step

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_EPOCH_SALT = 0xD1B54A32D192ED03
POOLED, COMMITTED = -1, -2


class CheckError(Exception):
    """A file the checker cannot read as documented."""


# ------------------------------------------------------------------------- safetensors
class SafetensorsFile:
    """A safetensors file read with the standard library: header, then tensors by name."""

    SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}
    NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I8": "i1"}

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) != 8:
                raise CheckError(f"{path}: too short for a safetensors file")
            (size,) = struct.unpack("<Q", head)
            try:
                header = json.loads(handle.read(size))
            except ValueError as exc:
                raise CheckError(f"{path}: unreadable safetensors header ({exc})") from exc
        self.data_start = 8 + size
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: dict[str, dict[str, Any]] = header

    def names(self) -> list[str]:
        """Tensor names in file order."""
        return sorted(self.entries, key=lambda n: self.entries[n]["data_offsets"][0])

    def dtype(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` in its shape: floats as float32 (bf16 widened exactly), ints as is."""
        entry = self.entries.get(name)
        if entry is None:
            raise CheckError(f"{self.path.name}: no tensor {name!r}")
        dtype, shape = entry["dtype"], tuple(entry["shape"])
        if dtype not in self.SIZES:
            raise CheckError(f"{self.path.name}: tensor {name!r} has unsupported dtype {dtype}")
        start, end = entry["data_offsets"]
        if end - start != math.prod(shape) * self.SIZES[dtype]:
            raise CheckError(f"{self.path.name}: tensor {name!r} has a wrong byte count")
        with open(self.path, "rb") as handle:
            handle.seek(self.data_start + start)
            raw = handle.read(end - start)
        if len(raw) != end - start:
            raise CheckError(f"{self.path.name}: tensor {name!r} is cut short")
        if dtype == "BF16":
            wide = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            return wide.view(np.float32).reshape(shape)
        if dtype == "U8":
            return np.frombuffer(raw, dtype=np.uint8).reshape(shape)
        array = np.frombuffer(raw, dtype=self.NUMPY[dtype]).reshape(shape)
        return array.astype(np.float32) if dtype in ("F64", "F16") else array


def half_ulp(values: np.ndarray, dtype: str) -> np.ndarray:
    """Half a unit in the last place of values stored as ``dtype`` (0 for fp32 storage)."""
    bits = {"BF16": 8, "F16": 11}.get(dtype)
    if bits is None:
        return np.zeros(values.shape, dtype=np.float64)
    _, exponent = np.frexp(values.astype(np.float64))
    out = np.ldexp(1.0, exponent - bits - 1)
    return np.where(values == 0, 0.0, out)


def to_bf16(values: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bf16 (nearest, ties to even), returned as float32."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


# ------------------------------------------------------------------------- delta encodings
class DeltaBlob:
    """An accepted delta file; decodes each parameter to float32 (encodings none, int8, int4)."""

    def __init__(self, path: Path, key: str) -> None:
        self.key = key
        self.file = SafetensorsFile(path)
        meta = self.file.metadata
        self.encoding = meta.get("crossfed.codec", "none")
        if self.encoding not in DELTA_ENCODINGS:
            raise CheckError(
                f"delta blob {key} uses encoding {self.encoding!r}, which this checker does "
                f"not read (it reads {', '.join(DELTA_ENCODINGS)})"
            )
        default_block = 64 if self.encoding == "int4" else 256
        self.block = int(meta.get("crossfed.block", default_block))
        self.factors = [n for n in self.file.names() if n.startswith(MOMENTS_PREFIX)]
        side = (MOMENTS_PREFIX, ROWS_PREFIX)
        stored = [n for n in self.file.names() if not n.startswith(side)]
        if self.encoding == "none":
            self.params = stored
        else:
            self.params = [n for n in stored if not n.endswith("::scale")]
        self.int4_shapes: dict[str, list[int]] = {}
        if self.encoding == "int4":
            self.int4_shapes = json.loads(meta.get("crossfed.shapes", "{}"))

    def shape(self, name: str) -> tuple[int, ...]:
        if self.encoding == "int4":
            return tuple(self.int4_shapes.get(name, ()))
        return self.file.shape(name)

    def row_counts(self, name: str, rows: int) -> np.ndarray | None:
        """The counts of ``name``'s rows this delta carries, float64 (None: none, or none a
        merge can use: of another length, negative or not finite)."""
        key = ROWS_PREFIX + name
        if key not in self.file.names():
            return None
        counts = self.file.read(key).reshape(-1).astype(np.float64)
        if counts.size != rows or not np.all(np.isfinite(counts)) or np.any(counts < 0):
            return None
        return counts

    def decode(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Parameter ``name`` as flat float32 values."""
        if name not in self.params:
            raise CheckError(f"delta blob {self.key} has no tensor {name!r}")
        if self.shape(name) != shape:
            raise CheckError(
                f"delta blob {self.key}: {name!r} has shape {self.shape(name)}, the master {shape}"
            )
        if self.encoding == "none":
            if self.file.dtype(name) not in ("BF16", "F32"):
                raise CheckError(f"delta blob {self.key}: {name!r} is {self.file.dtype(name)}")
            return self.file.read(name).reshape(-1)
        values = self.file.read(name).reshape(-1)
        scales = self.file.read(name + "::scale").reshape(-1).astype(np.float32)
        n = math.prod(shape)
        if scales.size != -(-n // self.block):
            raise CheckError(f"delta blob {self.key}: {name!r} has {scales.size} scales")
        if self.encoding == "int8":
            codes = values.astype(np.float32)
        else:
            pairs = np.stack((values & 15, values >> 4), axis=1).reshape(-1)[:n]
            if np.any(pairs == 0):
                raise CheckError(f"delta blob {self.key}: {name!r} holds an int4 code of -8")
            codes = pairs.astype(np.float32) - np.float32(8)
        return codes * np.repeat(scales, self.block)[:n]


# ------------------------------------------------------------------------- block order
def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def space_digest(n_windows: int, block_size: int, seed: int) -> str:
    """sha256 of the permutation version and (N, K, seed) as 8-byte big-endian integers."""
    h = hashlib.sha256(PERMUTATION_VERSION.encode() + b"\0")
    for value in (n_windows, block_size, seed):
        h.update(int(value).to_bytes(8, "big"))
    return h.hexdigest()


def block_order(n_blocks: int, seed: int, epoch: int) -> np.ndarray:
    """Block id at each position of an epoch: Durstenfeld's shuffle of 0..M-1, swap targets
    drawn from splitmix64 (the epoch's seed) with Lemire's bounded draw and rejection."""
    if epoch:
        seed = _mix64(seed ^ ((epoch * _EPOCH_SALT) & _MASK64))
    order = list(range(n_blocks))
    drawn = 0
    for i in range(n_blocks - 1, 0, -1):
        bound = i + 1
        while True:
            drawn += 1
            product = _mix64((seed + drawn * _GAMMA) & _MASK64) * bound
            if (product & _MASK64) >= (1 << 64) % bound:
                break
        j = product >> 64
        order[i], order[j] = order[j], order[i]
    return np.array(order, dtype=np.int64)


# ------------------------------------------------------------------------- ledger replay
@dataclass
class Lease:
    lease_id: int
    site: str
    round_no: int
    epoch: int
    start: int
    end: int
    expires_at: float
    ttl_s: float
    ranks: int
    consumed: int = 0
    status: str = "active"
    commit_now: float | None = None


@dataclass
class SiteFigures:
    granted: int = 0
    committed: int = 0  # by the replayed commit events
    reclaimed: int = 0
    held: int = 0


class Refused(Exception):
    """An event the lease rules refuse."""


@dataclass
class LedgerReplay:
    """The lease book rebuilt from the event log: positions are pooled, leased or committed.

    Two epochs may be open: a grant marked ``ahead`` (an early lease) that finds the current
    epoch's positions all leased or committed takes the next epoch's lowest pooled run.
    """

    n_blocks: int
    epoch: int = 0
    owner: np.ndarray = field(init=False)  # the current epoch's positions
    owner_ahead: np.ndarray | None = None  # the next epoch's, once a grant leased ahead
    leases: dict[int, Lease] = field(default_factory=dict)
    active: dict[int, Lease] = field(default_factory=dict)
    registered: set[str] = field(default_factory=set)
    next_id: int = 1
    sites: dict[str, SiteFigures] = field(default_factory=dict)
    commits: Counter = field(default_factory=Counter)  # (epoch, position) -> commit events
    duplicate_commit_events: list[tuple[int, int]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    events: int = 0

    def __post_init__(self) -> None:
        self.owner = np.full(self.n_blocks, POOLED, dtype=np.int64)

    def figures(self, site: str) -> SiteFigures:
        return self.sites.setdefault(site, SiteFigures())

    def apply(self, seq: int, op: str, args: dict[str, Any]) -> None:
        self.events += 1
        handler = getattr(self, f"_on_{op}", None)
        if handler is None:
            self.refused.append(f"ledger event {seq}: unknown op {op!r}")
            return
        try:
            handler(seq, args)
        except (Refused, KeyError, TypeError) as exc:
            self.refused.append(f"ledger event {seq} ({op} {json.dumps(args)}) refused: {exc}")

    # ---- rules
    def _site(self, site: str) -> SiteFigures:
        if site not in self.registered:
            raise Refused(f"site {site!r} never registered")
        return self.figures(site)

    def _not_holding(self, site: str, round_no: int) -> None:
        held = [v for v in self.active.values() if v.site == site]
        if len(held) >= 2 or any(v.round_no >= round_no for v in held):
            raise Refused(f"site {site!r} holds leases {[v.lease_id for v in held]}")

    def _owned(self, lease_id: int, site: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise Refused(f"no lease {lease_id}")
        if lease.site != site:
            raise Refused(f"lease {lease_id} belongs to {lease.site!r}")
        return lease

    def _owners(self, epoch: int) -> np.ndarray:
        if epoch == self.epoch:
            return self.owner
        if epoch == self.epoch + 1 and self.owner_ahead is not None:
            return self.owner_ahead
        raise Refused(f"epoch {epoch} is not open")

    def _live(self, lease: Lease, now: float) -> None:
        try:
            self._owners(lease.epoch)
        except Refused:
            raise Refused(f"lease {lease.lease_id} is from epoch {lease.epoch}") from None
        if lease.status != "active" or now >= lease.expires_at:
            raise Refused(f"lease {lease.lease_id} is {lease.status}, expires {lease.expires_at}")

    def _new_lease(self, site: str, args: dict[str, Any], start: int, end: int, epoch: int) -> None:
        lease = Lease(
            self.next_id, site, int(args["round_no"]), epoch, start, end,
            float(args["now"]) + float(args["ttl_s"]), float(args["ttl_s"]),
            int(args.get("ranks") or 1),
        )  # fmt: skip
        self.next_id += 1
        self.leases[lease.lease_id] = self.active[lease.lease_id] = lease
        self._owners(epoch)[start:end] = lease.lease_id
        self.figures(site).granted += end - start

    def _give_back(self, lease: Lease, start: int, status: str | None) -> None:
        """Positions [start, end) of ``lease`` go back to the pool; close it with ``status``."""
        self._owners(lease.epoch)[start : lease.end] = POOLED
        self.figures(lease.site).reclaimed += lease.end - start
        if status is not None:
            lease.status = status
            del self.active[lease.lease_id]

    @staticmethod
    def _renew(lease: Lease, args: dict[str, Any], consumed: int) -> None:
        """The lease at ``consumed``, its TTL (``args``' own, if it carries one) from now."""
        if args.get("ttl_s") is not None:
            lease.ttl_s = float(args["ttl_s"])
        lease.consumed = consumed
        lease.expires_at = float(args["now"]) + lease.ttl_s

    # ---- events
    def _on_register(self, seq: int, args: dict[str, Any]) -> None:
        self.registered.add(args["site"])

    def _on_grant(self, seq: int, args: dict[str, Any]) -> None:
        site = args["site"]
        self._site(site)
        self._not_holding(site, int(args["round_no"]))
        want = int(args["n_blocks"])
        if want < 1:
            raise Refused(f"n_blocks {want}")
        epoch, pooled = self.epoch, self.owner == POOLED
        if not pooled.any() and args.get("ahead"):
            if self.owner_ahead is None:
                self.owner_ahead = np.full(self.n_blocks, POOLED, dtype=np.int64)
            epoch, pooled = self.epoch + 1, self.owner_ahead == POOLED
        if not pooled.any():
            return  # pool empty: no lease
        start = int(np.argmax(pooled))
        run = int(np.argmin(pooled[start:])) if not pooled[start:].all() else self.n_blocks - start
        self._new_lease(site, args, start, start + min(run, want), epoch)

    def _on_steal(self, seq: int, args: dict[str, Any]) -> None:
        site = args["site"]
        self._site(site)
        self._not_holding(site, int(args["round_no"]))
        if (self.owner == POOLED).any():
            raise Refused("blocks are pooled; a steal needs an empty pool")
        # blocks the coordinator judged each holder trained since its last heartbeat
        ahead = {int(k): int(v) for k, v in (args.get("ahead") or {}).items()}
        victim, rest = None, 0
        for lease in self.active.values():  # ascending lease id
            trained = lease.consumed + max(0, ahead.get(lease.lease_id, 0))
            lease_rest = lease.end - lease.start - trained - 1
            if lease.site != site and lease.epoch == self.epoch and lease_rest > rest:
                victim, rest = lease, lease_rest
        if victim is None:
            return
        tail = rest - rest // 2
        victim.end -= tail
        self.figures(victim.site).granted -= tail
        self._new_lease(site, args, victim.end, victim.end + tail, self.epoch)

    def _on_heartbeat(self, seq: int, args: dict[str, Any]) -> None:
        lease = self._owned(int(args["lease_id"]), args["site"])
        now = float(args["now"])
        self._live(lease, now)
        consumed = int(args["consumed"])
        if not lease.consumed <= consumed <= lease.end - lease.start:
            raise Refused(
                f"consumed {consumed} outside [{lease.consumed}, {lease.end - lease.start}]"
            )
        self._renew(lease, args, consumed)

    def _on_adopt(self, seq: int, args: dict[str, Any]) -> None:
        """A restarted site takes over its live lease: its progress starts again from 0."""
        lease = self._owned(int(args["lease_id"]), args["site"])
        now = float(args["now"])
        self._live(lease, now)
        if int(args["consumed"]) != lease.consumed:
            raise Refused(
                f"adopted at consumed {args['consumed']}, the lease is at {lease.consumed}"
            )
        self._renew(lease, args, 0)

    def _on_revive(self, seq: int, args: dict[str, Any]) -> None:
        """A lease heard from after its TTL lives again, if its positions are all pooled;
        its progress is the larger of the one reported and the one it had."""
        lease = self._owned(int(args["lease_id"]), args["site"])
        owners = self._owners(lease.epoch)
        consumed = int(args["consumed"])
        if consumed > lease.end - lease.start:
            raise Refused(f"consumed {consumed} > {lease.end - lease.start} blocks")
        if lease.status == "expired":  # at most two per site, one per round, any order
            held = [v for v in self.active.values() if v.site == lease.site]
            if len(held) >= 2 or any(v.round_no == lease.round_no for v in held):
                raise Refused(f"site {lease.site!r} holds leases {[v.lease_id for v in held]}")
            if (owners[lease.start : lease.end] != POOLED).any():
                raise Refused(f"lease {lease.lease_id}'s positions were granted since it expired")
            owners[lease.start : lease.end] = lease.lease_id
            self.figures(lease.site).granted += lease.end - lease.start
            lease.status = "active"
            self.active[lease.lease_id] = lease
        elif lease.status != "active":
            raise Refused(f"lease {lease.lease_id} is {lease.status}")
        self._renew(lease, args, max(consumed, lease.consumed))

    def _on_commit(self, seq: int, args: dict[str, Any]) -> None:
        lease = self._owned(int(args["lease_id"]), args["site"])
        consumed = int(args["consumed"])
        if lease.status == "committed":  # the coordinator commits a lease once
            self.duplicate_commit_events.append((seq, lease.lease_id))
            for position in range(lease.start, lease.start + lease.consumed):
                self.commits[lease.epoch, position] += 1
            return
        now = float(args["now"])
        self._live(lease, now)
        if consumed > lease.end - lease.start:
            raise Refused(f"consumed {consumed} > {lease.end - lease.start} blocks")
        cut = lease.start + consumed
        self._owners(lease.epoch)[lease.start : cut] = COMMITTED
        for position in range(lease.start, cut):
            self.commits[lease.epoch, position] += 1
        self.figures(lease.site).committed += consumed
        lease.consumed, lease.commit_now = consumed, now
        self._give_back(lease, cut, "committed")

    def _on_release(self, seq: int, args: dict[str, Any]) -> None:
        lease = self._owned(int(args["lease_id"]), args["site"])
        if lease.status == "active":
            self._give_back(lease, lease.start, "released")

    def _on_expire(self, seq: int, args: dict[str, Any]) -> None:
        now = float(args["now"])
        for lease in [v for v in self.active.values() if v.expires_at <= now]:
            self._give_back(lease, lease.start, "expired")

    def _on_grace(self, seq: int, args: dict[str, Any]) -> None:
        now = float(args["now"])
        for lease in self.active.values():
            lease.expires_at = max(lease.expires_at, now + lease.ttl_s)

    def _on_next_epoch(self, seq: int, args: dict[str, Any]) -> None:
        if not (self.owner == COMMITTED).all():
            raise Refused(f"epoch {self.epoch} has {(self.owner != COMMITTED).sum()} blocks open")
        if self.owner_ahead is None:
            self.owner[:] = POOLED
        else:
            self.owner, self.owner_ahead = self.owner_ahead, None
        self.epoch += 1


# ------------------------------------------------------------------------- the outer step
def outer_rate(outer: dict[str, Any], shares: list[float]) -> tuple[float, float]:
    """(eta, beta) of a round with these token shares, by the run spec's outer preset."""
    preset = outer.get("preset")
    if preset == "average":
        return 1.0, 0.0
    if preset == "tuned":
        return 1.0 / math.sqrt(1.0 / sum(p * p for p in shares)), 0.0
    if preset == "paper":
        solo = len(shares) == 1 and outer.get("solo_full_step", True)
        return (1.0 if solo else float(outer["eta"])), float(outer["beta"])
    raise CheckError(f"outer preset {preset!r} is not one this checker knows")


def fused_multiply_add(a: np.ndarray, b: float, c: np.ndarray) -> np.ndarray:
    """a * b + c for fp32 operands, rounded once to fp32 (the product is exact in float64)."""
    return (a.astype(np.float64) * np.float64(np.float32(b)) + c).astype(np.float32)


def outer_step(
    w: np.ndarray,
    b: np.ndarray | None,
    deltas: list[np.ndarray],
    shares: list[float],
    eta: float,
    beta: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 1 on flat fp32 arrays (``b`` None before the first step):
    s = sum p_i delta_i (g = -s), b <- beta b + g (b = g at first), w <- w - eta (g + beta b).

    The master and momentum are fp32, as the coordinator keeps them; each operation is
    rounded to fp32 in the order written (s, then b, then s - beta b, then w), products and
    sums fused, so an fp32 run of the same formula agrees to the last bit or so."""
    w_out = np.empty_like(w)
    b_out = np.empty_like(w)
    for lo in range(0, w.size, CHUNK):
        hi = min(lo + CHUNK, w.size)
        s = deltas[0][lo:hi] * np.float32(shares[0])
        for delta, share in zip(deltas[1:], shares[1:], strict=True):
            s = fused_multiply_add(delta[lo:hi], share, s)
        momentum = -s if b is None else b[lo:hi] * np.float32(beta) - s
        s = fused_multiply_add(momentum, -beta, s)  # s - beta b = -(g + beta b)
        b_out[lo:hi] = momentum
        w_out[lo:hi] = fused_multiply_add(s, eta, w[lo:hi])
    return w_out, b_out


def row_weights(
    parts: list[DeltaBlob], shares: list[float], name: str, shape: tuple[int, ...]
) -> np.ndarray | None:
    """Each contributor's weight on each row of ``name`` (contributors by rows, fp32): its
    count over the row's total where any contributor counted the row, its token share where
    none did; None unless every contributor counted the rows."""
    if not shape:
        return None
    counts = [p.row_counts(name, shape[0]) for p in parts]
    if any(c is None for c in counts):
        return None
    n = np.stack(counts)
    total = n.sum(axis=0)
    seen = total > 0
    share = np.asarray(shares, dtype=np.float64)[:, None]
    return np.where(seen, n / np.where(seen, total, 1.0), share).astype(np.float32)


def weighted_rows(
    deltas: list[np.ndarray], weights: np.ndarray, shape: tuple[int, ...]
) -> np.ndarray:
    """sum_i weights[i, row] * delta_i, row by row, as flat fp32 values: each product
    rounded to fp32, then added to the sum so far (rounded to fp32)."""
    width = math.prod(shape) // shape[0]
    out = np.zeros(math.prod(shape), dtype=np.float32)
    for delta, w in zip(deltas, weights, strict=True):
        out = out + delta.astype(np.float32) * np.repeat(w, width)
    return out


# ------------------------------------------------------------------------- the check
@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def problem(self, text: str) -> None:
        self.problems.append(text)


def _connect(path: Path) -> sqlite3.Connection:
    if not path.exists():
        raise CheckError(f"no coordinator state at {path}")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    conn.row_factory = sqlite3.Row
    conn.execute("BEGIN")  # one snapshot for every read, even of a live coordinator's file
    return conn


def _blob_path(state_dir: Path, key: str) -> Path:
    algo, _, hexdigest = key.rpartition(":")
    return state_dir / "blobs" / (algo or "sha256") / hexdigest[:2] / hexdigest


def check(
    state_dir: Path,
    final_model: Path | None = None,
    *,
    rebuild: bool = True,
    tolerance: float = TOLERANCE,
) -> dict[str, Any]:
    """Check a coordinator state directory; the result's ``ok`` is False when any problem was
    found (``problems`` says what)."""
    state_dir = Path(state_dir)
    report = Report()
    conn = _connect(state_dir / "state.sqlite")
    try:
        meta = {r["key"]: json.loads(r["value"]) for r in conn.execute("SELECT * FROM meta")}
        if "spec" not in meta:
            raise CheckError(f"{state_dir} holds no run (no spec in its meta table)")
        spec = meta["spec"]
        rounds = {r["round_no"]: dict(r) for r in conn.execute("SELECT * FROM rounds")}
        deltas = [dict(r) for r in conn.execute("SELECT * FROM deltas ORDER BY lease_id")]
        events = conn.execute("SELECT seq, op, args FROM darl_events ORDER BY seq")
        n_blocks = -(-int(spec["n_windows"]) // int(spec["block_size"]))
        ledger = LedgerReplay(n_blocks)
        for seq, op, args in events:
            ledger.apply(seq, op, json.loads(args))
        audit = [
            tuple(r)
            for r in conn.execute("SELECT epoch, block, site, lease_id FROM darl_committed")
        ]
        binding = dict(conn.execute("SELECT key, value FROM darl_meta").fetchall())
    finally:
        conn.close()
    generation = int(meta.get("generation", 0))
    for text in ledger.refused:
        report.problem(text)
    _check_binding(report, spec, binding, n_blocks)
    orders = _BlockOrders(n_blocks, int(spec["data_seed"]))
    _check_blocks(report, ledger, deltas, audit, orders)
    _check_sums(report, ledger, deltas, audit, rounds, generation)
    _check_rounds(report, ledger, deltas, rounds, generation, meta, spec)
    _check_claims(report, ledger, deltas, orders, spec)
    _check_final_global(report, state_dir, generation)
    report.figures.update(replay_max_error=None, replay_momentum_max_error=None, rounds_replayed=0)
    if rebuild:
        _rebuild(report, state_dir, final_model, deltas, generation, spec, tolerance)
    problems = report.problems
    if len(problems) > MAX_PROBLEMS:
        problems = problems[:MAX_PROBLEMS] + [f"... and {len(problems) - MAX_PROBLEMS} more"]
    headline = (
        "blocks_lost", "blocks_duplicated", "site_sum_mismatch", "granted_mismatch",
        "late_commits", "round_mismatches", "replay_max_error", "rounds_replayed",
    )  # fmt: skip
    return {
        "ok": not report.problems,
        **{key: report.figures[key] for key in headline},
        **report.figures,
        "generation": generation,
        "epochs_finished": ledger.epoch,
        "n_blocks": n_blocks,
        "ledger_events": ledger.events,
        "deltas_accepted": len(deltas),
        "problems": problems,
    }


class _BlockOrders(dict):
    """epoch -> block order, computed when first asked for."""

    def __init__(self, n_blocks: int, seed: int) -> None:
        super().__init__()
        self.n_blocks, self.seed = n_blocks, seed

    def __missing__(self, epoch: int) -> np.ndarray:
        self[epoch] = block_order(self.n_blocks, self.seed, epoch)
        return self[epoch]


def _check_binding(report: Report, spec: dict, binding: dict[str, str], n_blocks: int) -> None:
    """The ledger's block-space binding, where one was recorded, is the spec's."""
    want = space_digest(int(spec["n_windows"]), int(spec["block_size"]), int(spec["data_seed"]))
    have = binding.get("space_digest")
    if have is not None and have != want:
        report.problem(f"ledger bound to block space {have}, the spec's is {want}")
    have = binding.get("n_blocks")
    if have is not None and have != str(n_blocks):
        report.problem(f"ledger bound to {have} blocks, the spec gives {n_blocks}")


def _check_blocks(
    report: Report,
    ledger: LedgerReplay,
    deltas: list[dict],
    audit: list[tuple],
    orders: _BlockOrders,
) -> None:
    """Each (epoch, block) once in commit events, accepted deltas and the audit table."""
    by_events: Counter = Counter()
    for (epoch, position), count in ledger.commits.items():
        by_events[epoch, int(orders[epoch][position])] += count
    by_deltas: Counter = Counter()
    for delta in deltas:
        lease = ledger.leases.get(delta["lease_id"])
        if lease is None:
            report.problem(
                f"accepted delta of lease {delta['lease_id']}: the ledger never granted it"
            )
            continue
        for position in range(lease.start, min(lease.end, lease.start + delta["consumed"])):
            by_deltas[lease.epoch, int(orders[lease.epoch][position])] += 1
    by_audit: Counter = Counter((int(e), int(b)) for e, b, _, _ in audit)
    for epoch, block, site, lease_id in audit:
        lease = ledger.leases.get(lease_id)
        held = lease is not None and lease.epoch == epoch and lease.site == site
        mine = held and block in orders[epoch][lease.start : lease.start + lease.consumed]
        if not mine:
            report.problem(f"audit row epoch {epoch} block {block} ({site}, lease {lease_id}) "
                           "is not a block that lease committed")  # fmt: skip
    for seq, lease_id in ledger.duplicate_commit_events:
        report.problem(f"ledger event {seq} commits lease {lease_id} a second time")
    keys = set(by_events) | set(by_deltas) | set(by_audit)
    keys |= {(e, b) for e in range(ledger.epoch) for b in range(ledger.n_blocks)}
    duplicated = lost = 0
    for key in sorted(keys):
        counts = (by_events[key], by_deltas[key], by_audit[key])
        if max(counts) > 1:
            duplicated += max(counts) - 1
            report.problem(f"epoch {key[0]} block {key[1]} committed more than once "
                           f"(events, deltas, audit: {counts})")  # fmt: skip
        if min(counts) == 0:
            lost += 1
            report.problem(f"epoch {key[0]} block {key[1]} missing a commit "
                           f"(events, deltas, audit: {counts})")  # fmt: skip
    report.figures.update(blocks_duplicated=duplicated, blocks_lost=lost)


def _check_sums(
    report: Report,
    ledger: LedgerReplay,
    deltas: list[dict],
    audit: list[tuple],
    rounds: dict[int, dict],
    generation: int,
) -> None:
    """Per-site sums against run totals, and granted = committed + reclaimed + held."""
    for lease in ledger.active.values():
        ledger.figures(lease.site).held += lease.end - lease.start
    committed = Counter()
    tokens = Counter()
    for delta in deltas:
        committed[delta["site"]] += delta["consumed"]
        if delta["round_no"] <= generation:
            tokens[delta["site"]] += delta["tokens"]
    audited = Counter(site for _, _, site, _ in audit)
    total_blocks = ledger.epoch * ledger.n_blocks + int((ledger.owner == COMMITTED).sum())
    if ledger.owner_ahead is not None:
        total_blocks += int((ledger.owner_ahead == COMMITTED).sum())
    merged_tokens = sum(
        (json.loads(r["report"] or "{}").get("tokens") or 0)
        for n, r in rounds.items()
        if r["status"] == "closed"
    )
    mismatches = 0
    for what, by_site, total in (
        ("blocks committed (accepted deltas)", committed, total_blocks),
        ("blocks committed (audit table)", audited, total_blocks),
        ("tokens merged (accepted deltas vs merge reports)", tokens, merged_tokens),
    ):
        if sum(by_site.values()) != total:
            mismatches += 1
            report.problem(
                f"{what}: sites sum to {sum(by_site.values())}, the run's total is {total}"
            )
    granted_mismatch = 0
    sites = {}
    for site in sorted(set(ledger.sites) | set(committed)):
        fig = ledger.figures(site)
        sites[site] = {
            "granted": fig.granted, "committed": committed[site], "reclaimed": fig.reclaimed,
            "held": fig.held, "tokens": tokens[site],
        }  # fmt: skip
        if fig.granted != committed[site] + fig.reclaimed + fig.held:
            granted_mismatch += 1
            report.problem(
                f"{site}: granted {fig.granted} != committed {committed[site]} (accepted deltas) "
                f"+ reclaimed {fig.reclaimed} + held {fig.held}"
            )
    report.figures.update(
        site_sum_mismatch=mismatches,
        granted_mismatch=granted_mismatch,
        blocks_granted=sum(s["granted"] for s in sites.values()),
        blocks_committed=total_blocks,
        blocks_reclaimed=sum(s["reclaimed"] for s in sites.values()),
        blocks_held=sum(s["held"] for s in sites.values()),
        tokens_merged=merged_tokens,
        sites=sites,
    )


def _check_rounds(
    report: Report,
    ledger: LedgerReplay,
    deltas: list[dict],
    rounds: dict[int, dict],
    generation: int,
    meta: dict,
    spec: dict,
) -> None:
    """Deltas in their leases' rounds; merge reports naming exactly their rounds' deltas."""
    late = 0
    seen: set[tuple[int, str]] = set()
    for delta in deltas:
        lease = ledger.leases.get(delta["lease_id"])
        row = rounds.get(delta["round_no"])
        why = []
        if lease is not None and lease.round_no != delta["round_no"]:
            why.append(f"its lease is of round {lease.round_no}")
        if lease is not None and lease.site != delta["site"]:
            why.append(f"its lease is {lease.site!r}'s")
        if lease is not None and lease.consumed != delta["consumed"]:
            why.append(f"its lease committed {lease.consumed} blocks, not {delta['consumed']}")
        if lease is not None and lease.commit_now != delta["accepted_at"]:
            why.append(f"its commit event is at {lease.commit_now}, not {delta['accepted_at']}")
        if row is None:
            why.append("no such round")
        else:
            if delta["generation"] != row["generation"]:
                why.append(f"trained from generation {delta['generation']}, "
                           f"the round's is {row['generation']}")  # fmt: skip
            if delta["accepted_at"] < row["opened_at"]:
                why.append(f"accepted at {delta['accepted_at']}, before the round opened")
            if row["closed_at"] is not None and delta["accepted_at"] > row["closed_at"]:
                why.append(f"accepted at {delta['accepted_at']}, after the round closed")
        if delta["round_no"] > generation + 1:
            why.append(f"round {delta['round_no']} is past the open round {generation + 1}")
        if (delta["round_no"], delta["site"]) in seen:
            why.append("a second delta of this site in this round")
        seen.add((delta["round_no"], delta["site"]))
        if why:
            late += 1
            report.problem(f"delta of lease {delta['lease_id']} ({delta['site']}) for round "
                           f"{delta['round_no']}: {'; '.join(why)}")  # fmt: skip
    mismatched = 0
    step = 0
    for round_no in range(1, generation + 2):
        row = rounds.get(round_no)
        if row is None:
            mismatched += 1
            report.problem(f"round {round_no} is missing from the rounds table")
            continue
        why = []
        if row["generation"] != round_no - 1:
            why.append(f"opened at generation {row['generation']}")
        if row["global_step"] != step:
            why.append(f"starts at global step {row['global_step']}, expected {step}")
        want_status = "closed" if round_no <= generation else "open"
        if row["status"] != want_status:
            why.append(f"is {row['status']}, expected {want_status}")
        mine = [d for d in deltas if d["round_no"] == round_no]
        if round_no <= generation:
            got = json.loads(row["report"] or "{}")
            why += _report_differences(got, mine, round_no, step, spec)
            step = step + max((d["steps"] for d in mine), default=spec["inner_steps"])
        if why:
            mismatched += 1
            report.problem(f"round {round_no}: {'; '.join(why)}")
    if meta.get("global_step") != step:
        mismatched += 1
        report.problem(f"meta global_step {meta.get('global_step')}, the rounds give {step}")
    extra = sorted(n for n in rounds if n > generation + 1)
    if extra:
        mismatched += 1
        report.problem(f"rounds {extra} exist past the open round {generation + 1}")
    report.figures.update(late_commits=late, round_mismatches=mismatched)


def _report_differences(
    got: dict, mine: list[dict], round_no: int, step: int, spec: dict
) -> list[str]:
    """How a merge report differs from the deltas accepted for its round."""
    why = []
    tokens = [d["tokens"] for d in mine]
    if got.get("contributors") != [d["site"] for d in mine]:
        why.append(f"report names {got.get('contributors')}, accepted deltas are from "
                   f"{[d['site'] for d in mine]}")  # fmt: skip
    if got.get("tokens") != sum(tokens):
        why.append(f"report says {got.get('tokens')} tokens, accepted deltas hold {sum(tokens)}")
    if got.get("generation") != round_no:
        why.append(f"report's generation is {got.get('generation')}")
    if sum(tokens) > 0:
        shares = [n / sum(tokens) for n in tokens]
        reported = got.get("shares") or []
        if len(reported) != len(shares) or any(
            abs(a - b) > 1e-12 for a, b in zip(reported, shares, strict=True)
        ):
            why.append(f"report's shares {reported}, the tokens give {shares}")
        eta, _ = outer_rate(spec["outer"], shares)
        if got.get("eta") is None or abs(got["eta"] - eta) > 1e-12:
            why.append(f"report's outer rate {got.get('eta')}, the preset gives {eta}")
    after = step + max((d["steps"] for d in mine), default=spec["inner_steps"])
    if got.get("global_step") != after:
        why.append(f"report's global step {got.get('global_step')}, the deltas give {after}")
    return why


def _check_claims(
    report: Report, ledger: LedgerReplay, deltas: list[dict], orders: _BlockOrders, spec: dict
) -> None:
    """Tokens and steps no larger than the committed blocks' windows allow."""
    n_windows, size = int(spec["n_windows"]), int(spec["block_size"])
    last_block_windows = n_windows - (ledger.n_blocks - 1) * size
    for delta in deltas:
        lease = ledger.leases.get(delta["lease_id"])
        if lease is None:
            continue
        blocks = orders[lease.epoch][lease.start : lease.start + delta["consumed"]]
        windows = sum(last_block_windows if b == ledger.n_blocks - 1 else size for b in blocks)
        if delta["tokens"] > windows * int(spec["seq_len"]) or delta["tokens"] < 1:
            report.problem(f"delta of lease {delta['lease_id']} claims {delta['tokens']} tokens "
                           f"from {windows} windows")  # fmt: skip
        if not 1 <= delta["steps"] <= -(-windows // lease.ranks):
            report.problem(f"delta of lease {delta['lease_id']} claims {delta['steps']} steps "
                           f"from {windows} windows on {lease.ranks} rank(s)")  # fmt: skip


def _model_path(state_dir: Path, kind: str, generation: int) -> Path:
    return state_dir / "models" / f"{kind}-{generation:06d}.safetensors"


def _check_final_global(report: Report, state_dir: Path, generation: int) -> None:
    """The published bf16 model of the last generation is its fp32 master, rounded."""
    master_path = _model_path(state_dir, "master", generation)
    global_path = _model_path(state_dir, "global", generation)
    if not master_path.exists():
        report.problem(f"the last generation's master {master_path.name} is missing")
        return
    if not global_path.exists():
        return  # a generation's global model may be pruned by --keep-models; the master stays
    master, published = SafetensorsFile(master_path), SafetensorsFile(global_path)
    names = [n for n in master.names() if not n.startswith(MOMENTUM_PREFIX)]
    model_names = [n for n in published.names() if not n.startswith(MOMENTS_PREFIX)]
    if sorted(names) != sorted(model_names):
        report.problem(f"{global_path.name} and {master_path.name} hold different tensors")
        return
    differing = sum(int((to_bf16(master.read(n)) != published.read(n)).sum()) for n in names)
    if differing:
        report.problem(
            f"{global_path.name}: {differing} values are not its master's, rounded to bf16"
        )


def _check_factors(
    report: Report, model: SafetensorsFile, parts: list, shares: list[float], spec: dict
) -> None:
    """The last global model's second-moment factors: under ``second_moment: shared`` the
    token-weighted mean of its round's deltas' factors (those that carry them), else none."""
    published = [n for n in model.names() if n.startswith(MOMENTS_PREFIX)]
    if spec.get("second_moment", "own") != "shared":
        if published:
            report.problem(f"a run without shared second moments published {len(published)} "
                           "second-moment factors")  # fmt: skip
        return
    carried = [(p, w) for p, w in zip(parts, shares, strict=True) if p.factors]
    want = sorted({n for p, _ in carried for n in p.factors})
    if sorted(published) != want:
        report.problem(f"the last global model holds {len(published)} second-moment factors, "
                       f"its round's deltas {len(want)}")  # fmt: skip
        return
    worst = 0.0
    for name in want:
        holders = [(p, w) for p, w in carried if name in p.factors]
        total = sum(w for _, w in holders)
        mean = sum(p.file.read(name).astype(np.float64) * (w / total) for p, w in holders)
        got = model.read(name).astype(np.float64)
        worst = max(worst, float(np.max(np.abs(got - mean) / (np.abs(mean) + 1e-30), initial=0)))
    report.figures["factors_max_rel_error"] = worst
    if worst > 1e-5:
        report.problem(f"the last global model's second-moment factors are {worst:.2e} (relative) "
                       "from the token-weighted mean of its round's deltas' factors")  # fmt: skip


def _rebuild(
    report: Report,
    state_dir: Path,
    final_model: Path | None,
    deltas: list[dict],
    generation: int,
    spec: dict,
    tolerance: float,
) -> None:
    """Generation 0 plus every merged round's deltas through Eq. 1, against the final model."""
    initial = _model_path(state_dir, "master", 0)
    merged = [d for d in deltas if 1 <= d["round_no"] <= generation]
    missing = [d for d in merged if not _blob_path(state_dir, d["blob"]).exists()]
    if not initial.exists():
        report.problem(
            f"cannot rebuild: generation 0's master ({initial.name}) was deleted by retention "
            "(serve the coordinator with --keep-deltas to keep it)"
        )
    for d in missing[:5]:
        report.problem(
            f"cannot rebuild: delta blob {d['blob']} (round {d['round_no']}, {d['site']}, lease "
            f"{d['lease_id']}) was deleted by retention (serve the coordinator with --keep-deltas)"
        )
    if len(missing) > 5:
        report.problem(f"cannot rebuild: {len(missing) - 5} more delta blobs were deleted")
    if missing or not initial.exists():
        return
    try:
        blobs = {d["blob"]: DeltaBlob(_blob_path(state_dir, d["blob"]), d["blob"]) for d in merged}
        start = SafetensorsFile(initial)
        final_master = SafetensorsFile(_model_path(state_dir, "master", generation))
        model_path = final_model or _model_path(state_dir, "global", generation)
        model = SafetensorsFile(model_path) if model_path.exists() else None
    except (CheckError, OSError, ValueError) as exc:
        report.problem(f"cannot rebuild: {exc}")
        return
    if model is None:
        report.problem(f"cannot compare: no final model at {model_path}")
    names = [n for n in start.names() if not n.startswith(MOMENTUM_PREFIX)]
    for blob in blobs.values():
        if sorted(blob.params) != sorted(names):
            report.problem(
                f"cannot rebuild: delta blob {blob.key} holds other tensors than the master"
            )
            return
    plan = []
    for round_no in range(1, generation + 1):
        mine = [d for d in merged if d["round_no"] == round_no]
        tokens = [d["tokens"] for d in mine if d["tokens"] > 0]
        if not tokens:
            report.problem(f"cannot rebuild: round {round_no} has no accepted delta with tokens")
            return
        shares = [n / sum(tokens) for n in tokens]
        eta, beta = outer_rate(spec["outer"], shares)
        plan.append(([blobs[d["blob"]] for d in mine if d["tokens"] > 0], shares, eta, beta))
    if model is not None:
        _check_factors(report, model, plan[-1][0], plan[-1][1], spec)
    weight_error = momentum_error = model_error = 0.0
    # a run stored before the setting existed weighted every row by the token shares
    by_counts = spec.get("embedding_rows", "shares") == "counts"
    try:
        for name in names:
            shape = start.shape(name)
            w = start.read(name).astype(np.float32).reshape(-1)
            b = None
            if MOMENTUM_PREFIX + name in start.entries:
                b = start.read(MOMENTUM_PREFIX + name).astype(np.float32).reshape(-1)
            for parts, shares, eta, beta in plan:
                deltas = [p.decode(name, shape) for p in parts]
                weights = row_weights(parts, shares, name, shape) if by_counts else None
                if weights is not None:  # the rows' weighted mean, stepped as one contributor
                    deltas, shares = [weighted_rows(deltas, weights, shape)], [1.0]
                w, b = outer_step(w, b, deltas, shares, eta, beta)
            stored = final_master.read(name).reshape(-1).astype(np.float64)
            weight_error = max(weight_error, float(np.max(np.abs(stored - w), initial=0.0)))
            if b is not None and MOMENTUM_PREFIX + name in final_master.entries:
                kept = final_master.read(MOMENTUM_PREFIX + name).reshape(-1).astype(np.float64)
                momentum_error = max(momentum_error, float(np.max(np.abs(kept - b), initial=0.0)))
            if model is not None:
                value = model.read(name).reshape(-1).astype(np.float64)
                excess = np.abs(value - w) - half_ulp(value, model.dtype(name))
                model_error = max(model_error, float(np.max(excess, initial=0.0)))
    except (CheckError, KeyError, ValueError) as exc:
        report.problem(f"cannot rebuild: {exc}")
        return
    error = max(weight_error, model_error)
    report.figures.update(
        replay_max_error=error,
        replay_momentum_max_error=momentum_error,
        replay_master_error=weight_error,
        replay_model_error=model_error,
        rounds_replayed=generation,
        final_model=str(model_path),
    )
    if weight_error > tolerance:
        report.problem(
            f"rebuilt master differs from {final_master.path.name} by {weight_error:.3g}"
        )
    if momentum_error > tolerance:
        report.problem(
            f"rebuilt momentum differs from {final_master.path.name} by {momentum_error:.3g}"
        )
    if model_error > tolerance:
        report.problem(f"rebuilt master differs from {model_path.name} by {model_error:.3g} "
                       "beyond its rounding")  # fmt: skip


# ------------------------------------------------------------------------- entry
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("state_dir", type=Path, help="the coordinator's --state-dir")
    parser.add_argument("--model", type=Path, help="the final global model (default: the "
                        "state's last global-NNNNNN.safetensors)")  # fmt: skip
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help=f"largest rebuild error accepted (default {TOLERANCE})")  # fmt: skip
    parser.add_argument("--no-rebuild", action="store_true",
                        help="check the ledger and rounds only (no master rebuild)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        result = check(
            args.state_dir, args.model, rebuild=not args.no_rebuild, tolerance=args.tolerance
        )
    except (CheckError, OSError, sqlite3.Error, KeyError, ValueError) as exc:
        result = {"ok": False, "problems": [f"cannot check {args.state_dir}: {exc}"]}
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
