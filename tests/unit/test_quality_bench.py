"""bench/quality.py: the wire every DiLoCo row crosses (sites train from the published bf16
model and send bf16 deltas), and the overlap row: with no delay it is the DiLoCo row bit for
bit; with a delay it is the plain round first and differs from the second round on."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest
import torch

from bench.quality import (
    CombinedAdamW,
    OverlapRun,
    Run,
    Wire,
    interleave,
    outer_json,
    overlap_name,
    overlap_tau,
    parse_outer,
    regime_steps,
    round_lengths,
    site_windows,
    warmup_steps,
)
from crossfed import rowcounts
from crossfed.darl.blockspace import BlockSpace
from crossfed.data.windows import WindowStore
from crossfed.outer_presets import PRESETS
from crossfed.train.inner import InnerConfig
from crossfed.train.model import parameters_of
from crossfed.train.overlap import OverlapConfig
from crossfed.train.schedule import LRSchedule, default_warmup_steps

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


def _lone_site(data: Path, wire: Wire) -> tuple[Run, Run, list[int]]:
    """A centralised run and a lone site of the same batch, and one round's windows."""
    store = WindowStore.open(data, "train")
    plan = site_windows(BlockSpace(store.n_windows, 8, seed=5), SITES, BATCH, H, 1)
    schedule = LRSchedule(peak_lr=3e-3, warmup_steps=1, total_steps=H)
    cfg, vocab = InnerConfig(micro_batch=BATCH, accumulation=SITES), store.vocab_size
    central = Run("centralised", store, vocab, 0, schedule, None, 1, cfg)
    solo = Run("solo", store, vocab, 0, schedule, PRESETS["tuned"], 1, cfg, wire)
    return central, solo, interleave(plan[0], BATCH)


@pytest.mark.parametrize(
    "wire",
    [Wire(), Wire(torch.float32, torch.bfloat16), Wire(torch.bfloat16, torch.float32)],
    ids=["workflow", "fp32-global", "fp32-delta"],
)
def test_a_site_trains_from_the_published_model_and_sends_its_delta_in_the_wire_dtype(
    tiny_data: Path, wire: Wire
) -> None:
    _, solo, lease = _lone_site(tiny_data, wire)
    before = {k: v.clone() for k, v in solo.master.items()}
    published = solo.published()
    assert all(published[k].dtype == wire.global_dtype for k in before)
    assert all(torch.equal(published[k].float(), before[k].to(wire.global_dtype).float())
               for k in before)  # fmt: skip
    solo.round([lease], H)
    trained = parameters_of(solo.model)  # the lone site's weights at the end of its phase
    # tuned, one contributor: eta 1 and no momentum, so the master moves by the delta as sent
    for k, w in before.items():
        sent = (trained[k].float() - published[k].float()).to(wire.delta_dtype).float()
        torch.testing.assert_close(solo.master[k], w + sent, rtol=1e-6, atol=1e-9)


def test_a_lossless_wire_makes_a_lone_site_centralised_training_and_bf16_does_not(
    tiny_data: Path,
) -> None:
    central, lossless, lease = _lone_site(tiny_data, Wire(torch.float32, torch.float32))
    _, workflow, _ = _lone_site(tiny_data, Wire())
    assert all(torch.equal(central.master[k], lossless.master[k]) for k in central.master)
    for run in (central, lossless, workflow):
        run.round([lease], H)
    for k, w in central.master.items():
        torch.testing.assert_close(lossless.master[k], w)  # fp32 rounding of w0 + (w - w0)
    assert any(
        not torch.allclose(workflow.master[k], w, rtol=1e-4, atol=1e-6)
        for k, w in central.master.items()
    )


def test_leases_past_one_epoch_continue_with_the_next_epochs_permutation() -> None:
    space = BlockSpace(40, 4, seed=9)  # 40 windows: one round of 3 sites x 2 x 10 is 1.5 epochs
    plan = site_windows(space, sites=3, batch=2, steps=10, rounds=1)
    trained = [w for lease in plan[0] for w in lease]
    first, second = trained[:40], trained[40:]
    assert sorted(first) == list(range(40))  # epoch 0: every window once
    assert len(set(second)) == len(second) == 20  # epoch 1 starts: no window twice within it
    epoch1 = [w for b in space.permutation(1) for w in space.block_windows(int(b))]
    assert second == epoch1[:20]


def test_early_and_late_rounds_merge_more_often_over_the_same_steps_and_windows() -> None:
    assert round_lengths(25, 1000) == [25] * 40
    assert round_lengths(25, 1000, early_rounds=20, early_h=5) == [5] * 20 + [25] * 36
    assert round_lengths(25, 1000, late_rounds=20, late_h=5) == [25] * 36 + [5] * 20
    assert round_lengths(25, 1000, 10, 5, 10, 5) == [5] * 10 + [25] * 36 + [5] * 10
    for bad in ((7, 5), (3, 0), (0, 0, 7, 5), (0, 0, 3, 0)):  # 965 steps: no whole rounds
        with pytest.raises(ValueError):
            round_lengths(25, 1000, *bad)
    space = BlockSpace(400, 4, seed=9)
    plain = site_windows(space, sites=3, batch=2, steps=10, rounds=2)
    early = site_windows(space, sites=3, batch=2, steps=[5, 5, 10], rounds=3)
    # the same windows in the same order, cut into rounds of 5, 5 and 10 steps per site
    flat = [w for leases in early for lease in leases for w in lease]
    assert flat == [w for leases in plain for lease in leases for w in lease]
    assert [len(lease) for leases in early for lease in leases] == [10] * 6 + [20] * 3


def test_regimes_give_the_workflows_h_over_40_rounds_and_the_papers_over_20() -> None:
    assert regime_steps("long", None, None) == {25: 1000, 100: 2000}
    assert regime_steps("short", None, None) == {3: 150, 5: 150}
    assert regime_steps("long", [25], None) == {25: 1000}
    assert regime_steps("long", [10, 20], [200]) == {10: 200, 20: 200}
    assert regime_steps("long", [10, 20], [100, 200]) == {10: 100, 20: 200}
    with pytest.raises(ValueError, match="not in the long regime"):
        regime_steps("long", [7], None)
    with pytest.raises(ValueError, match="not a whole number of rounds of H=7"):
        regime_steps("long", [7], [100])
    with pytest.raises(ValueError, match="one value or one per H"):
        regime_steps("long", [5, 10, 20], [100, 200])


def test_the_runs_warm_up_as_a_new_workflow_run_does_unless_told_otherwise() -> None:
    unset, ten = Namespace(warmup_steps=None), Namespace(warmup_steps=10)
    for steps in regime_steps("long", None, None).values():  # 1,000 and 2,000 steps
        assert warmup_steps(unset, steps) == default_warmup_steps(steps) == steps // 10
        assert warmup_steps(ten, steps) == 10


def test_averaged_adam_state_is_the_sites_mean_and_the_outer_step_run_is_recorded(
    tiny_data: Path,
) -> None:
    store = WindowStore.open(tiny_data, "train")
    plan = site_windows(BlockSpace(store.n_windows, 8, seed=5), SITES, BATCH, H, 1)
    schedule = LRSchedule(peak_lr=3e-3, warmup_steps=1, total_steps=H)
    cfg, vocab = InnerConfig(micro_batch=BATCH), store.vocab_size
    kept = Run("diloco", store, vocab, 0, schedule, PRESETS["paper"], SITES, cfg)
    averaged = Run("diloco", store, vocab, 0, schedule, PRESETS["paper"], SITES, cfg)
    averaged.adam_state = "average"
    kept.round(plan[0], H)
    averaged.round(plan[0], H)
    assert _same(kept.master, averaged.master)  # the same round; only the state differs after
    kept_states = [list(opt.state.values()) for opt in kept.optimizers]
    averaged_states = [list(opt.state.values()) for opt in averaged.optimizers]
    for j in range(len(kept_states[0])):
        for key in ("exp_avg", "exp_avg_sq"):
            mean = torch.stack([states[j][key] for states in kept_states]).mean(0)
            assert not torch.equal(kept_states[0][j][key], mean)  # kept: the sites' own differ
            for states in averaged_states:
                torch.testing.assert_close(states[j][key], mean)
    assert kept.steps_run == {SITES: (0.7, 0.9)}  # the paper's step for three contributors


def test_the_json_names_only_the_settings_each_preset_steps_with() -> None:
    assert outer_json(PRESETS["average"]) == {"preset": "average", "eta": 1.0, "beta": 0.0}
    tuned = outer_json(PRESETS["tuned"])  # eta and beta of the config are not what it runs
    assert tuned["preset"] == "tuned" and tuned["beta"] == 0.0 and "sqrt" in tuned["eta"]
    assert outer_json(parse_outer("eta=0.4,beta=0.9,solo=0")[1]) == {
        "preset": "paper", "eta": 0.4, "beta": 0.9, "solo_full_step": False
    }  # fmt: skip


def test_adam_every_averages_only_at_every_kth_merge(tiny_data: Path) -> None:
    store = WindowStore.open(tiny_data, "train")
    plan = site_windows(BlockSpace(store.n_windows, 8, seed=5), SITES, BATCH, H, 2)
    schedule = LRSchedule(peak_lr=3e-3, warmup_steps=1, total_steps=2 * H)
    cfg, vocab = InnerConfig(micro_batch=BATCH), store.vocab_size
    run = Run("diloco", store, vocab, 0, schedule, PRESETS["average"], SITES, cfg)
    run.adam_state, run.adam_every = "average-v", 2

    def v_equal() -> bool:
        states = [list(opt.state.values()) for opt in run.optimizers]
        return all(
            torch.equal(states[0][j]["exp_avg_sq"], other[j]["exp_avg_sq"])
            for other in states[1:]
            for j in range(len(states[0]))
        )

    run.round(plan[0], H)
    assert not v_equal()  # merge 1 of 2: each site keeps its own second moment
    run.round(plan[1], H)
    assert v_equal()  # merge 2: averaged over the sites
    m = [list(opt.state.values())[0]["exp_avg"] for opt in run.optimizers]
    assert not torch.equal(m[0], m[1])  # average-v leaves the first moment alone


def _two_layers(sites: int | None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    groups = [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    if sites is None:
        return model, torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), fused=False)
    return model, CombinedAdamW(groups, lr=1e-2, betas=(0.9, 0.95), sites=sites)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, noise: float) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(12):
        x = torch.randn(8, 6, generator=gen)
        y = x[:, :3] + noise * torch.randn(8, 3, generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def test_combined_denominator_of_one_site_is_adamw_and_of_three_steps_further() -> None:
    torch_model, torch_opt = _two_layers(None)
    one_model, one_opt = _two_layers(1)
    three_model, three_opt = _two_layers(3)
    start = [p.detach().clone() for p in torch_model.parameters()]
    for model, opt in ((torch_model, torch_opt), (one_model, one_opt), (three_model, three_opt)):
        _train(model, opt, noise=3.0)
    for a, b in zip(torch_model.parameters(), one_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # the same gradients' noise divided by three sites: a smaller denominator, longer steps
    moved_one = sum((p - s).norm() for p, s in zip(one_model.parameters(), start, strict=True))
    moved_three = sum((p - s).norm() for p, s in zip(three_model.parameters(), start, strict=True))
    assert moved_three > 1.2 * moved_one
    assert set(three_opt.state[next(three_model.parameters())]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("flavour, dim, layers", [("tiny", 128, 4), ("small", 256, 6)])
def test_every_row_trains_the_flavour_it_is_given(
    tiny_data: Path, flavour: str, dim: int, layers: int
) -> None:
    store = WindowStore.open(tiny_data, "train")
    schedule = LRSchedule(peak_lr=3e-3, warmup_steps=1, total_steps=H)
    cfg, vocab = InnerConfig(micro_batch=BATCH), store.vocab_size
    plain = Run("diloco", store, vocab, 0, schedule, PRESETS["average"], SITES, cfg,
                flavour=flavour)  # fmt: skip
    overlapped = OverlapRun("overlap", store, vocab, 0, schedule, PRESETS["average"], SITES, cfg,
                            OverlapConfig(enabled=True), 1, flavour=flavour)  # fmt: skip
    for run in (plain, overlapped):
        assert run.master["tok_embeddings.weight"].shape == (vocab, dim)
        assert len(run.model.layers) == layers


def test_eager_stale_steps_start_from_the_sites_estimate_of_the_coming_merge(
    tiny_data: Path,
) -> None:
    store = WindowStore.open(tiny_data, "train")
    plan = site_windows(BlockSpace(store.n_windows, 8, seed=5), SITES, BATCH, H, 3)
    _, overlapped, _ = _runs(tiny_data, OverlapConfig(enabled=True), tau=1)
    overlapped.eager = True
    published, deltas = [], []
    for r, leases in enumerate(plan):
        published.append({k: v.float() for k, v in overlapped.published().items()})
        if r == 1:  # no merge before the last one yet: the site's own weights
            assert all(_same(overlapped.eager_start(i), overlapped.sent[i])
                       for i in range(SITES))  # type: ignore[arg-type]  # fmt: skip
        if r == 2:
            for i in range(SITES):
                start = overlapped.eager_start(i)
                for k, p in published[1].items():
                    own = (deltas[1][i][k].float() - deltas[0][i][k].float()) / SITES
                    expected = p + own + (p - published[0][k])
                    torch.testing.assert_close(start[k], expected, rtol=0, atol=1e-6)
                assert not _same(start, overlapped.sent[i])  # type: ignore[arg-type]
        overlapped.round(leases, H)
        deltas.append(list(overlapped.last_delta))


def test_counting_the_stale_windows_moves_only_the_embedding_rows(tiny_data: Path) -> None:
    (_, after, plan), (_, every, _) = (
        _runs(tiny_data, OverlapConfig(enabled=True), tau=1) for _ in range(2)
    )
    every.count_stale = True
    for leases in plan:
        after.round(leases, H)
        every.round(leases, H)
    embedding = rowcounts.EMBEDDING
    assert not torch.equal(after.master[embedding], every.master[embedding])
    assert _same({k: v for k, v in after.master.items() if k != embedding},
                 {k: v for k, v in every.master.items() if k != embedding})  # fmt: skip


def test_a_merged_embedding_fold_in_drops_the_stale_steps_update_of_the_embedding_only(
    tiny_data: Path,
) -> None:
    _, overlapped, plan = _runs(tiny_data, OverlapConfig(enabled=True), tau=H)
    overlapped.stale_embedding = "merged"
    embedding = rowcounts.EMBEDDING
    overlapped.round(plan[0], H)
    first = {k: v.clone() for k, v in overlapped.master.items()}
    overlapped.round(plan[1], H)  # every step stale: the fold-in comes after the last one
    assert torch.equal(overlapped.master[embedding], first[embedding])
    assert all(not torch.equal(overlapped.master[k], first[k]) for k in first if k != embedding)


def test_outer_decay_scales_each_merges_step_by_the_cosine_and_nothing_else(
    tiny_data: Path,
) -> None:
    store = WindowStore.open(tiny_data, "train")
    plan = site_windows(BlockSpace(store.n_windows, 8, seed=5), SITES, BATCH, H, 2)
    schedule = LRSchedule(peak_lr=3e-3, warmup_steps=1, total_steps=2 * H)
    cfg, vocab = InnerConfig(micro_batch=BATCH), store.vocab_size
    constant = Run("diloco", store, vocab, 0, schedule, PRESETS["average"], SITES, cfg)
    decayed = Run("diloco", store, vocab, 0, schedule, PRESETS["average"], SITES, cfg)
    decayed.outer_decay = 0.1
    constant.round(plan[0], H)
    decayed.round(plan[0], H)
    # merge 1 ends at step 1, the cosine's start: the full step
    assert _same(constant.master, decayed.master)
    assert decayed.steps_run == {SITES: (1.0, 0.0)}
    before = {k: v.clone() for k, v in decayed.master.items()}
    constant.round(plan[1], H)
    decayed.round(plan[1], H)
    # merge 2 ends at step 3 of 4, 2/3 through the decay: 0.1 + 0.9 * (1 + cos(2pi/3)) / 2
    factor = 0.1 + 0.9 * 0.25
    assert decayed.steps_run[SITES] == pytest.approx((factor, 0.0))
    for name, start in before.items():
        torch.testing.assert_close(
            decayed.master[name] - start, factor * (constant.master[name] - start),
            rtol=1e-4, atol=1e-6,
        )  # fmt: skip
