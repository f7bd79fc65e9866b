"""DARL block space: N sample windows in M = ceil(N/K) blocks, shuffled by a seeded permutation.

The permutation is the Durstenfeld variant of Fisher-Yates driven by a PRNG spelled out here
(splitmix64 plus Lemire's bounded draw with rejection, integer arithmetic only), so every
platform and every numpy version computes the same order for the same (M, seed, epoch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = [
    "PERMUTATION_VERSION",
    "BlockSpace",
    "BlockSpaceError",
    "epoch_seed",
    "splitmix64",
]

PERMUTATION_VERSION = "crossfed.darl.blockspace/v1:splitmix64+lemire64+durstenfeld"

_U64 = np.uint64
_MASK64 = (1 << 64) - 1
_MASK32 = _U64(0xFFFFFFFF)
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64 increment (golden ratio)
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_EPOCH_SALT = 0xD1B54A32D192ED03  # odd constant that spreads epoch numbers over 64 bits
_MAX_BLOCKS = 1 << 32  # bounds stay below 2**32 so the 64x32 product splits cleanly
_CHUNK = 1 << 20


class BlockSpaceError(ValueError):
    """An invalid block space parameter or block index."""


def splitmix64(seed: int, positions: np.ndarray) -> np.ndarray:
    """Outputs number `positions` (0-based) of the splitmix64 stream seeded with `seed`.

    Output n is mix(seed + (n + 1) * GAMMA) with the standard splitmix64 finaliser; the
    stream is counter-based, so any slice of it can be computed without the ones before.
    """
    with np.errstate(over="ignore"):
        z = (positions.astype(_U64) + _U64(1)) * _U64(_GAMMA) + _U64(seed & _MASK64)
        z = (z ^ (z >> _U64(30))) * _U64(_MIX1)
        z = (z ^ (z >> _U64(27))) * _U64(_MIX2)
        return z ^ (z >> _U64(31))


def _mix64(x: int) -> int:
    """The splitmix64 finaliser on one Python int (mod 2**64)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def epoch_seed(seed: int, epoch: int) -> int:
    """The PRNG seed of an epoch: `seed` itself for epoch 0, a mixed (seed, epoch) otherwise."""
    if epoch == 0:
        return seed
    return _mix64(seed ^ ((epoch * _EPOCH_SALT) & _MASK64))


def _lemire(x: np.ndarray, bound: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lemire's multiply-shift draw: (high 64 bits of x*bound, rejected mask), bound < 2**32."""
    with np.errstate(over="ignore"):
        lo_part = (x & _MASK32) * bound  # < 2**64
        hi_part = (x >> _U64(32)) * bound  # < 2**64
        mid = (hi_part & _MASK32) << _U64(32)
        low = mid + lo_part
        carry = (low < mid).astype(_U64)
        high = (hi_part >> _U64(32)) + carry
        maybe = low < bound
        rejected = np.zeros(x.shape, dtype=bool)
        if maybe.any():
            b = bound[maybe]
            threshold = (_U64(0) - b) % b  # 2**64 mod bound
            rejected[maybe] = low[maybe] < threshold
    return high, rejected


def _swap_targets(stream: Callable[[np.ndarray], np.ndarray], m: int) -> np.ndarray:
    """j for each Durstenfeld step i = m-1 .. 1 (in that order): uniform on [0, i].

    Step k (i = m-1-k) takes the next value of `stream`; a rejected draw consumes one more value
    and retries, exactly as the sequential algorithm would, so the rare rejection shifts every
    later step by one stream position.
    """
    n = m - 1
    out = np.empty(max(n, 0), dtype=_U64)
    k = 0
    shift = 0
    while k < n:
        stop = min(n, k + _CHUNK)
        steps = np.arange(k, stop, dtype=_U64)
        bound = _U64(m) - steps  # i + 1
        high, rejected = _lemire(stream(steps + _U64(shift)), bound)
        if rejected.any():
            first = int(np.argmax(rejected))
            out[k : k + first] = high[:first]
            k += first
            shift += 1
            continue
        out[k:stop] = high
        k = stop
    return out


def _apply_swaps(j: np.ndarray) -> np.ndarray:
    """The array Durstenfeld leaves after swapping a[i] with a[j[i]] for i = m-1 .. 1, vectorised.

    Equivalent to the sequential swap loop (the tests check it against one), without an O(m)
    Python loop. After step i, position i is never touched again, so perm[i] is what position
    j[i] held just before step i: the value the most recent earlier step targeting j[i] (the
    smallest i2 > i with j[i2] == j[i]) moved there, or j[i] itself when there was none. The
    value step q moves is what position q held before step q, found the same way; these
    lookups form chains towards larger indices, resolved by pointer jumping.
    `j` is int64 with j[0] == 0 (step 0 is a no-op swap that makes position 0 fit the rule).
    """
    m = j.size
    idx = np.arange(m, dtype=np.int64)
    key = j * m + idx  # unique; sorting groups steps by target, ascending step within a group
    key.sort()
    step = key % m
    target = key // m
    del key
    same = target[1:] == target[:-1]
    next_same = np.full(m, -1, dtype=np.int64)  # smallest later-in-index step, same target
    next_same[step[:-1][same]] = step[1:][same]
    first = np.full(m, -1, dtype=np.int64)  # smallest step targeting each position
    head = np.ones(m, dtype=bool)
    head[1:] = ~same
    first[target[head]] = step[head]
    del step, target, same, head
    # last earlier step that targeted position q (q is the smallest of its group iff j[q] == q)
    before = np.where(j == idx, next_same, first)
    root = np.where(before >= 0, before, idx)
    todo = np.flatnonzero(before >= 0)
    del before
    while todo.size:
        parent = root[todo]
        grand = root[parent]
        root[todo] = grand
        todo = todo[grand != parent]
    return np.where(next_same >= 0, root[np.maximum(next_same, 0)], j)


@lru_cache(maxsize=8)
def _permutation(m: int, seed: int) -> np.ndarray:
    j = np.zeros(m, dtype=np.int64)
    j[1:] = _swap_targets(lambda pos: splitmix64(seed, pos), m)[::-1]
    perm = _apply_swaps(j)
    perm.setflags(write=False)
    return perm


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise BlockSpaceError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value >= hi):
        span = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise BlockSpaceError(f"{name} must be in {span}, got {value}")
    return value


@dataclass(frozen=True)
class BlockSpace:
    """N sample windows in blocks of K consecutive windows, shuffled with seed s."""

    n_windows: int
    block_size: int
    seed: int

    def __post_init__(self) -> None:
        _check_int("n_windows", self.n_windows, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("seed", self.seed, 0, 1 << 64)
        if self.n_blocks >= _MAX_BLOCKS:
            raise BlockSpaceError(f"too many blocks ({self.n_blocks}); at most {_MAX_BLOCKS - 1}")

    @property
    def n_blocks(self) -> int:
        """M = ceil(N / K)."""
        return -(-self.n_windows // self.block_size)

    def digest(self) -> str:
        """Hex sha256 of the versioned, fixed-width encoding of (N, K, s)."""
        h = hashlib.sha256(PERMUTATION_VERSION.encode() + b"\0")
        for v in (self.n_windows, self.block_size, self.seed):
            h.update(int(v).to_bytes(8, "big"))
        return h.hexdigest()

    def permutation(self, epoch: int = 0) -> np.ndarray:
        """The epoch's block order: a read-only int64 permutation of range(M) (cached)."""
        epoch = _check_int("epoch", epoch, 0)
        return _permutation(self.n_blocks, epoch_seed(int(self.seed), epoch))

    def blocks(self, start: int, end: int, epoch: int = 0) -> np.ndarray:
        """Block ids at permutation positions [start, end) of an epoch (read-only view)."""
        start = _check_int("start", start, 0, self.n_blocks + 1)
        end = _check_int("end", end, start, self.n_blocks + 1)
        return self.permutation(epoch)[start:end]

    def block_windows(self, block: int) -> range:
        """Window indices of one block; the last block may be short."""
        block = _check_int("block", block, 0, self.n_blocks)
        lo = block * self.block_size
        return range(lo, min(self.n_windows, lo + self.block_size))
