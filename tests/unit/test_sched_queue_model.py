"""The idealised queue model reproduces the paper's Table 4 within 2%."""

from __future__ import annotations

from pathlib import Path

import pytest

from crossfed.sched.queue_model import (
    ScenarioError,
    format_table,
    load_scenario,
    parse_scenario,
    simulate,
)

SCENARIOS = Path(__file__).resolve().parents[2] / "config" / "scenarios"
REL = 0.02

# Paper, Table 4: days to 100B; per site (wait h, active h, jobs, tokens B).
TABLE4 = {
    "a": (1.11, {"lumi": (0.1, 26.6, 108, 29.9), "snellius": (0.2, 26.5, 16, 70.1)}),
    "b": (2.28, {"lumi": (0.2, 54.4, 220, 61.3), "snellius": (40.0, 14.6, 8, 38.7)}),
    "c": (1.58, {"lumi": (40.0, 0.0, 0, 0.0), "snellius": (0.2, 37.8, 20, 100.0)}),
}


def _close(got: float, want: float) -> bool:
    return got == pytest.approx(want, rel=REL, abs=1e-9 if want == 0 else 0)


@pytest.mark.parametrize("name", sorted(TABLE4))
def test_table4_reproduction(name: str) -> None:
    days, sites = TABLE4[name]
    proj = simulate(load_scenario(SCENARIOS / f"table4_{name}.yaml"))
    assert _close(proj.time_to_target_d, days)
    for site, (wait, active, jobs, tokens) in sites.items():
        got = proj.sites[site]
        assert _close(got.wait_h, wait), (site, got)
        assert _close(got.active_h, active), (site, got)
        assert _close(got.jobs, jobs), (site, got)
        assert _close(got.tokens / 1e9, tokens), (site, got)
    assert sum(s.tokens for s in proj.sites.values()) == pytest.approx(100e9)


def test_queue_aware_is_18_to_43_percent_faster_than_waiting_for_all() -> None:
    speed = {n: simulate(load_scenario(SCENARIOS / f"table4_{n}.yaml")).speedup for n in "bc"}
    assert speed["b"] == pytest.approx(0.18, abs=0.01)
    assert speed["c"] == pytest.approx(0.43, abs=0.01)


def test_baseline_waits_for_the_last_site() -> None:
    proj = simulate(load_scenario(SCENARIOS / "table4_c.yaml"))
    both = 4 * (78059.7 + 183700.2)
    assert proj.baseline_h == pytest.approx(40.0 + 100e9 / both / 3600)
    assert proj.baseline_ratio == pytest.approx(proj.baseline_h / proj.time_to_target_h)


def test_jobs_count_node_allocations_to_cover_active_time() -> None:
    sc = parse_scenario(
        {
            "target_tokens": 3 * 3600 * 2 * 10.0,  # 2 nodes x 10 tok/s for 3 h
            "sites": {
                "x": {"nodes": 2, "walltime_h": 2, "tokens_per_s_per_node": 10, "queue_wait_h": 0}
            },
        }
    )
    got = simulate(sc).sites["x"]
    assert got.active_h == pytest.approx(3.0) and got.jobs == 2 * 2  # ceil(3 / 2) per node


def test_table_output_mentions_every_site() -> None:
    sc = load_scenario(SCENARIOS / "table4_b.yaml")
    text = format_table(sc, simulate(sc))
    assert "lumi" in text and "snellius" in text and "18%" in text


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "mapping"),
        ({"sites": {}}, "target_tokens"),
        ({"target_tokens": 1, "sites": {}}, "non-empty"),
        ({"target_tokens": -1, "sites": {"x": {}}}, "target_tokens"),
        ({"target_tokens": 1, "sites": {"x": {"nodes": 1}}}, "walltime_h"),
        (
            {
                "target_tokens": 1,
                "sites": {
                    "x": {
                        "nodes": 1.5,
                        "walltime_h": 1,
                        "tokens_per_s_per_node": 1,
                        "queue_wait_h": 0,
                    }
                },
            },
            "integer",
        ),
        (
            {
                "target_tokens": 1,
                "sites": {
                    "x": {
                        "nodes": 1,
                        "walltime_h": 1,
                        "tokens_per_s_per_node": "fast",
                        "queue_wait_h": 0,
                    }
                },
            },
            "tokens_per_s_per_node",
        ),
    ],
)
def test_bad_scenarios_name_the_problem(data, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(data)


def test_scenario_file_errors(tmp_path) -> None:
    with pytest.raises(ScenarioError, match="not found"):
        load_scenario(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("sites: {\n")
    with pytest.raises(ScenarioError, match="invalid YAML"):
        load_scenario(tmp_path / "bad.yaml")
