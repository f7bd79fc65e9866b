"""Early rounds (``inner.early_rounds``, ``inner.early_steps``): the run's first rounds train
fewer inner steps, the coordinator sizes and counts each round by its own H, and a run in
progress keeps its schedule."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from crossfed.config import ConfigError, load_run_config
from crossfed.coordinator.core import CoordinatorError
from crossfed.coordinator.runspec import RunSpec, RunSpecError, schedule_steps
from crossfed.coordinator.service import Coordinator
from crossfed.darl.blockspace import BlockSpace
from crossfed.train.schedule import round_steps
from crossfed.wire.digests import sha256_file
from tests.conftest import tiny_spec
from tests.unit.test_merge_lock import Clock
from tests.unit.test_resume import _check, _workdir


@given(
    rounds=st.integers(0, 200),
    steps=st.integers(1, 500),
    early_rounds=st.integers(0, 300),
    early_steps=st.integers(1, 50),
)
def test_the_schedule_is_the_sum_of_each_rounds_h(
    rounds: int, steps: int, early_rounds: int, early_steps: int
) -> None:
    schedule = {"steps": steps, "early_rounds": early_rounds, "early_steps": early_steps}
    total = sum(round_steps(schedule, r) for r in range(1, rounds + 1))
    assert schedule_steps(rounds, steps, early_rounds, early_steps) == total
    assert round_steps(schedule, early_rounds + 1) == steps
    if early_rounds:
        assert round_steps(schedule, 1) == round_steps(schedule, early_rounds) == early_steps
    assert round_steps({"steps": steps}, 1) == steps  # a coordinator from before


def test_the_config_sets_the_runs_schedule(tmp_path: Path, tiny_data: Path) -> None:
    """``rounds`` counts every round; the LR schedule spans the early and the later ones."""
    from crossfed.config import load_sites
    from crossfed.coordinator.runspec import run_spec

    overrides = _workdir(tmp_path, tiny_data)
    inner = {"steps": 25, "early_rounds": 20, "early_steps": 5}
    config = load_run_config(None, {**overrides, "rounds": 56, "inner": inner})
    spec = run_spec(config, load_sites(config))
    assert (spec.early_rounds, spec.early_steps, spec.inner_steps) == (20, 5, 25)
    assert spec.schedule.total_steps == 20 * 5 + 36 * 25 == 1000
    assert [spec.round_steps(r) for r in (1, 20, 21, 56)] == [5, 5, 25, 25]
    plain = run_spec(load_run_config(None, overrides), load_sites(config))
    assert (plain.early_rounds, plain.early_steps) == (0, 0)  # as a run stored before
    with pytest.raises(ConfigError, match="early_steps"):
        load_run_config(None, {**overrides, "inner": {"early_rounds": 2, "early_steps": 0}})
    with pytest.raises(ConfigError, match="early_rounds"):
        load_run_config(None, {**overrides, "inner": {"early_rounds": -1}})


def test_a_run_keeps_its_early_rounds_and_one_stored_before_them_reruns_unchanged(
    tmp_path: Path, tiny_data: Path
) -> None:
    overrides = _workdir(tmp_path, tiny_data)
    run_json = tmp_path / "results" / "run.json"
    record = json.loads(run_json.read_text())
    del record["spec"]["early_rounds"], record["spec"]["early_steps"]  # stored before them
    run_json.write_text(json.dumps(record))
    _check(overrides)  # the default config has no early rounds: the run is the same
    _check({**overrides, "rounds": 10})  # more rounds still extend it
    with pytest.raises(ConfigError, match="early_rounds: 0 -> 3"):
        _check({**overrides, "inner": {"early_rounds": 3}})

    spec = tiny_spec(tiny_data, early_rounds=2, early_steps=2)
    coordinator = Coordinator(tmp_path / "state")
    coordinator.init_run(spec)
    with pytest.raises(CoordinatorError) as changed:
        coordinator.init_run(replace(spec, early_steps=3))
    assert "early_steps: 2 -> 3" in changed.value.message
    assert Coordinator(tmp_path / "state").spec.round_steps(2) == 2  # restarted: the same
    with pytest.raises(RunSpecError, match="early_steps must be >= 1"):
        RunSpec.from_dict({**spec.to_dict(), "early_steps": 0})


def test_the_coordinator_counts_each_round_by_its_own_h(tmp_path: Path, tiny_data: Path) -> None:
    """The status says each round's H and the whole schedule, a phase's step rate is its
    blocks over its round's H, and an early lease's forecast start is the open round's
    start plus that round's own H."""
    clock = Clock()
    spec = tiny_spec(tiny_data, inner_steps=6, early_rounds=1, early_steps=2)
    coordinator = Coordinator(tmp_path / "state", clock=clock)
    coordinator.init_run(spec)
    digest = BlockSpace(spec.n_windows, spec.block_size, spec.data_seed).digest()
    coordinator.register("snellius", digest, 1, None)
    status = coordinator.status()
    assert status["inner_steps"] == 2
    assert status["inner_schedule"] == {"steps": 6, "early_rounds": 1, "early_steps": 2}
    held = coordinator.lease("snellius", 1, 4, None, None)["lease"]
    coordinator.heartbeat(held["lease_id"], "snellius", 1, 0.5)
    assert coordinator._step_rates["snellius"] == pytest.approx(4 / (2 * 0.5))
    # an early lease of round 2 before round 1 has a delta: round 1 ends at its own H
    coordinator.register("lumi", digest, 1, None)
    early = coordinator.lease("lumi", 2, 2, None, None)
    assert early["early"] and early["global_step"] == 2
    master = load_file(str(coordinator.global_path(0)))
    delta = tmp_path / "delta.safetensors"
    save_file({k: torch.zeros_like(v) for k, v in master.items()}, delta)
    key = "sha256:" + sha256_file(delta)

    async def body():  # noqa: ANN202
        yield delta.read_bytes()

    import asyncio

    asyncio.run(coordinator.blobs.write_stream(key, body(), 1 << 30))
    coordinator.submit(
        site="snellius", round_no=1, lease_id=held["lease_id"], generation=0,
        tokens=32, steps=2, consumed=held["n_blocks"], blob=key,
    )  # fmt: skip
    clock.now += 60.0
    report = coordinator.tick()
    assert report is not None and report["global_step"] == 2
    assert coordinator.status()["inner_steps"] == 6  # round 2: the run's H
