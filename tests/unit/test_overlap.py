"""The fold-in rules of overlapped rounds (crossfed.train.overlap) and their settings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crossfed.config import ConfigError, load_run_config
from crossfed.train.overlap import OverlapConfig, OverlapConfigError, fold_in
from tests.conftest import write_yaml

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
    }
    plain = load_run_config(write_yaml(tmp_path / "off.yaml", {"overlap": {"enabled": False}}))
    assert plain.overlap.enabled is False
    assert load_run_config(None).overlap.enabled is True  # on by default
    with pytest.raises(OverlapConfigError, match=r"overlap.max_stale must be in \(0, 1\]"):
        OverlapConfig.of({"max_stale": 0})
