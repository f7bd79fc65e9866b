"""The inner phase: a lease is sharded over W ranks x A accumulation x B windows exactly once;
simulated ranks train the same step as one big batch; a steal stops the phase at its limit;
a phase resumed from its checkpoint ends where the uninterrupted one does."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crossfed.darl.blockspace import BlockSpace
from crossfed.data.windows import WindowStore
from crossfed.train import checkpoint
from crossfed.train.distributed import Ranks
from crossfed.train.inner import (
    InnerConfig,
    InnerConfigError,
    LeaseWindows,
    PhaseState,
    Trainer,
    language_model_loss,
    make_optimizer,
    plan_step,
    plan_steps,
    rank_shares,
    run_inner_phase,
)
from crossfed.train.model import (
    attention_masks,
    build_model,
    initial_parameters,
    model_config,
    parameter_shapes,
    parameters_of,
)
from crossfed.train.schedule import LRSchedule
from crossfed.train.standalone import RecordingReader

SCHEDULE = LRSchedule(peak_lr=2e-3, warmup_steps=2, total_steps=50)


@given(
    ranks=st.integers(1, 4),
    accumulation=st.integers(1, 4),
    micro=st.integers(1, 5),
    total=st.integers(0, 120),
    start_frac=st.floats(0, 1),
)
@settings(max_examples=200, deadline=None)
def test_steps_cover_every_leased_position_exactly_once(
    ranks: int, accumulation: int, micro: int, total: int, start_frac: float
) -> None:
    config = InnerConfig(micro_batch=micro, ranks=ranks, accumulation=accumulation)
    per_step = config.windows_per_step
    start = min(total, int(start_frac * total) // per_step * per_step)  # a step boundary
    plans = list(plan_steps(total, config, start=start))
    seen = [p for plan in plans for rank in plan.micro for lo, hi in rank for p in range(lo, hi)]
    assert sorted(seen) == list(range(start, total))  # none twice, none skipped
    for plan in plans[:-1]:
        assert plan.n == per_step
    for plan in plans:
        assert len(plan.micro) == ranks
        for rank in plan.micro:
            assert len(rank) <= accumulation
            assert all(0 < hi - lo <= micro for lo, hi in rank)
        sizes = [sum(hi - lo for lo, hi in rank) for rank in plan.micro]
        assert max(sizes) - min(sizes) <= 1


def test_rank_shares_and_step_limits() -> None:
    assert rank_shares(7, 2) == [(0, 4), (4, 7)]
    assert rank_shares(1, 3) == [(0, 1), (1, 1), (1, 1)]
    plan = plan_step(16, 3, InnerConfig(micro_batch=2, ranks=2, accumulation=2))
    assert plan.micro == (((16, 18),), ((18, 19),)) and plan.passes == 1
    with pytest.raises(InnerConfigError, match="1..8 windows"):
        plan_step(0, 9, InnerConfig(micro_batch=2, ranks=2, accumulation=2))
    with pytest.raises(InnerConfigError, match="accumulation"):
        InnerConfig(accumulation=0)


def test_a_simulated_step_floor_holds_every_step_to_min_step_s(tiny_data: Path) -> None:
    store = WindowStore.open(tiny_data, "train")
    lease = LeaseWindows.of([(0, 12)])
    config = InnerConfig(micro_batch=4, ranks=1, accumulation=1, min_step_s=0.3)
    t0 = time.monotonic()
    _, _, state, _ = _phase(store, lease, config)
    assert state.steps == 3
    assert time.monotonic() - t0 >= 3 * 0.3  # slept up to the floor, not just counted it
    assert state.compute_s >= 3 * 0.3
    with pytest.raises(InnerConfigError, match="min_step_s"):
        InnerConfig(min_step_s=-1.0)


def test_a_flex_attention_model_gets_causal_masks_and_matches_sdpa() -> None:
    """GPU models use flex attention, which needs a BlockMask: each window is one causal
    document, so its loss equals the SDPA model's with the same weights (flex runs its
    forward on CPU too)."""
    sdpa = _model(64, seed=3)
    with torch.device("cpu"):
        flex = model_config("tiny", vocab_size=64, device="cuda").build()
    flex.load_state_dict(sdpa.state_dict())
    assert attention_masks(sdpa, 2, 16, "cpu") is None
    masks = attention_masks(flex, 2, 16, "cpu")
    assert masks is not None and attention_masks(flex, 2, 16, "cpu") is masks  # built once
    windows = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = language_model_loss(sdpa, windows)
        got = language_model_loss(flex, windows)
    assert torch.allclose(got, expected, atol=1e-4), (got, expected)


def test_lease_positions_map_to_dataset_windows_in_lease_order() -> None:
    lease = LeaseWindows.of([(40, 48), (8, 16), (100, 104)])
    assert len(lease) == 20
    assert lease.spans(6, 11) == [(46, 48), (8, 11)]
    assert lease.spans(14, 20) == [(14, 16), (100, 104)]
    assert lease.indices(0, 20) == [*range(40, 48), *range(8, 16), *range(100, 104)]


def _model(vocab: int, seed: int = 0) -> torch.nn.Module:
    return build_model("tiny", vocab_size=vocab, seed=seed)


def _phase(store: WindowStore, lease: LeaseWindows, config: InnerConfig, **kwargs):
    torch.manual_seed(0)
    model = _model(store.vocab_size)
    trainer = Trainer(model, make_optimizer(model, config, lr=0.0), config)
    reader = RecordingReader(store.windows)
    state = run_inner_phase(trainer, reader, lease, schedule=SCHEDULE, global_step=0, **kwargs)
    return model, trainer, state, reader


def test_simulated_ranks_train_the_same_steps_as_one_big_batch(tiny_data: Path) -> None:
    store = WindowStore.open(tiny_data, "train")
    lease = LeaseWindows.of([(0, 9), (40, 47)])  # 16 windows: two steps of 8
    ranked = InnerConfig(micro_batch=2, ranks=2, accumulation=2)
    single = InnerConfig(micro_batch=8, ranks=1, accumulation=1)
    m1, _, s1, r1 = _phase(store, lease, ranked)
    m2, _, s2, r2 = _phase(store, lease, single)
    assert s1.steps == s2.steps == 2 and s1.windows == 16 and s1.tokens == 16 * store.seq_len
    assert s1.losses == pytest.approx(s2.losses, rel=1e-5)
    for name, p in parameters_of(m1).items():
        assert torch.allclose(p, parameters_of(m2)[name], atol=1e-5), name
    assert sorted(r1.seen) == sorted(r2.seen) == lease.indices(0, 16)


class LossReads(torch.Tensor):
    """Logits, and every loss computed from them, that record each read of their value to
    the host (on an accelerator, a device sync)."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("item", "tolist", "__float__", "numpy"):
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_phase_reads_step_losses_once_at_its_end_not_every_step(tiny_data: Path) -> None:
    """On an accelerator a read of the loss makes the host wait for the device; the phase
    queues every step without one and reads all losses together when it ends."""
    store = WindowStore.open(tiny_data, "train")
    lease = LeaseWindows.of([(0, 20)])  # 5 steps of 4
    config = InnerConfig(micro_batch=2, ranks=1, accumulation=2)
    _, _, plain, _ = _phase(store, lease, config)
    LossReads.reads = []
    reads_at_step: list[int] = []
    torch.manual_seed(0)
    model = _model(store.vocab_size)
    model.register_forward_hook(lambda _m, _in, logits: logits.as_subclass(LossReads))
    trainer = Trainer(model, make_optimizer(model, config, lr=0.0), config)
    infos = []

    def on_step(info) -> None:
        reads_at_step.append(len(LossReads.reads))
        infos.append(info)

    state = run_inner_phase(
        trainer, store.windows, lease, schedule=SCHEDULE, global_step=0, on_step=on_step
    )
    assert reads_at_step == [0] * 5  # no step waited for a loss
    assert LossReads.reads == ["tolist"]  # one read for all five, at the end
    assert state.losses == pytest.approx(plain.losses, rel=1e-6)
    assert [info.loss for info in infos] == pytest.approx(state.losses, rel=1e-6)  # on demand


def test_a_steal_stops_the_phase_exactly_at_the_new_limit(tiny_data: Path) -> None:
    store = WindowStore.open(tiny_data, "train")
    lease = LeaseWindows.of([(0, 24)])
    config = InnerConfig(micro_batch=4, ranks=1, accumulation=2)
    _, _, state, reader = _phase(store, lease, config, window_limit=lambda: 13)
    assert state.windows == 13 and state.steps == 2 and state.stopped_early
    assert reader.seen == list(range(13))


def test_a_phase_resumed_from_its_checkpoint_ends_as_the_uninterrupted_one(
    tiny_data: Path, tmp_path: Path
) -> None:
    store = WindowStore.open(tiny_data, "train")
    lease = LeaseWindows.of([(200, 212), (8, 20)])  # 24 windows, 3 steps of 8
    config = InnerConfig(micro_batch=4, ranks=2, accumulation=1)
    whole, _, done, _ = _phase(store, lease, config)

    class Killed(Exception):
        pass

    def save_then_die(state: PhaseState) -> None:
        cursor = {"round": 1, "status": "training", **state.to_dict()}
        checkpoint.save(tmp_path, trainer.model, trainer.optimizer, cursor, Ranks())
        raise Killed

    torch.manual_seed(0)
    model = _model(store.vocab_size)
    trainer = Trainer(model, make_optimizer(model, config, lr=0.0), config)
    with pytest.raises(Killed):
        run_inner_phase(
            trainer,
            store.windows,
            lease,
            schedule=SCHEDULE,
            global_step=0,
            checkpoint=save_then_die,
            checkpoint_every=1,
        )
    cursor = checkpoint.latest(tmp_path)
    assert cursor is not None and cursor["windows"] == 8 and cursor["steps"] == 1

    fresh = _model(store.vocab_size, seed=5)  # other weights: all must come from the checkpoint
    trainer = Trainer(fresh, make_optimizer(fresh, config, lr=0.0), config)
    checkpoint.load(cursor, fresh, trainer.optimizer, weights=True)
    reader = RecordingReader(store.windows)
    state = run_inner_phase(
        trainer,
        reader,
        lease,
        schedule=SCHEDULE,
        global_step=0,
        state=PhaseState.from_dict(cursor),
    )
    assert reader.seen == lease.indices(8, 24)  # no window retrained, none skipped
    assert state.steps == done.steps and state.windows == done.windows
    assert state.losses == pytest.approx(done.losses, rel=1e-5)
    for name, p in parameters_of(fresh).items():
        assert torch.allclose(p, parameters_of(whole)[name], atol=1e-6), name


def test_checkpoint_pointer_names_only_complete_checkpoints(
    tiny_data: Path, tmp_path: Path
) -> None:
    store = WindowStore.open(tiny_data, "train")
    model = _model(store.vocab_size)
    optimizer = make_optimizer(model, InnerConfig(), lr=1e-3)
    assert checkpoint.latest(tmp_path) is None
    cursor = {"round": 2, "status": "training", "steps": 3, "windows": 24}
    checkpoint.save(tmp_path, model, optimizer, cursor, Ranks())
    (tmp_path / "ckpt-r00002-s000004-training").mkdir()  # a torn attempt of a killed job
    latest = checkpoint.latest(tmp_path)
    assert latest is not None and latest["steps"] == 3 and latest["world"] == 1
    checkpoint.save(tmp_path, model, optimizer, {**cursor, "status": "done"}, Ranks())
    assert [p.name for p in tmp_path.glob("ckpt-*")] == ["ckpt-r00002-s000003-done"]
    (tmp_path / checkpoint.POINTER).write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="unreadable"):
        checkpoint.latest(tmp_path)


def test_an_early_phase_checkpoint_keeps_the_weights_its_fold_in_needs_until_it_folds(
    tiny_data: Path, tmp_path: Path
) -> None:
    """Overlapped rounds: an early phase's checkpoints name the end-of-phase checkpoint the
    site sent its last delta from (``folds_from``); that one stays until a checkpoint no
    longer names it, and its weights load alone (the optimiser state untouched)."""
    store = WindowStore.open(tiny_data, "train")
    model = _model(store.vocab_size)
    optimizer = make_optimizer(model, InnerConfig(), lr=1e-3)
    done = {"round": 1, "status": "done", "steps": 4, "windows": 16}
    sent = checkpoint.save(tmp_path, model, optimizer, done, Ranks())
    sent_weights = {k: v.clone() for k, v in parameters_of(model).items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the early phase trains on
    early = {"round": 2, "status": "training", "steps": 1, "windows": 4, "generation": -1}
    checkpoint.save(tmp_path, model, optimizer, {**early, "folds_from": sent.name}, Ranks())
    checkpoint.save(
        tmp_path, model, optimizer, {**early, "steps": 2, "folds_from": sent.name}, Ranks()
    )
    names = sorted(p.name for p in tmp_path.glob("ckpt-*"))
    assert names == [sent.name, "ckpt-r00002-s000002-training"]
    checkpoint.load_weights(sent, model)
    for name, p in parameters_of(model).items():
        assert torch.equal(p, sent_weights[name]), name
    checkpoint.save(tmp_path, model, optimizer, {**early, "steps": 3, "generation": 1}, Ranks())
    assert [p.name for p in tmp_path.glob("ckpt-*")] == ["ckpt-r00002-s000003-training"]


def test_a_background_checkpoint_holds_the_state_of_its_call_while_training_goes_on(
    tiny_data: Path, tmp_path: Path
) -> None:
    """A mid-phase checkpoint written in the background: the steps taken while it is written
    change neither the weights nor the AdamW state it saves, and the pointer moves to it
    only once it is complete."""
    store = WindowStore.open(tiny_data, "train")
    lease = LeaseWindows.of([(0, 48)])
    config = InnerConfig(micro_batch=4, ranks=2, accumulation=1)
    torch.manual_seed(0)
    model = _model(store.vocab_size)
    trainer = Trainer(model, make_optimizer(model, config, lr=0.0), config)
    first = {"round": 1, "status": "training", "steps": 0, "windows": 0}
    checkpoint.save(tmp_path, model, trainer.optimizer, first, Ranks())
    saved: list[tuple[dict, dict, checkpoint.BackgroundSave]] = []

    def save_once(state: PhaseState) -> None:
        if saved:
            return
        cursor = {"round": 1, "status": "training", **state.to_dict()}
        weights = {k: v.detach().clone() for k, v in parameters_of(model).items()}
        moments = {
            k: trainer.optimizer.state[p]["exp_avg_sq"].clone()
            for k, p in parameters_of(model).items()
        }
        pending = checkpoint.save_in_background(tmp_path, model, trainer.optimizer, cursor, Ranks())
        saved.append((weights, moments, pending))

    run_inner_phase(
        trainer,
        store.windows,
        lease,
        schedule=SCHEDULE,
        global_step=0,
        checkpoint=save_once,
        checkpoint_every=1,
    )  # fmt: skip: four more steps ran while the first checkpoint was written
    weights, moments, pending = saved[0]
    assert pending.wait().name == "ckpt-r00001-s000001-training"
    cursor = checkpoint.latest(tmp_path)
    assert cursor is not None and cursor["steps"] == 1 and cursor["windows"] == 8
    assert [p.name for p in tmp_path.glob("ckpt-*")] == [pending.path.name]
    moved = parameters_of(model)
    assert any(not torch.equal(moved[k], weights[k]) for k in weights)  # training went on
    fresh = _model(store.vocab_size, seed=5)
    optimizer = make_optimizer(fresh, config, lr=0.0)
    checkpoint.load(cursor, fresh, optimizer, weights=True)
    for name, p in parameters_of(fresh).items():
        assert torch.equal(p, weights[name]), name
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], moments[name]), name


def test_the_held_out_split_is_outside_the_leasable_block_space(tiny_data: Path) -> None:
    train, val = WindowStore.open(tiny_data, "train"), WindowStore.open(tiny_data, "val")
    space = BlockSpace(train.n_windows, 8, 7)
    last = max(space.block_windows(b).stop for b in range(space.n_blocks))
    assert last == train.n_windows and train.path != val.path
    first_val = val.windows(0, 1)[0]
    assert not np.any(np.all(train.windows(train.n_windows - 4, train.n_windows) == first_val, 1))


@pytest.mark.parametrize("flavour", ["tiny", "small"])
def test_initial_parameters_stream_build_models_weights_bit_for_bit(flavour: str) -> None:
    """Run creation draws the initial model one layer at a time: the same tensors, in the
    same order, as building it whole (tied embedding included), and the caller's random
    stream is neither used nor moved."""
    reference = parameters_of(build_model(flavour, vocab_size=512, seed=11))
    torch.manual_seed(5)
    names = []
    for name, value in initial_parameters(flavour, vocab_size=512, seed=11):
        names.append(name)
        assert torch.equal(value, reference[name]), name
        torch.rand(7)  # the caller draws between tensors: the stream must not notice
    after = torch.rand(3)
    assert names == list(reference)
    torch.manual_seed(5)
    for _ in names:
        torch.rand(7)
    assert torch.equal(after, torch.rand(3))  # and the caller's own stream ran as if alone
    assert parameter_shapes(flavour, vocab_size=512) == {
        k: tuple(v.shape) for k, v in reference.items()
    }
