"""bench/quality.py's overlap row: with no delay it is the DiLoCo row bit for bit; with a
delay it is the plain round first and differs from the second round on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.quality import OverlapRun, Run, overlap_name, overlap_tau, site_windows
from crossfed.darl.blockspace import BlockSpace
from crossfed.outer import PRESETS
from crossfed.train.inner import InnerConfig
from crossfed.train.overlap import OverlapConfig
from crossfed.train.schedule import LRSchedule
from crossfed.train.windows import WindowStore

SITES, BATCH, H, ROUNDS = 3, 2, 2, 2


def _runs(data: Path, overlap: OverlapConfig, tau: int) -> tuple[Run, OverlapRun, list]:
    store = WindowStore.open(data, "train")
    plan = site_windows(BlockSpace(store.n_windows, 8, seed=5), SITES, BATCH, H, ROUNDS)
    schedule = LRSchedule(peak_lr=3e-3, warmup_steps=1, total_steps=H * ROUNDS)
    cfg, outer, vocab = InnerConfig(micro_batch=BATCH), PRESETS["tuned"], store.vocab_size
    plain = Run("diloco", store, vocab, 0, schedule, outer, SITES, cfg)
    overlapped = OverlapRun("overlap", store, vocab, 0, schedule, outer, SITES, cfg, overlap, tau)
    return plain, overlapped, plan


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "overlap", [OverlapConfig(enabled=True), OverlapConfig(enabled=True, rule="mix", alpha=0.0)]
)
def test_no_delay_is_the_diloco_row_bit_for_bit(tiny_data: Path, overlap: OverlapConfig) -> None:
    plain, overlapped, plan = _runs(tiny_data, overlap, tau=0)
    for leases in plan:
        plain.round(leases, H)
        overlapped.round(leases, H)
        assert _same(plain.master, overlapped.master)
    assert overlapped.global_step == plain.global_step == H * ROUNDS


@pytest.mark.parametrize("rule", ["rebase", "mix"])
def test_a_delay_keeps_round_one_plain_and_changes_round_two(tiny_data: Path, rule: str) -> None:
    plain, overlapped, plan = _runs(tiny_data, OverlapConfig(enabled=True, rule=rule), tau=1)
    start = {k: v.clone() for k, v in plain.master.items()}
    plain.round(plan[0], H)
    overlapped.round(plan[0], H)
    assert _same(plain.master, overlapped.master)  # round 1: nothing to fold in
    assert not _same(plain.master, start)
    plain.round(plan[1], H)
    overlapped.round(plan[1], H)
    assert not _same(plain.master, overlapped.master)
    # every site sent from weights of its own, kept apart from the shared model
    sent = overlapped.sent
    assert all(s is not None for s in sent)
    assert not _same(sent[0], sent[1]) and not _same(sent[1], sent[2])  # type: ignore[arg-type]


def test_tau_is_a_rounded_fraction_of_h_at_least_one_step_and_at_most_h() -> None:
    assert [overlap_tau(0.5, h) for h in (1, 2, 3, 5, 10)] == [1, 1, 2, 2, 5]
    assert overlap_tau(0.0, 5) == 0
    assert overlap_tau(0.01, 5) == 1
    assert overlap_tau(3.0, 5) == 5
    with pytest.raises(ValueError, match="--overlap-delay must be >= 0"):
        overlap_tau(-0.5, 5)
    with pytest.raises(ValueError, match="--overlap-delay"):
        overlap_tau(float("nan"), 5)
    mix = OverlapConfig(enabled=True, rule="mix", alpha=0.25)
    assert overlap_name(3, mix, 2) == "DiLoCo 3 sites, overlap (mix alpha=0.25, tau=2)"
