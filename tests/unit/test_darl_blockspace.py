"""DARL block space: digest, block windows and the seeded Durstenfeld permutation."""

import numpy as np
import pytest

from crossfed.darl.blockspace import (
    BlockSpace,
    BlockSpaceError,
    _swap_targets,
    epoch_seed,
    splitmix64,
)

M64 = (1 << 64) - 1


def ref_splitmix64(seed: int, n: int) -> list[int]:
    """Vigna's splitmix64, one value at a time with Python ints."""
    out, state = [], seed
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        out.append(z ^ (z >> 31))
    return out


def ref_targets(values: list[int], m: int) -> list[int]:
    """Lemire's bounded draw with rejection over a sequential stream, for i = m-1 .. 1."""
    it = iter(values)
    out = []
    for i in range(m - 1, 0, -1):
        s = i + 1
        prod = next(it) * s
        while (prod & M64) < ((1 << 64) - s) % s:
            prod = next(it) * s
        out.append(prod >> 64)
    return out


def ref_permutation(m: int, seed: int) -> list[int]:
    """Textbook Durstenfeld shuffle of range(m)."""
    a = list(range(m))
    targets = ref_targets(ref_splitmix64(seed, 2 * m + 8), m)
    for i, j in zip(range(m - 1, 0, -1), targets, strict=True):
        a[i], a[j] = a[j], a[i]
    return a


def test_splitmix64_matches_reference_vectors():
    # published first outputs for seed 1234567
    assert splitmix64(1234567, np.arange(5)).tolist() == [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]


@pytest.mark.parametrize(
    ("n", "k", "seed", "epoch", "head"),
    [
        (10, 1, 0, 0, [4, 9, 2, 5, 1, 7, 6, 0]),
        (1000, 10, 1234, 0, [37, 39, 84, 20, 60, 56, 92, 17]),
        (1000, 10, 1234, 1, [32, 36, 65, 5, 25, 7, 0, 84]),
        (50000, 7, M64, 3, [5741, 2285, 1798, 4200, 4513, 6542, 7034, 3057]),
    ],
)
def test_golden_permutation(n, k, seed, epoch, head):
    perm = BlockSpace(n, k, seed).permutation(epoch)
    assert perm.dtype == np.int64
    assert perm[:8].tolist() == head


@pytest.mark.parametrize("m", [1, 2, 3, 7, 64, 1000, 4099])
@pytest.mark.parametrize("seed", [0, 1, 99, M64])
def test_permutation_equals_textbook_durstenfeld(m, seed):
    assert BlockSpace(m, 1, seed).permutation().tolist() == ref_permutation(m, seed)


def test_later_epochs_use_derived_seed():
    bs = BlockSpace(300, 1, 5)
    assert epoch_seed(5, 0) == 5
    for e in (1, 2, 17):
        assert bs.permutation(e).tolist() == ref_permutation(300, epoch_seed(5, e))


def test_rejected_draws_shift_the_stream_like_the_sequential_algorithm():
    m, seed = 500, 42
    zeros = {0, 1, 7, 300, 301, 498}  # x = 0 is rejected for every bound that is not 2**k

    def stream(pos: np.ndarray) -> np.ndarray:
        vals = splitmix64(seed, pos)
        vals[np.isin(pos, list(zeros))] = 0
        return vals

    values = [0 if p in zeros else v for p, v in enumerate(ref_splitmix64(seed, 2 * m))]
    assert _swap_targets(stream, m).tolist() == ref_targets(values, m)


def test_permutation_is_a_permutation_and_read_only():
    bs = BlockSpace(123_457, 3, 7)
    perm = bs.permutation()
    assert len(perm) == bs.n_blocks == 41_153
    assert np.array_equal(np.sort(perm), np.arange(bs.n_blocks))
    with pytest.raises(ValueError):
        perm[0] = 1
    assert bs.permutation() is perm  # cached


def test_seeds_and_epochs_differ():
    perms = [BlockSpace(2000, 1, s).permutation(e) for s in (0, 1) for e in (0, 1, 2)]
    for i in range(len(perms)):
        for j in range(i):
            assert not np.array_equal(perms[i], perms[j])


def test_blocks_are_a_span_of_the_epoch_permutation():
    bs = BlockSpace(100, 10, 3)
    assert bs.blocks(2, 5, epoch=1).tolist() == bs.permutation(1)[2:5].tolist()
    assert bs.blocks(4, 4).size == 0
    with pytest.raises(BlockSpaceError):
        bs.blocks(5, 4)
    with pytest.raises(BlockSpaceError):
        bs.blocks(0, 11)


def test_digest_changes_with_every_parameter():
    base = BlockSpace(1000, 10, 1)
    assert base.digest() == BlockSpace(1000, 10, 1).digest()
    assert len(base.digest()) == 64
    others = [BlockSpace(1001, 10, 1), BlockSpace(1000, 11, 1), BlockSpace(1000, 10, 2)]
    digests = {base.digest(), *(o.digest() for o in others)}
    assert len(digests) == 4
    # fixed-width encoding: no concatenation ambiguity between fields
    assert BlockSpace(11, 1, 1).digest() != BlockSpace(1, 11, 1).digest()


def test_block_windows_and_count():
    bs = BlockSpace(25, 10, 0)
    assert bs.n_blocks == 3
    assert bs.block_windows(0) == range(0, 10)
    assert bs.block_windows(2) == range(20, 25)  # last block is short
    assert BlockSpace(30, 10, 0).n_blocks == 3
    with pytest.raises(BlockSpaceError, match="block"):
        bs.block_windows(3)
    with pytest.raises(BlockSpaceError):
        bs.block_windows(-1)


@pytest.mark.parametrize(
    "args",
    [(0, 1, 0), (10, 0, 0), (10, 1, -1), (10, 1, 1 << 64), (10.0, 1, 0), (True, 1, 0)],
)
def test_bad_parameters_are_named(args):
    with pytest.raises(BlockSpaceError):
        BlockSpace(*args)


def test_bad_epoch():
    with pytest.raises(BlockSpaceError, match="epoch"):
        BlockSpace(10, 1, 0).permutation(-1)


@pytest.mark.slow
def test_ten_million_blocks():
    bs = BlockSpace(10**7, 1, 2024)
    perm = bs.permutation()
    assert np.array_equal(np.bincount(perm, minlength=10**7), np.ones(10**7, dtype=np.int64))
