"""The delta check made while an uploaded object is hashed (one pass over its bytes): it
vouches for exactly the plain deltas the full check passes, whatever the chunking."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from crossfed import moments
from crossfed.coordinator.deltacheck import StreamingDeltaCheck
from crossfed.outer import validate_delta
from crossfed.wire.codecs import open_delta, save_delta

SHAPES = {"a.w": (7, 5), "b": (13,), "c": (3, 4, 2)}
REFERENCE = {k: torch.empty(v, device="meta") for k, v in SHAPES.items()}


def verdicts(path: Path, rng: random.Random, most: int) -> tuple[bool, bool]:
    """(the streaming check's verdict over random chunks, the full check's)."""
    data = path.read_bytes()
    check = StreamingDeltaCheck(SHAPES)
    at = 0
    while at < len(data):
        size = rng.randint(1, most)
        check.feed(data[at : at + size])
        at += size
    try:
        with open_delta(path) as delta:
            validate_delta(REFERENCE, delta)
        full = True
    except Exception:
        full = False
    return check.passed, full


def test_it_agrees_with_the_full_check_on_random_deltas(tmp_path: Path) -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    seen = {True: 0, False: 0}
    for i in range(300):
        dtypes = [torch.bfloat16, torch.float32, torch.float16]
        tensors = {k: torch.randn(v).to(rng.choice(dtypes[:2])) for k, v in SHAPES.items()}
        change = rng.random()
        name = rng.choice(list(SHAPES))
        if change < 0.3:  # a NaN or an infinity somewhere
            flat = tensors[name].view(-1)
            flat[rng.randrange(flat.numel())] = rng.choice([float("nan"), float("inf")])
        elif change < 0.4:
            del tensors[name]
        elif change < 0.5:
            tensors[name] = torch.randn(tensors[name].numel() + 1)
        elif change < 0.55:
            tensors[name] = tensors[name].to(torch.float16)
        elif change < 0.6:
            tensors["extra"] = torch.zeros(2)
        if rng.random() < 0.5:  # the second-moment factors a site appends (passed over)
            for key, shape in moments.expected_shapes(SHAPES).items():
                tensors[key] = torch.rand(shape) + 1e-6
                if rng.random() < 0.1:
                    tensors[key].view(-1)[0] = float("nan")  # the merge's to judge
        path = tmp_path / f"d{i}.safetensors"
        save_file(tensors, str(path))
        passed, full = verdicts(path, rng, rng.choice([1, 3, 64, 1 << 20]))
        assert passed == full, (i, change, name)
        seen[passed] += 1
    assert seen[True] > 50 and seen[False] > 50


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_codecs_delta_is_left_to_the_full_check(codec: str, tmp_path: Path) -> None:
    master = {k: torch.randn(v) for k, v in SHAPES.items()}
    site = {k: v + 0.01 for k, v in master.items()}
    path = tmp_path / "delta.safetensors"
    save_delta(site, master, path, codec=codec)
    passed, _ = verdicts(path, random.Random(1), 64)
    assert not passed


def test_a_delta_carrying_second_moment_factors_is_vouched_for_in_one_pass(
    tmp_path: Path,
) -> None:
    """A site's delta with the factors it appends (the workflow's default) passes the
    check made while it is hashed, so its submission reads it no second time; a non-finite
    value among the delta's own tensors still fails it."""
    master = {k: torch.randn(v) for k, v in SHAPES.items()}
    factors = {k: torch.rand(v) + 1e-6 for k, v in moments.expected_shapes(SHAPES).items()}
    path = tmp_path / "delta.safetensors"
    save_delta({k: v + 0.01 for k, v in master.items()}, master, path, extra=factors)
    assert verdicts(path, random.Random(2), 64) == (True, True)
    site = {k: v + 0.01 for k, v in master.items()}
    site["b"][3] = float("inf")
    save_delta(site, master, path, extra=factors)
    assert verdicts(path, random.Random(3), 64) == (False, False)


def test_bytes_cut_short_or_trailing_are_not_vouched_for(tmp_path: Path) -> None:
    path = tmp_path / "delta.safetensors"
    save_file({k: torch.randn(v) for k, v in SHAPES.items()}, str(path))
    data = path.read_bytes()
    for body in (data[:-1], data + b"\0\0\0\0"):
        check = StreamingDeltaCheck(SHAPES)
        check.feed(body)
        assert not check.passed
    whole = StreamingDeltaCheck(SHAPES)
    whole.feed(data)
    assert whole.passed
