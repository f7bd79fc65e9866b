"""Blockwise int8 and int4 delta compression: error bounds, the file layout, error feedback,
bad files (in process and through the real HTTP server), the merge."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from crossfed.client.http import Refused
from crossfed.coordinator.service import Coordinator, CoordinatorError
from crossfed.outer import outer_step, validate_delta
from crossfed.wire.codecs import (
    BLOCK_INT4,
    BLOCK_KEY,
    CODEC_KEY,
    SHAPES_KEY,
    CodecError,
    dequantize_int4,
    dequantize_int8,
    encode_tensors,
    encoder,
    open_delta,
    quantize_int4,
    quantize_int8,
    save_delta,
)
from crossfed.wire.digests import digest_file
from tests.conftest import LiveCoordinator, chunked, digest_of, staged_delta, tiny_spec


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
        encode_tensors({"w": torch.zeros(3)}, "int2")


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_the_coordinator_decodes_compressed_deltas_before_validating_and_merging(
    tmp_path: Path, tiny_data: Path, codec: str
) -> None:
    staged = staged_delta(tmp_path / "state", tiny_data, seed=5, codec=codec)
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


# --------------------------------------------------------------------------- int4
@pytest.mark.parametrize("shape", [(1000,), (37, 29), (3, 64), (1,), (7,), (0, 5)])
@pytest.mark.parametrize("block", [1, 7, 64])
def test_int4_error_is_at_most_half_a_step_per_block(shape: tuple[int, ...], block: int) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 0.01
    packed, scale = quantize_int4(x, block)
    n = x.numel()
    assert packed.dtype == torch.uint8 and packed.shape == ((n + 1) // 2,)
    assert scale.dtype == torch.bfloat16 and scale.shape == (-(-n // block),)
    codes = torch.stack((packed & 15, packed >> 4), dim=1).view(-1)
    assert bool(((codes >= 1) & (codes <= 15)).all())  # -7..7 stored as code + 8
    back = dequantize_int4(packed, scale, shape, block)
    assert back.dtype == torch.float32 and back.shape == x.shape
    steps = scale.float().repeat_interleave(block)[:n].view(shape)
    assert bool(((back - x).abs() <= steps / 2 + 1e-12).all())
    if n:  # each block's largest value is coded +-7: the scale is the bf16 of max|x| / 7
        big = (codes[:n].int() - 8).abs().view(-1)
        per_block = torch.zeros(-(-n // block), dtype=torch.int32)
        per_block.scatter_reduce_(0, torch.arange(n) // block, big, "amax")
        assert bool((per_block == 7).all())


def test_int4_zero_blocks_stay_exactly_zero_and_odd_lengths_pad_with_zero() -> None:
    x = torch.zeros(129)
    x[70] = -3.0
    packed, scale = quantize_int4(x, 64)
    assert scale[0] == 0 and scale[2] == 0 and packed[-1] >> 4 == 8  # the pad nibble: zero
    back = dequantize_int4(packed, scale, (129,), 64)
    assert torch.equal(back[:64], torch.zeros(64))
    assert back[70] == pytest.approx(-3.0, rel=2**-9)  # 7 x the bf16-rounded scale


def _layout() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A reference model (embedding, a matrix, a norm of odd length) and a site 1e-3 away."""
    gen = torch.Generator().manual_seed(0)
    ref = {
        "emb": torch.randn(1024, 64, generator=gen),
        "proj": torch.randn(96, 64, generator=gen),
        "norm": torch.ones(63),
    }
    site = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in ref.items()}
    return ref, site


def test_an_int4_delta_file_is_a_quarter_of_bf16_and_decodes_close(tmp_path: Path) -> None:
    ref, site = _layout()
    plain, packed = tmp_path / "plain.safetensors", tmp_path / "int4.safetensors"
    save_delta(site, ref, plain)
    digest = save_delta(site, ref, packed, {"site": "lumi"}, codec="int4")
    assert digest == digest_file(packed)
    ratio = packed.stat().st_size / plain.stat().st_size
    assert 0.25 < ratio <= 0.27  # 0.5 byte + 2/64 per value instead of 2
    stored = load_file(str(packed))
    assert set(stored) == {"emb", "emb::scale", "proj", "proj::scale", "norm", "norm::scale"}
    assert stored["norm"].shape == (32,) and stored["emb::scale"].dtype == torch.bfloat16
    with open_delta(packed) as delta:
        assert delta.codec == "int4" and delta.block == BLOCK_INT4
        for name in ref:
            true = site[name] - ref[name]
            err = (delta[name] - true).norm() / true.norm()
            assert delta[name].dtype == torch.float32 and delta[name].shape == true.shape
            assert float(err) < 0.15  # uniform rounding over 15 levels: about 0.11
        validate_delta(ref, delta)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_error_feedback_sends_what_quantisation_dropped_in_later_rounds(
    tmp_path: Path, codec: str
) -> None:
    """Over rounds, what was sent plus the last residual is exactly what was trained: the
    residual telescopes. Without feedback the rounding of every round adds up."""
    ref, site = _layout()
    true = {k: site[k] - ref[k] for k in ref}
    rounds = 6
    sent_ef = {k: torch.zeros_like(v) for k, v in ref.items()}
    sent_plain = {k: torch.zeros_like(v) for k, v in ref.items()}
    carried = None
    for r in range(rounds):
        path, out = tmp_path / f"d{r}.safetensors", tmp_path / f"e{r}.safetensors"
        meta = {"crossfed.round": str(r)}
        save_delta(site, ref, path, codec=codec, residual_in=carried, residual_out=out,
                   residual_metadata=meta)  # fmt: skip
        with open_delta(path) as delta:
            for k in ref:
                sent_ef[k] += delta[k]
        residual = load_file(str(out))
        assert load_file(str(out)).keys() == ref.keys()
        assert all(v.dtype == torch.float32 for v in residual.values())
        save_delta(site, ref, path, codec=codec)  # the same delta without feedback
        with open_delta(path) as delta:
            for k in ref:
                sent_plain[k] += delta[k]
        carried = residual
    for k in ref:
        exact = rounds * true[k]
        assert torch.allclose(sent_ef[k] + carried[k], exact, rtol=0, atol=1e-6)
        ef_err = float((sent_ef[k] - exact).norm() / exact.norm())
        plain_err = float((sent_plain[k] - exact).norm() / exact.norm())
        assert ef_err < plain_err / 3, (k, ef_err, plain_err)


def test_a_value_below_half_a_step_is_sent_only_with_error_feedback(tmp_path: Path) -> None:
    ref = {"w": torch.zeros(64)}
    site = {"w": torch.zeros(64)}
    site["w"][0], site["w"][1] = 0.7, 0.02  # step 0.1: 0.02 always rounds to 0 alone
    carried, sent = None, torch.zeros(64)
    for r in range(10):
        path, out = tmp_path / "d.safetensors", tmp_path / f"e{r}.safetensors"
        save_delta(site, ref, path, codec="int4", residual_in=carried, residual_out=out)
        with open_delta(path) as delta:
            sent += delta["w"]
        carried = load_file(str(out))
    assert float(sent[1]) == pytest.approx(0.2, abs=0.1 / 2 + 1e-6)  # 10 x 0.02 within a step
    save_delta(site, ref, path, codec="int4")
    with open_delta(path) as delta:
        assert float(delta["w"][1]) == 0.0


def test_a_residual_that_does_not_fit_the_model_is_refused(tmp_path: Path) -> None:
    ref, site = _layout()
    path, out = tmp_path / "d.safetensors", tmp_path / "e.safetensors"
    wrong = {k: torch.zeros(3) for k in ref}
    with pytest.raises(ValueError, match="carried residual 'emb' has shape"):
        save_delta(site, ref, path, codec="int4", residual_in=wrong, residual_out=out)
    with pytest.raises(ValueError, match="no tensor 'norm'"):
        partial = {k: torch.zeros_like(v) for k, v in ref.items() if k != "norm"}
        save_delta(site, ref, path, codec="int4", residual_in=partial, residual_out=out)
    assert not path.exists() and not out.exists()  # neither file half written


def _int4_parts(n: int = 200) -> dict[str, torch.Tensor]:
    tensors, _ = encode_tensors({"w": torch.linspace(-1, 1, n)}, "int4")
    return tensors


def _int4_meta(shapes: str = '{"w":[200]}', block: int = BLOCK_INT4) -> dict[str, str]:
    return {CODEC_KEY: "int4", BLOCK_KEY: str(block), SHAPES_KEY: shapes}


def _nan_scale(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    scale = tensors["w::scale"].clone()
    scale[1] = float("nan")
    return {**tensors, "w::scale": scale}


def _code_minus_8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    packed = tensors["w"].clone()
    packed[5] = packed[5] & 0xF0  # low nibble 0: code -8
    return {**tensors, "w": packed}


@pytest.mark.parametrize(
    "tensors, meta, message",
    [
        ({**_int4_parts(), "w::scale": torch.ones(3, dtype=torch.bfloat16)}, _int4_meta(),
         "need 4 scales"),
        (_nan_scale(_int4_parts()), _int4_meta(), "1 of 4 scales are not finite"),
        ({**_int4_parts(), "w::scale": -_int4_parts()["w::scale"]}, _int4_meta(),
         "scales are negative"),
        (_code_minus_8(_int4_parts()), _int4_meta(), "outside int4's -7..7"),
        ({**_int4_parts(), "w": torch.zeros(99, dtype=torch.uint8)}, _int4_meta(),
         "pack into 100 uint8 bytes"),
        ({**_int4_parts(), "w": torch.zeros(100, dtype=torch.int8)}, _int4_meta(),
         "stored as torch.int8"),
        (_int4_parts(), {CODEC_KEY: "int4"}, "no crossfed.shapes"),
        (_int4_parts(), _int4_meta("[200]"), "must map tensor names"),
        (_int4_parts(), _int4_meta('{"w":[200],"v":[2]}'), "names 'v'"),
        (_int4_parts(), _int4_meta('{"w":[-1]}'), "no shape"),
        (_int4_parts(), _int4_meta("{"), "not JSON"),
        (_nan_scale(encode_tensors({"w": torch.ones(600)}, "int8")[0]),
         {CODEC_KEY: "int8", BLOCK_KEY: "256"}, "not finite"),
    ],
)  # fmt: skip
def test_malformed_int4_deltas_are_refused_by_name(
    tmp_path: Path, tensors: dict, meta: dict, message: str
) -> None:
    path = _write(tmp_path / "bad.safetensors", tensors, meta)
    with pytest.raises(CodecError, match=message):
        with open_delta(path) as delta:
            for name in delta.keys():
                delta[name]


@pytest.mark.parametrize("case", ["block_count", "nan_scale", "bad_code"])
def test_bad_int4_codes_get_a_422_through_the_http_server_and_change_nothing(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path, case: str
) -> None:
    client = run.client("snellius")
    g0 = load_file(str(client.download_model(0, tmp_path / "g0.safetensors")))
    client.register("snellius", digest_of(tiny_data), 1, 1.0)
    lease = client.lease("snellius", 1, 2, None, 1.0)["lease"]
    site = {k: v.float() + 0.01 for k, v in g0.items()}
    good = tmp_path / "good.safetensors"
    save_delta(site, g0, good, codec="int4")
    tensors = load_file(str(good))
    with open_delta(good) as delta:
        meta = {CODEC_KEY: "int4", BLOCK_KEY: str(delta.block), SHAPES_KEY: ""}
        meta[SHAPES_KEY] = json.dumps({k: list(s) for k, s in delta.shapes.items()})
    victim = "norm.weight"
    if case == "block_count":
        tensors[victim + "::scale"] = tensors[victim + "::scale"][:-1].clone()
    elif case == "nan_scale":
        tensors[victim + "::scale"] = tensors[victim + "::scale"].clone()
        tensors[victim + "::scale"][0] = float("nan")
    else:
        tensors[victim] = tensors[victim].clone()
        tensors[victim][0] = 0x80  # low nibble 0: code -8
    bad = _write(tmp_path / "bad.safetensors", tensors, meta)
    expected = {"block_count": "scales, got shape", "nan_scale": "not finite",
                "bad_code": "outside int4"}[case]  # fmt: skip
    with pytest.raises(Refused) as refused:
        client.submit_delta(1, bad, inline=False, site="snellius", lease_id=lease["lease_id"],
                            generation=0, tokens=256, steps=4, consumed=lease["n_blocks"],
                            loss=3.0)  # fmt: skip
    assert refused.value.status == 422 and refused.value.code == "bad_delta"
    assert victim in refused.value.detail and expected in refused.value.detail
    status = run.client().status()
    assert status["generation"] == 0 and status["blocks_committed_total"] == 0
    # the well-formed delta of the same lease is still accepted afterwards
    reply = client.submit_delta(1, good, inline=True, site="snellius", lease_id=lease["lease_id"],
                                generation=0, tokens=256, steps=4, consumed=lease["n_blocks"],
                                loss=3.0)  # fmt: skip
    assert reply["accepted"]
