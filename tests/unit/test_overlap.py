"""The fold-in rules of overlapped rounds (crossfed.train.overlap) and their settings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crossfed.config import ConfigError, load_run_config
from crossfed.train.overlap import (
    MergeWaits,
    OverlapConfig,
    OverlapConfigError,
    StaleBudget,
    fold_in,
)
from tests.conftest import REPO, write_yaml

values = st.lists(st.floats(-4, 4, allow_nan=False, width=32), min_size=3, max_size=3)


@settings(max_examples=50, deadline=None)
@given(theta=values, sent=values, merged=values)
def test_rebase_keeps_the_steps_since_the_send_on_the_merged_model(theta, sent, merged) -> None:
    t, s, m = (torch.tensor(v) for v in (theta, sent, merged))
    out = fold_in({"w": t}, {"w": s}, {"w": m}, OverlapConfig(enabled=True))["w"]
    torch.testing.assert_close(out - m, t - s, rtol=0, atol=1e-5)  # the overlap's progress


def test_a_fold_in_with_no_step_since_the_send_is_the_merged_model_exactly() -> None:
    theta = {"w": torch.randn(4, 3), "b": torch.randn(3).to(torch.bfloat16)}
    merged = {k: torch.randn_like(v.float()).to(v.dtype) for k, v in theta.items()}
    out = fold_in(theta, theta, merged, OverlapConfig(enabled=True))
    for name in theta:
        assert out[name].dtype == theta[name].dtype and torch.equal(out[name], merged[name])


def test_a_stale_weight_keeps_that_share_of_the_steps_since_the_send() -> None:
    theta, sent = {"w": torch.tensor([5.0, -1.0])}, {"w": torch.tensor([1.0, 3.0])}
    merged = {"w": torch.tensor([10.0, 20.0])}
    for weight, expected in ((1.0, [14.0, 16.0]), (0.5, [12.0, 18.0]), (0.0, [10.0, 20.0])):
        config = OverlapConfig(enabled=True, stale_weight=weight)
        assert torch.equal(fold_in(theta, sent, merged, config)["w"], torch.tensor(expected))
    mix = OverlapConfig(enabled=True, rule="mix", alpha=0.25, stale_weight=0.0)  # rebase only
    mixed = 0.25 * theta["w"] + 0.75 * merged["w"]
    assert torch.equal(fold_in(theta, sent, merged, mix)["w"], mixed)


def test_mix_is_streaming_diloco_alpha_of_own_weights() -> None:
    theta, merged = {"w": torch.full((2,), 3.0)}, {"w": torch.full((2,), 11.0)}
    config = OverlapConfig(enabled=True, rule="mix", alpha=0.25)
    assert torch.equal(fold_in(theta, {"w": torch.zeros(2)}, merged, config)["w"],
                       torch.full((2,), 0.25 * 3 + 0.75 * 11))  # fmt: skip
    with pytest.raises(ValueError, match="different tensors"):
        fold_in(theta, theta, {"v": torch.zeros(2)}, config)


def test_bad_overlap_settings_name_the_problem(tmp_path) -> None:
    with pytest.raises(OverlapConfigError, match="overlap.rule must be one of rebase, mix"):
        OverlapConfig(rule="eager")
    with pytest.raises(OverlapConfigError, match=r"overlap.alpha must be in \[0, 1\]"):
        OverlapConfig(alpha=1.5)
    with pytest.raises(OverlapConfigError, match="unknown overlap setting"):
        OverlapConfig.of({"enabled": True, "mixing": 0.5})
    assert OverlapConfig.of(True) == OverlapConfig(enabled=True)
    path = write_yaml(tmp_path / "config.yaml", {"overlap": {"enabled": True, "rule": "eagre"}})
    with pytest.raises(ConfigError, match="overlap.rule"):
        load_run_config(path)
    config = load_run_config(write_yaml(tmp_path / "ok.yaml", {"overlap": {"enabled": True}}))
    assert config.overlap.as_dict() == {
        "enabled": True,
        "rule": "rebase",
        "alpha": 0.5,
        "max_stale": 0.25,
        "stale_burst": 0.75,
        "stale_weight": 1.0,
    }
    plain = load_run_config(write_yaml(tmp_path / "off.yaml", {"overlap": {"enabled": False}}))
    assert plain.overlap.enabled is False
    assert load_run_config(None).overlap.enabled is True  # on by default
    with pytest.raises(OverlapConfigError, match=r"overlap.max_stale must be in \(0, 1\]"):
        OverlapConfig.of({"max_stale": 0})
    with pytest.raises(OverlapConfigError, match=r"overlap.stale_burst must be in \[0, 1\]"):
        OverlapConfig.of({"stale_burst": 1.5})
    with pytest.raises(OverlapConfigError, match="overlap.stale_burst must be a number"):
        OverlapConfig.of({"stale_burst": "lots"})
    with pytest.raises(OverlapConfigError, match=r"overlap.stale_weight must be in \[0, 1\]"):
        OverlapConfig.of({"stale_weight": 2})
    assert OverlapConfig.of({"stale_weight": 0}).stale_weight == 0.0
    path = write_yaml(tmp_path / "weight.yaml", {"overlap": {"stale_weight": 1.5}})
    with pytest.raises(ConfigError, match="stale_weight"):
        load_run_config(path)
    path = write_yaml(tmp_path / "half.yaml", {"overlap": {"stale_weight": 0.5}})
    assert load_run_config(path).overlap.stale_weight == 0.5
    path = write_yaml(tmp_path / "burst.yaml", {"overlap": {"stale_burst": -0.1}})
    with pytest.raises(ConfigError, match="stale_burst"):
        load_run_config(path)


@settings(max_examples=200, deadline=None)
@given(
    max_stale=st.floats(0.05, 1.0),
    burst=st.floats(0.0, 1.0),
    late=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40),
)
def test_the_stale_budget_bounds_the_mean_and_lends_what_earlier_phases_left(
    max_stale, burst, late
) -> None:
    """Each phase takes what it wants before its fold-in (``late``), up to what the budget
    allows: over any run of phases the total is at most max_stale a phase plus the burst,
    and a phase is never held to less than max_stale."""
    budget = StaleBudget(max_stale, burst)
    taken = []
    for want in late:
        allowed = budget.allowed()
        assert min(1.0, max_stale) <= allowed <= min(1.0, max_stale + burst) + 1e-12
        taken.append(min(want, allowed))
        budget.spend(taken[-1])
    for i in range(len(taken)):
        for j in range(i + 1, len(taken) + 1):
            assert sum(taken[i:j]) <= (j - i) * max_stale + burst + 1e-9


def test_the_stale_budget_trains_through_one_late_merge_not_a_late_merge_every_round() -> None:
    budget = StaleBudget(0.25, 0.75)
    assert budget.allowed() == 1.0  # a job starts with the bucket full
    budget.spend(1.0)  # a merge held up by a restart: the whole phase trained before it
    assert budget.allowed() == 0.25
    for _ in range(3):  # late every round (a long link): a quarter in, as without a burst
        budget.spend(budget.allowed())
        assert budget.allowed() == 0.25
    for _ in range(3):  # merges in time again: what they leave unused accrues
        budget.spend(0.0)
    assert budget.allowed() == 1.0
    strict = StaleBudget(0.25, 0.0)
    strict.spend(0.0)
    assert strict.allowed() == 0.25


def test_long_merge_waits_are_named_once_when_they_persist() -> None:
    """A wait of a second or more and a tenth of the phase's compute, two rounds in a row,
    is named once, with the settings that hide it; a single long wait (a slow site), short
    ones, or long ones broken by a short one are not."""
    waits = MergeWaits(max_stale=0.25)
    assert waits.advice(3.0, 20.0) is None  # one long wait
    assert waits.advice(0.5, 20.0) is None  # a short one resets the count
    assert waits.advice(1.5, 20.0) is None  # 7.5% of the compute: not long
    assert waits.advice(2.5, 20.0) is None
    said = waits.advice(4.0, 20.0)
    assert said is not None and "waited 4.0s" in said and "20% of the phase's compute" in said
    assert "25% of a phase" in said and "overlap.max_stale" in said and "inner.steps" in said
    assert waits.advice(9.0, 20.0) is None  # once a job
    other = MergeWaits(max_stale=0.5)
    assert other.advice(2.0, 0.0) is None and "beside the phase" in (other.advice(2.0, 0.0) or "")


def test_every_overlap_setting_reaches_the_site_job(tmp_path) -> None:
    """The site job's fold-in runs with the config's overlap section, key for key."""
    from crossfed.config import load_sites
    from crossfed.site.job import site_settings

    raw = {"enabled": True, "rule": "rebase", "alpha": 0.3, "max_stale": 0.5,
           "stale_burst": 0.2, "stale_weight": 0.25}  # fmt: skip
    sites = str(REPO / "config" / "sites.yaml")
    config = load_run_config(write_yaml(tmp_path / "c.yaml", {"overlap": raw, "sites_file": sites}))
    settings = site_settings(config, "lumi", load_sites(config)["lumi"])
    assert settings.overlap == OverlapConfig(**raw)
