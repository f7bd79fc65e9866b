"""The embedding's rows weighted by how often each site saw their tokens (crossfed.rowcounts):
the counts, the weights, the outer step in memory, streamed and from files, and a merge of
the real coordinator from the delta files sites send."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import soak_check
from crossfed import rowcounts
from crossfed.coordinator import generations
from crossfed.coordinator.generations import merge_step
from crossfed.coordinator.runspec import RunSpec, RunSpecError, resolve_unset
from crossfed.coordinator.service import Coordinator
from crossfed.outer import outer_step, stream_outer_step
from crossfed.outer_presets import OuterConfig
from crossfed.wire.codecs import open_delta, save_delta
from crossfed.wire.tensors import save_tensors
from tests.conftest import chunked, digest_of, tiny_spec

EMB = rowcounts.EMBEDDING


def test_counts_are_each_windows_inputs_not_its_last_token() -> None:
    windows = np.array([[0, 1, 1, 3], [2, 2, 0, 9]])  # 9 is a target only
    counts = rowcounts.token_counts(windows, 10)
    assert counts.dtype == torch.float32
    assert counts.tolist() == [2, 2, 2, 0, 0, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="outside the vocabulary of 2"):
        rowcounts.token_counts(windows, 2)


def test_a_row_is_weighted_by_its_counts_and_an_unseen_row_by_the_token_shares() -> None:
    counts = [torch.tensor([3.0, 0.0, 0.0]), torch.tensor([1.0, 5.0, 0.0])]
    weights = rowcounts.row_weights(counts, [0.25, 0.75])
    assert weights is not None
    torch.testing.assert_close(weights, torch.tensor([[0.75, 0.0, 0.25], [0.25, 1.0, 0.75]]))
    assert rowcounts.row_weights([counts[0], None], [0.5, 0.5]) is None


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), min_size=6, max_size=6), min_size=1, max_size=4),
    st.data(),
)
def test_every_rows_weights_sum_to_one(counts: list[list[int]], data: st.DataObject) -> None:
    raw = data.draw(st.lists(st.integers(1, 9), min_size=len(counts), max_size=len(counts)))
    shares = [n / sum(raw) for n in raw]
    weights = rowcounts.row_weights([torch.tensor(c, dtype=torch.float32) for c in counts], shares)
    assert weights is not None and weights.shape == (len(counts), 6)
    torch.testing.assert_close(weights.sum(0), torch.ones(6))
    assert bool((weights >= 0).all())


def _small(shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    return (0.01 * torch.randn(shape, generator=gen)).to(torch.bfloat16)


def _state(seed: int) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    master = {EMB: torch.randn(5, 3, generator=gen), "norm": torch.randn(3, generator=gen)}
    deltas = [
        {
            k: (0.01 * torch.randn(v.shape, generator=gen)).to(torch.bfloat16)
            for k, v in master.items()
        }
        for _ in range(3)
    ]
    return master, deltas


def test_a_row_one_site_saw_takes_that_sites_step_whole() -> None:
    """Row 0 only site 0 saw, row 1 all three in the token shares' proportion, row 4 none:
    the new master's rows are site 0's delta, the token-weighted mean, and the mean; the
    other tensor moves as it does without counts."""
    master, deltas = _state(0)
    tokens = [100, 300, 600]
    shares = [0.1, 0.3, 0.6]
    counts = [torch.tensor([7.0, 1, 2, 0, 0]), torch.tensor([0.0, 3, 0, 5, 0]),
              torch.tensor([0.0, 6, 1, 5, 0])]  # fmt: skip
    weights = rowcounts.row_weights(counts, shares)
    assert weights is not None
    plain, weighted = ({k: v.clone() for k, v in master.items()} for _ in range(2))
    outer_step(plain, {}, deltas, tokens, OuterConfig(preset="average"), kernel="eager")
    outer_step(weighted, {}, deltas, tokens, OuterConfig(preset="average"), kernel="eager",
               row_weights={EMB: weights})  # fmt: skip
    d = [x[EMB].float() for x in deltas]
    torch.testing.assert_close(weighted[EMB][0], master[EMB][0] + d[0][0])
    torch.testing.assert_close(weighted[EMB][1], plain[EMB][1])
    torch.testing.assert_close(weighted[EMB][3], master[EMB][3] + (d[1][3] + d[2][3]) / 2)
    torch.testing.assert_close(weighted[EMB][4], plain[EMB][4])
    assert torch.equal(weighted["norm"], plain["norm"])
    assert not torch.allclose(weighted[EMB][0], plain[EMB][0])


@pytest.mark.parametrize("preset", ["average", "paper"])
def test_the_streamed_step_weights_rows_as_the_step_in_memory(preset: str) -> None:
    master, deltas = _state(1)
    tokens = [10, 20, 30]
    weights = rowcounts.row_weights([torch.rand(5) * 4 for _ in range(3)], [t / 60 for t in tokens])
    assert weights is not None
    config = OuterConfig(preset=preset)  # type: ignore[arg-type]
    in_memory = {k: v.clone() for k, v in master.items()}
    momentum: dict[str, torch.Tensor] = {}
    for _ in range(2):  # the second step has momentum
        outer_step(in_memory, momentum, deltas, tokens, config, kernel="eager",
                   row_weights={EMB: weights})  # fmt: skip
    streamed = {k: v.clone() for k, v in master.items()}
    kept: dict[str, torch.Tensor] = {}
    for _ in range(2):
        out: dict[str, torch.Tensor] = {}

        def emit(name: str, w: torch.Tensor, b: torch.Tensor | None, out=out) -> None:  # noqa: ANN001
            out[name] = w.clone()
            assert b is not None
            kept[name] = b.clone()

        stream_outer_step({k: v.shape for k, v in master.items()}, streamed, dict(kept),
                          deltas, tokens, emit, config, kernel="eager",
                          row_weights={EMB: weights})  # fmt: skip
        streamed = out
    assert all(torch.equal(streamed[k], in_memory[k]) for k in master)
    assert all(torch.equal(kept[k], momentum[k]) for k in master)


def test_a_merge_from_files_in_row_blocks_weights_rows_as_the_step_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator's merge from a master file and delta files, cut into row blocks of
    two rows, gives the in-memory step's tensors bit for bit."""
    master, deltas = _state(2)
    tokens = [5, 10, 25]
    save_tensors(master, tmp_path / "master-0", {"generation": "0"}, algo=None)
    counts = [torch.tensor([0.0, 2, 9, 0, 1]), torch.tensor([4.0, 0, 1, 0, 1]),
              torch.tensor([1.0, 0, 0, 0, 6])]  # fmt: skip
    paths = []
    for i, delta in enumerate(deltas):
        site = {k: master[k] + delta[k].float() for k in master}
        paths.append(tmp_path / f"delta-{i}")
        save_delta(site, master, paths[-1], extra={rowcounts.count_key(EMB): counts[i]})
    sent = []
    for path in paths:
        with open_delta(path) as opened:
            assert sorted(opened.keys()) == sorted(master)
            sent.append({k: opened[k].clone() for k in master})
            assert torch.equal(opened.row_counts()[rowcounts.count_key(EMB)],
                               counts[len(sent) - 1])  # fmt: skip
    expected = {k: v.clone() for k, v in master.items()}
    weights = rowcounts.row_weights(counts, [t / 40 for t in tokens])
    outer_step(expected, {}, sent, tokens, OuterConfig(preset="average"), kernel="eager",
               row_weights={EMB: weights})  # fmt: skip
    monkeypatch.setattr(generations, "PIECE_BYTES", 2 * 3 * 4)  # two rows of the embedding
    got: dict[str, list[torch.Tensor]] = {}

    def emit(name: str, w: torch.Tensor, b: torch.Tensor | None) -> None:
        got.setdefault(name, []).append(w.clone())

    shapes = {k: tuple(v.shape) for k, v in master.items()}
    merge_step(tmp_path / "master-0", shapes, paths, tokens, emit, OuterConfig(preset="average"),
               row_counts={EMB: counts})  # fmt: skip
    assert len(got[EMB]) == 3  # rows 0-1, 2-3 and 4
    assert torch.equal(torch.cat(got[EMB]), expected[EMB])
    assert torch.equal(torch.cat(got["norm"]), expected["norm"])


@pytest.mark.parametrize("mode", ["counts", "shares"])
def test_a_coordinator_merge_weights_the_embedding_rows_by_the_counts_its_deltas_carry(
    tmp_path: Path, tiny_data: Path, mode: str
) -> None:
    """Two sites' deltas, with their row counts, through the real coordinator: with
    ``counts`` the new master's embedding rows are the count-weighted mean of the deltas,
    with ``shares`` the token-weighted mean."""
    now = [1000.0]
    coord = Coordinator(tmp_path / "state", clock=lambda: now[0])
    coord.init_run(tiny_spec(tiny_data, embedding_rows=mode, outer=OuterConfig(preset="average")))
    master0 = {k: v.clone() for k, v in coord.master.items()}
    vocab = master0[EMB].shape[0]
    gen = torch.Generator().manual_seed(5)
    sent = {
        "lumi": (torch.randint(0, 3, (vocab,), generator=gen).float(), 300),
        "snellius": (torch.randint(0, 3, (vocab,), generator=gen).float(), 100),
    }
    deltas = {}
    for i, (site, (counts, tokens)) in enumerate(sent.items()):
        coord.register(site, digest_of(tiny_data), 1, 1.0)
        lease = coord.lease(site, 1, 2, None, 1.0)["lease"]
        step = torch.Generator().manual_seed(i)
        trained = {k: v + 0.01 * torch.randn(v.shape, generator=step) for k, v in master0.items()}
        deltas[site] = (trained[EMB] - master0[EMB]).to(torch.bfloat16).float()
        path = tmp_path / f"{site}.st"
        key = save_delta(trained, master0, path, extra={rowcounts.count_key(EMB): counts})
        asyncio.run(coord.blobs.write_stream(key, chunked(path.read_bytes()), 1 << 30))
        reply = coord.submit(site=site, round_no=1, lease_id=lease["lease_id"],
                             generation=0, steps=4, tokens=tokens,
                             consumed=lease["n_blocks"], blob=key)  # fmt: skip
        assert reply["accepted"], reply
    now[0] += 60.0
    summary = coord.tick()
    assert summary is not None and summary["generation"] == 1
    merged = coord.master[EMB]
    shares = master0[EMB] + 0.75 * deltas["lumi"] + 0.25 * deltas["snellius"]
    weights = rowcounts.row_weights([sent["lumi"][0], sent["snellius"][0]], [0.75, 0.25])
    assert weights is not None
    counted = (master0[EMB] + weights[0][:, None] * deltas["lumi"]
               + weights[1][:, None] * deltas["snellius"])  # fmt: skip
    expected, other = (counted, shares) if mode == "counts" else (shares, counted)
    torch.testing.assert_close(merged, expected, atol=1e-6, rtol=0)
    assert (merged - other).abs().max() > 1e-3


def test_a_new_run_weights_rows_by_counts_a_run_keeps_its_own_and_one_stored_before_shares(
    tiny_data: Path,
) -> None:
    new = resolve_unset(tiny_spec(tiny_data, embedding_rows=None), None)
    assert new.embedding_rows == rowcounts.COUNTS == rowcounts.DEFAULT_MODE
    by_shares = resolve_unset(tiny_spec(tiny_data, embedding_rows="shares"), None)
    kept = resolve_unset(tiny_spec(tiny_data, embedding_rows=None), by_shares)
    assert kept.embedding_rows == rowcounts.SHARES  # a rerun that leaves it unset
    stored = new.to_dict()
    del stored["embedding_rows"]  # a run stored before the setting existed
    old = RunSpec.from_dict(stored)
    assert old.embedding_rows == rowcounts.SHARES
    rerun = resolve_unset(tiny_spec(tiny_data, embedding_rows=None), old)  # left unset
    assert rerun.embedding_rows == rowcounts.SHARES
    with pytest.raises(RunSpecError, match="embedding_rows must be one of counts, shares"):
        RunSpec.from_dict({**new.to_dict(), "embedding_rows": "rows"})


def test_a_round_with_a_delta_that_counts_no_rows_merges_the_embedding_by_token_shares(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A site of an older version sends no counts: that round's embedding is merged with
    the token shares, as every other tensor, and the log says so."""
    master, deltas = _state(3)
    tokens = [5, 10, 25]
    save_tensors(master, tmp_path / "master-0", {"generation": "0"}, algo=None)
    paths = []
    for i, delta in enumerate(deltas):
        site = {k: master[k] + delta[k].float() for k in master}
        paths.append(tmp_path / f"delta-{i}")
        extra = {} if i == 1 else {rowcounts.count_key(EMB): torch.rand(5) * 3}
        save_delta(site, master, paths[-1], extra=extra)
    got: dict[str, torch.Tensor] = {}

    def emit(name: str, w: torch.Tensor, b: torch.Tensor | None) -> None:
        got[name] = w.clone()

    shapes = {k: tuple(v.shape) for k, v in master.items()}
    counts: list[torch.Tensor | None] = []
    for path in paths:
        with open_delta(path) as opened:
            counts.append(opened.row_counts().get(rowcounts.count_key(EMB)))
    assert counts[1] is None and counts[0] is not None
    merge_step(tmp_path / "master-0", shapes, paths, tokens, emit, OuterConfig(preset="average"),
               row_counts={EMB: counts})  # fmt: skip
    expected = {k: v.clone() for k, v in master.items()}
    outer_step(expected, {}, deltas, tokens, OuterConfig(preset="average"), kernel="eager")
    assert all(torch.equal(got[k], expected[k]) for k in master)
    assert "merged with token shares" in caplog.text


def test_counts_that_do_not_fit_the_model_are_named() -> None:
    shapes = {EMB: (5, 3), "norm": (3,)}
    key = rowcounts.count_key(EMB)
    assert rowcounts.problem({key: torch.ones(5)}, shapes) is None
    assert "has 5 rows" in str(rowcounts.problem({key: torch.ones(4)}, shapes))
    assert "negative or non-finite" in str(rowcounts.problem({key: -torch.ones(5)}, shapes))
    assert "non-finite" in str(rowcounts.problem({key: torch.full((5,), float("nan"))}, shapes))
    other = rowcounts.count_key("output.weight")
    assert "no tensor of the model" in str(rowcounts.problem({other: torch.ones(5)}, shapes))


def test_the_row_weighted_sum_rounds_as_the_independent_checker_replays_it() -> None:
    """Every product of a row's weight and a delta is rounded to fp32 before it is added,
    so ``bench/soak_check.py``'s numpy replay rebuilds the merged embedding to the bit (a
    fused multiply-add, as torch's ``addcmul_`` is on CPUs with FMA, differs by an ulp in
    some rows: 1.7e-6 over a 24-round soak)."""
    gen = torch.Generator().manual_seed(3)
    shape = (2048, 128)
    deltas = [(torch.randn(shape, generator=gen) * 0.01).to(torch.bfloat16) for _ in range(3)]
    counts = [torch.randint(0, 40, (shape[0],), generator=gen).float() for _ in range(3)]
    weights = rowcounts.row_weights(counts, [0.5, 0.3, 0.2])
    assert weights is not None
    master = torch.zeros(shape)
    ours = outer_step_rows(master, deltas, weights)
    theirs = soak_check.weighted_rows(
        [d.float().numpy().reshape(-1) for d in deltas], weights.numpy(), shape
    )
    assert np.array_equal(ours.numpy().reshape(-1), theirs)


def outer_step_rows(master: torch.Tensor, deltas: list[torch.Tensor], weights) -> torch.Tensor:
    """The merged rows ``outer_step`` applies with ``average`` (eta 1, no momentum): the
    row-weighted sum of the deltas, read back from a zero master."""
    w = {rowcounts.EMBEDDING: master.clone()}
    rows = {rowcounts.EMBEDDING: weights}
    ds = [{rowcounts.EMBEDDING: d} for d in deltas]
    outer_step(w, {}, ds, [1, 1, 1], OuterConfig(preset="average"), row_weights=rows)
    return w[rowcounts.EMBEDDING]
