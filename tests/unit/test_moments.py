"""The sites' AdamW second moment shared at a merge as row and column factors
(crossfed.moments): the factors, their token-weighted merge, a site adopting them, the
delta and global model files that carry them, and a real coordinator's merge."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from crossfed import moments
from crossfed.coordinator.service import Coordinator
from crossfed.wire.codecs import decoded, open_delta, save_delta
from crossfed.wire.tensors import TensorFile
from tests.conftest import chunked, digest_of, tiny_spec


def _positive(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) + 0.05


def test_a_rank_one_second_moment_is_its_own_approximation() -> None:
    row, col = _positive((7,), 1), _positive((5,), 2)
    v = torch.outer(row, col)
    parts = moments.factors(v)
    assert set(parts) == {moments.ROW, moments.COL, moments.MEAN}
    torch.testing.assert_close(moments.approximation(parts, v.shape), v)
    vector = _positive((9,), 3)
    assert torch.equal(moments.factors(vector)[moments.FULL], vector)


@settings(max_examples=40, deadline=None)
@given(
    sites=st.integers(1, 4),
    rows=st.integers(1, 6),
    cols=st.integers(1, 6),
    seed=st.integers(0, 10_000),
    tokens=st.lists(st.integers(1, 1000), min_size=4, max_size=4),
)
def test_rank_one_moments_shared_by_factors_are_the_token_weighted_mean(
    sites: int, rows: int, cols: int, seed: int, tokens: list[int]
) -> None:
    """Each site's v = a_i b_i^T (a second moment with its own row and column scales): the
    factors carry it whole, so after a merge every site holds the sites' token-weighted
    mean of v, exactly what averaging the whole tensors gives."""
    vs = [torch.outer(_positive((rows,), seed + i), _positive((cols,), seed + 50 + i))
          for i in range(sites)]  # fmt: skip
    weights = tokens[:sites]
    merged = moments.merge([{"m": moments.factors(v)[moments.ROW]} for v in vs], weights)
    want_row = sum(v.mean(1) * n for v, n in zip(vs, weights, strict=True)) / sum(weights)
    torch.testing.assert_close(merged["m"], want_row)
    if sites == 1 or rows == 1 or cols == 1:
        return  # the property below is for a mean of rank-one tensors that is itself one
    # sites sharing the column scale: the mean is rank one and the factors give it exactly
    shared = [
        torch.outer(_positive((rows,), seed + i), _positive((cols,), seed)) for i in range(sites)
    ]
    mean = sum(v * n for v, n in zip(shared, weights, strict=True)) / sum(weights)
    parts = moments.merge([{k: t for k, t in moments.factors(v).items()} for v in shared], weights)
    for v in shared:
        torch.testing.assert_close(moments.rescaled(v, parts), mean, rtol=1e-5, atol=1e-7)


def test_a_lone_site_or_identical_sites_keep_their_second_moment() -> None:
    v = _positive((6, 4), 7) ** 2
    alone = moments.merge([moments.factors(v)], [10])
    torch.testing.assert_close(moments.rescaled(v, alone), v)
    same = moments.merge([moments.factors(v), moments.factors(v.clone())], [3, 9])
    torch.testing.assert_close(moments.rescaled(v, same), v)


def test_a_row_a_site_never_stepped_takes_the_merged_scale() -> None:
    """The embedding row of a token one site never saw: its v is zero there, the other site's
    is not; after the merge that row is no longer zero (the step on it is no longer huge)."""
    seen = _positive((4, 3), 1)
    unseen = seen.clone()
    unseen[2] = 0.0
    merged = moments.merge([moments.factors(seen), moments.factors(unseen)], [1, 1])
    after = moments.rescaled(unseen, merged)
    assert bool((after[2] > 0).all())
    zero = torch.zeros(4, 3)  # a parameter never stepped: the merged approximation itself
    torch.testing.assert_close(moments.rescaled(zero, merged),
                               moments.approximation(merged, zero.shape))  # fmt: skip


def test_the_merge_weights_by_tokens_and_leaves_out_sites_without_factors() -> None:
    a, b = {"k": torch.tensor([1.0, 2.0])}, {"k": torch.tensor([3.0, 6.0])}
    torch.testing.assert_close(moments.merge([a, b], [1, 3])["k"], torch.tensor([2.5, 5.0]))
    torch.testing.assert_close(moments.merge([a, {}, b], [1, 5, 1])["k"], torch.tensor([2.0, 4.0]))
    assert moments.merge([a, b], [0, 0]) == {}
    with pytest.raises(ValueError):
        moments.merge([a, b], [1])


def test_a_sites_factors_that_do_not_fit_the_model_are_named() -> None:
    shapes = {"w": (4, 3), "norm": (3,)}
    good = {moments.factor_key("w", moments.ROW): torch.ones(4),
            moments.factor_key("w", moments.COL): torch.ones(3),
            moments.factor_key("w", moments.MEAN): torch.tensor(1.0),
            moments.factor_key("norm", moments.FULL): torch.ones(3)}  # fmt: skip
    assert set(good) == set(moments.expected_shapes(shapes))
    assert moments.problem(good, shapes) is None
    wrong = {**good, moments.factor_key("w", moments.ROW): torch.ones(5)}
    assert "has shape (5,); expected (4,)" in moments.problem(wrong, shapes)
    stray = {**good, moments.factor_key("bias", moments.FULL): torch.ones(3)}
    assert "no factor of this model" in moments.problem(stray, shapes)
    negative = {**good, moments.factor_key("norm", moments.FULL): -torch.ones(3)}
    assert "negative or non-finite" in moments.problem(negative, shapes)


def test_an_optimisers_factors_and_their_adoption(tmp_path: Path) -> None:
    """A real AdamW: the factors of its state, and adopting another's rescales every v."""
    layers = [torch.nn.Linear(6, 4) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    optimizers = [torch.optim.AdamW(layer.parameters(), lr=1e-2) for layer in layers]
    for i, (layer, opt) in enumerate(zip(layers, optimizers, strict=True)):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(i))
        layer(x).pow(2).sum().backward()
        opt.step()
    named = [dict(layer.named_parameters()) for layer in layers]
    sent = [moments.state_factors(p, o) for p, o in zip(named, optimizers, strict=True)]
    assert set(sent[0]) == set(moments.expected_shapes({k: v.shape for k, v in named[0].items()}))
    merged = moments.merge(sent, [1, 1])
    before = optimizers[0].state[named[0]["weight"]]["exp_avg_sq"].clone()
    assert moments.adopt(named[0], optimizers[0], merged) == 2
    after = optimizers[0].state[named[0]["weight"]]["exp_avg_sq"]
    correction = 1 - 0.999  # one step at AdamW's default beta2: the raw moment's bias
    assert moments.bias_correction(optimizers[0], named[0]["weight"]) == pytest.approx(correction)
    parts = moments._parts_of(merged, "weight")
    torch.testing.assert_close(after, moments.rescaled(before / correction, parts) * correction)
    assert not torch.equal(after, before)
    fresh = torch.optim.AdamW(layers[1].parameters())  # no state yet: nothing to rescale
    assert moments.adopt(named[1], fresh, merged) == 0


def test_a_delta_file_carries_factors_beside_the_delta_not_among_its_tensors(
    tmp_path: Path,
) -> None:
    ref = {"w": torch.randn(4, 3), "norm": torch.ones(3)}
    site = {k: v + 0.01 for k, v in ref.items()}
    factors = {moments.factor_key("w", moments.ROW): torch.rand(4)}
    for codec in ("none", "int8"):
        path = tmp_path / f"{codec}.safetensors"
        save_delta(site, ref, path, codec=codec, extra=factors)
        with open_delta(path) as delta:
            assert sorted(delta.keys()) == ["norm", "w"]
            assert torch.equal(delta.moments()[moments.factor_key("w", moments.ROW)],
                               factors[moments.factor_key("w", moments.ROW)])  # fmt: skip
    with pytest.raises(ValueError, match="is neither a second-moment factor nor row counts"):
        save_delta(site, ref, tmp_path / "bad.safetensors", extra={"w": torch.ones(1)})


class _CountedReads(TensorFile):
    """A delta file that counts its reads of tensor bytes (each would be one ranged GET of
    an object in the store)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reads = 0

    def _readinto(self, view: memoryview, offset: int) -> int:
        self.reads += 1
        return super()._readinto(view, offset)


def test_a_deltas_factors_are_read_in_one_read_whatever_their_number(tmp_path: Path) -> None:
    """The factors a site appends to its delta lie back to back, so the merge reads them in
    one read (one ranged GET of an object, not one per factor: 700 at Qwen3-0.6B), with the
    values each factor's own read gives; tensors with a gap between them are read in a run
    each."""
    shapes = {f"layers.{i}.w": (6, 4) for i in range(5)} | {"norm": (4,)}
    ref = {k: torch.randn(shape) for k, shape in shapes.items()}
    factors = _factors_of(shapes, seed=3)
    path = tmp_path / "delta.safetensors"
    save_delta({k: v + 0.01 for k, v in ref.items()}, ref, path, extra=factors)
    with _CountedReads(path) as handle:
        got = decoded(handle).moments()
        assert handle.reads == 1 and len(got) == len(factors) == 16
        assert all(torch.equal(got[k], handle.get_tensor(k)) for k in factors)
        apart = ["layers.0.w", "layers.1.w", "norm"]  # layers.2-4 lie between them
        before = handle.reads
        many = handle.read_many(apart)
        assert handle.reads - before == 2 and list(many) == apart
        assert all(torch.equal(many[k], handle.get_tensor(k)) for k in apart)


def _submit(coord: Coordinator, site: str, master0: dict, seed: int, tokens: int,
            factors: dict, lease: dict, path: Path) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    trained = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in master0.items()}
    key = save_delta(trained, master0, path, extra=factors)
    asyncio.run(coord.blobs.write_stream(key, chunked(path.read_bytes()), 1 << 30))
    reply = coord.submit(site=site, round_no=1, lease_id=lease["lease_id"], generation=0,
                         steps=4, tokens=tokens, consumed=lease["n_blocks"], blob=key)  # fmt: skip
    assert reply["accepted"], reply


def _factors_of(shapes: dict, seed: int) -> dict[str, torch.Tensor]:
    return {k: _positive(shape, seed + i) for i, (k, shape)
            in enumerate(moments.expected_shapes(shapes).items())}  # fmt: skip


@pytest.mark.parametrize("mode", ["shared", "own"])
def test_a_merge_publishes_the_token_weighted_factors_with_the_global_model(
    tmp_path: Path, tiny_data: Path, mode: str
) -> None:
    now = [1000.0]
    coord = Coordinator(tmp_path / "state", clock=lambda: now[0])
    coord.init_run(tiny_spec(tiny_data, second_moment=mode))
    master0 = {k: v.clone() for k, v in coord.master.items()}
    shapes = {k: tuple(v.shape) for k, v in master0.items()}
    sent = {"lumi": (_factors_of(shapes, 1), 300), "snellius": (_factors_of(shapes, 2), 100)}
    bad = _factors_of(shapes, 3)
    bad[next(iter(bad))] = -bad[next(iter(bad))]  # frontier's do not fit: left out, logged
    sent["frontier"] = (bad, 500)
    leases = {}
    for site in sent:
        coord.register(site, digest_of(tiny_data), 1, 1.0)
        leases[site] = coord.lease(site, 1, 2, None, 1.0)["lease"]
    for i, (site, (factors, tokens)) in enumerate(sent.items()):
        _submit(coord, site, master0, i, tokens, factors, leases[site], tmp_path / f"{site}.st")
    now[0] += 60.0
    summary = coord.tick()
    assert summary is not None and summary["generation"] == 1
    path, _ = coord.global_file(1)
    published = load_file(str(path))
    assert set(moments.without_moments(published)) == set(shapes)
    factors = moments.only_moments(published)
    if mode == "own":
        assert factors == {}
        return
    lumi, snellius = sent["lumi"][0], sent["snellius"][0]
    assert set(factors) == set(lumi)
    for key, value in factors.items():  # frontier's 500 tokens are not in the weights
        torch.testing.assert_close(value, (lumi[key] * 300 + snellius[key] * 100) / 400)


def test_sites_that_took_different_numbers_of_steps_share_the_corrected_moment() -> None:
    """Two sites see the same gradient every step, one for 3 steps, one for 30: their raw
    second moments differ by AdamW's bias (1 - beta2^t), the moments their steps use do
    not, so sharing leaves both as they were (a mean of the raw ones would not)."""
    layers = [torch.nn.Linear(5, 3) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    optimizers = [torch.optim.AdamW(x.parameters(), lr=0.0, betas=(0.9, 0.95)) for x in layers]
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))
    for layer, opt, steps in zip(layers, optimizers, (3, 30), strict=True):
        for _ in range(steps):
            opt.zero_grad()
            layer(x).pow(2).sum().backward()
            opt.step()
    named = [dict(x.named_parameters()) for x in layers]
    raw = [
        o.state[p["weight"]]["exp_avg_sq"].clone() for o, p in zip(optimizers, named, strict=True)
    ]
    assert not torch.allclose(raw[0], raw[1], rtol=0.1)  # biased by different factors
    sent = [moments.state_factors(p, o) for p, o in zip(named, optimizers, strict=True)]
    merged = moments.merge(sent, [1, 1])
    for p, o, before in zip(named, optimizers, raw, strict=True):
        moments.adopt(p, o, merged)
        torch.testing.assert_close(o.state[p["weight"]]["exp_avg_sq"], before, rtol=1e-4, atol=0)
