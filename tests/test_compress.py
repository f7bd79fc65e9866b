"""Blockwise int8 delta compression: error bounds, the file layout, bad files, the merge."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from crossfed.compress import (
    BLOCK_KEY,
    CODEC_KEY,
    CodecError,
    dequantize_int8,
    encode_tensors,
    encoder,
    open_delta,
    quantize_int8,
)
from crossfed.coordinator.service import Coordinator, CoordinatorError
from crossfed.outer import outer_step, validate_delta
from crossfed.transport import digest_file, save_delta
from tests.conftest import chunked, digest_of, staged_delta, tiny_spec


@pytest.mark.parametrize("shape", [(1000,), (37, 29), (3, 256), (1,), (0, 5)])
@pytest.mark.parametrize("block", [1, 64, 256])
def test_int8_error_is_at_most_half_a_step_per_block(shape: tuple[int, ...], block: int) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.01
    q, scale = quantize_int8(x, block)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scale.shape == (-(-x.numel() // block),)
    back = dequantize_int8(q, scale, block)
    assert back.dtype == torch.float32 and back.shape == x.shape
    steps = scale.repeat_interleave(block)[: x.numel()].view(shape)
    assert bool(((back - x).abs() <= steps / 2 + 1e-12).all())
    if x.numel():
        assert int(q.abs().max()) == 127  # each block's largest value uses the full range


def test_zero_blocks_stay_exactly_zero() -> None:
    x = torch.zeros(600)
    x[300] = 5.0
    q, scale = quantize_int8(x, 256)
    assert scale[0] == 0 and scale[2] == 0
    back = dequantize_int8(q, scale, 256)
    assert torch.equal(back[:256], torch.zeros(256)) and back[300] == pytest.approx(5.0)


def test_an_int8_delta_file_is_half_the_size_and_decodes_close(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    ref = {"emb": torch.randn(512, 64, generator=gen), "norm": torch.ones(64)}
    site = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in ref.items()}
    plain, packed = tmp_path / "plain.safetensors", tmp_path / "int8.safetensors"
    save_delta(site, ref, plain)
    digest = save_delta(site, ref, packed, {"site": "lumi"}, codec="int8")
    assert digest == digest_file(packed)
    ratio = packed.stat().st_size / plain.stat().st_size
    assert 0.49 < ratio < 0.53  # 1 byte + 4/256 per value instead of 2
    stored = load_file(str(packed))
    assert set(stored) == {"emb", "emb::scale", "norm", "norm::scale"}
    with open_delta(packed) as delta:
        assert delta.codec == "int8" and sorted(delta.keys()) == ["emb", "norm"]
        for name in ref:
            true = site[name] - ref[name]
            err = (delta[name] - true).norm() / true.norm()
            assert delta[name].dtype == torch.float32 and float(err) < 0.02
        validate_delta(ref, delta)
    with open_delta(plain) as delta:
        assert delta.codec == "none" and delta["emb"].dtype == torch.bfloat16


def _write(path: Path, tensors: dict, meta: dict | None = None) -> Path:
    save_file(tensors, str(path), metadata=meta)
    return path


@pytest.mark.parametrize(
    "tensors, meta, message",
    [
        ({"w": torch.zeros(4, dtype=torch.int8)}, {CODEC_KEY: "int8"}, "no ::scale"),
        (
            {
                "w::scale": torch.ones(1),
                "w": torch.zeros(4, dtype=torch.int8),
                "v::scale": torch.ones(1),
            },
            {CODEC_KEY: "int8"},
            "has no values",
        ),
        (
            {"w": torch.zeros(600, dtype=torch.int8), "w::scale": torch.ones(2)},
            {CODEC_KEY: "int8", BLOCK_KEY: "256"},
            "need 3 scales",
        ),
        (
            {"w": torch.zeros(4), "w::scale": torch.ones(1)},
            {CODEC_KEY: "int8"},
            "stored as torch.float32",
        ),
        ({"w": torch.zeros(4)}, {CODEC_KEY: "zstd"}, "unknown codec"),
        (
            {"w": torch.zeros(4, dtype=torch.int8), "w::scale": torch.ones(1)},
            {CODEC_KEY: "int8", BLOCK_KEY: "-3"},
            "bad crossfed.block",
        ),
    ],
)
def test_malformed_compressed_deltas_are_refused_by_name(
    tmp_path: Path, tensors: dict, meta: dict, message: str
) -> None:
    path = _write(tmp_path / "bad.safetensors", tensors, meta)
    with pytest.raises(CodecError, match=message):
        with open_delta(path) as delta:
            for name in delta.keys():
                delta[name]


def test_unknown_codec_names_are_refused() -> None:
    with pytest.raises(CodecError, match="unknown delta codec"):
        encoder("fp4")
    with pytest.raises(CodecError):
        encode_tensors({"w": torch.zeros(3)}, "int4")


def test_the_coordinator_decodes_int8_deltas_before_validating_and_merging(
    tmp_path: Path, tiny_data: Path
) -> None:
    staged = staged_delta(tmp_path / "state", tiny_data, seed=5, codec="int8")
    coord, now, master0, held = staged.coord, staged.now, staged.master0, staged.held
    path, key, spec = staged.path, staged.key, tiny_spec(tiny_data)
    fields = dict(site="lumi", round_no=1, lease_id=held["lease_id"], generation=0, steps=4)
    reply = coord.submit(**fields, tokens=100, consumed=held["n_blocks"], blob=key)
    assert reply["accepted"]

    now[0] += 60.0
    summary = coord.tick()
    assert summary is not None and summary["generation"] == 1
    expected, momentum = {k: v.clone() for k, v in master0.items()}, {}
    with open_delta(path) as delta:
        outer_step(expected, momentum, [delta], [100], spec.outer)
    assert all(torch.equal(coord.master[k], expected[k]) for k in expected)
    assert all(torch.equal(coord.momentum[k], momentum[k]) for k in momentum)
    assert not coord.blobs.exists(key)  # merged: retention removed it


def test_a_corrupted_int8_delta_is_rejected_before_commit(tmp_path: Path, tiny_data: Path) -> None:
    coord = Coordinator(tmp_path / "state")
    coord.init_run(tiny_spec(tiny_data))
    coord.register("lumi", digest_of(tiny_data), 1, 1.0)
    held = coord.lease("lumi", 1, 2, None, 1.0)["lease"]
    tensors, meta = encode_tensors(
        {k: torch.zeros_like(v) for k, v in coord.master.items()}, "int8"
    )
    first = next(iter(coord.master)) + "::scale"
    tensors[first] = torch.ones(tensors[first].numel() + 1)  # one scale too many
    path = _write(tmp_path / "bad.safetensors", tensors, meta)
    key = digest_file(path)
    asyncio.run(coord.blobs.write_stream(key, chunked(path.read_bytes()), 1 << 30))
    with pytest.raises(CoordinatorError) as caught:
        coord.submit(
            site="lumi",
            round_no=1,
            lease_id=held["lease_id"],
            generation=0,
            tokens=10,
            steps=1,
            consumed=1,
            blob=key,
        )
    assert caught.value.status == 422 and "scales" in caught.value.message
    assert coord.status()["blocks_committed_total"] == 0
