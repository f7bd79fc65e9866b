"""The waterfill planner: waterfill primitives, eligibility, shapes, accumulation, JSON."""

from __future__ import annotations

import itertools
import json
import math
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossfed.config import Shape, SiteConfig
from crossfed.sched.planner import (
    FixedJob,
    Plan,
    PlanError,
    PlanParams,
    Segment,
    accumulation_steps,
    delivered,
    finish_time,
    finish_times,
    make_plan,
    read_plan,
    write_plan,
)
from crossfed.sched.probe import ProbeReason, ProbeResult, probe_frame, probe_row

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
H = 3600.0


def slurm_site(name, shapes, *, rate=1000.0, qos=4, max_wall_h=48, ranks=4, micro=2, acc=1):
    return SiteConfig(
        name=name,
        ranks=ranks,
        micro_batch=micro,
        accumulation=acc,
        tokens_per_s_per_gpu=rate,
        scheduler="slurm",
        max_walltime_s=max_wall_h * H,
        qos_max_nodes=qos,
        shapes=tuple(shapes),
    )


def shape(name="s", nodes=1, gpn=4, wall_h=8.0):
    return Shape(name, "p", nodes, gpn, wall_h * H)


def ok(wait_s):
    return ProbeResult(True, ProbeReason.OK, "", None, wait_s)


def probes(*rows):
    """rows: (site, shape, ProbeResult, age_s)."""
    return probe_frame(
        probe_row(site, sh, res, NOW - timedelta(seconds=age)) for site, sh, res, age in rows
    )


def params(units, **kw):
    return PlanParams(units_total=units, **kw)


# ----------------------------------------------------------------------------- waterfill


def test_finish_time_joins_later_segments() -> None:
    segs = [Segment(0.0, 1.0), Segment(10.0, 3.0)]
    # 10 units by t=10, then 4 units/s: 30 units at t=15
    assert finish_time(segs, 30.0) == pytest.approx(15.0)
    assert finish_times(segs, [5.0, 10.0, 30.0]) == pytest.approx([5.0, 10.0, 15.0])
    assert delivered(segs, 15.0) == pytest.approx(30.0)


def test_finish_time_respects_segment_ends_and_unreachable() -> None:
    segs = [Segment(0.0, 2.0, end=5.0)]
    assert finish_time(segs, 10.0) == pytest.approx(5.0)
    assert finish_time(segs, 10.5) == math.inf
    assert finish_time([], 1.0) == math.inf
    assert finish_time(segs, 0.0) == 0.0


@given(
    st.lists(
        st.tuples(
            st.floats(0, 100), st.floats(0.01, 10), st.one_of(st.just(math.inf), st.floats(0, 200))
        ),
        min_size=1,
        max_size=8,
    ),
    st.floats(0.1, 500),
)
def test_finish_time_inverts_delivered(raw, units) -> None:
    segs = [Segment(s, r, max(e, s)) for s, r, e in raw]
    t = finish_time(segs, units)
    if math.isfinite(t):
        assert delivered(segs, t) == pytest.approx(units, rel=1e-6, abs=1e-6)
        assert delivered(segs, t * (1 - 1e-6) - 1e-6) < units + 1e-6
    else:
        assert delivered(segs, 1e9) < units


# ----------------------------------------------------------------------------- planning


def test_soonest_site_fills_first_and_late_site_gets_nothing() -> None:
    a = slurm_site("a", [shape()])
    b = slurm_site("b", [shape()])
    pr = probes(("a", a.shapes[0], ok(0.0), 0), ("b", b.shapes[0], ok(1000 * H), 0))
    plan = make_plan({"a": a, "b": b}, pr, params(1e9), NOW)
    assert plan.sites["a"].submit and not plan.sites["b"].submit
    assert "starts after the predicted finish" in plan.sites["b"].reason
    assert plan.sites["a"].units == pytest.approx(1e9)
    # 4 lanes of 4 GPUs x 1000 tokens/s
    assert plan.predicted_finish_s == pytest.approx(1e9 / 16000)


def test_free_sites_split_in_proportion_to_throughput() -> None:
    a = slurm_site("a", [shape(gpn=4)], rate=1000.0)
    b = slurm_site("b", [shape(gpn=8)], rate=3000.0, qos=2)
    pr = probes(("a", a.shapes[0], ok(0.0), 0), ("b", b.shapes[0], ok(0.0), 0))
    plan = make_plan({"a": a, "b": b}, pr, params(1e8), NOW)
    thr_a, thr_b = 4 * 4 * 1000.0, 2 * 8 * 3000.0
    assert plan.sites["b"].units / plan.sites["a"].units == pytest.approx(thr_b / thr_a)


def test_estimated_start_is_discounted_probe_wait_minus_age() -> None:
    a = slurm_site("a", [shape()])
    pr = probes(("a", a.shapes[0], ok(10 * H), 1 * H))
    plan = make_plan({"a": a}, pr, params(1e6, gamma=0.5), NOW)
    assert plan.sites["a"].predicted_start_s == pytest.approx(0.5 * 10 * H - 1 * H)
    assert plan.sites["a"].gamma == 0.5
    per_site = make_plan({"a": a}, pr, params(1e6), NOW, gammas={"a": 0.2})
    assert per_site.sites["a"].predicted_start_s == pytest.approx(1 * H)


def test_stale_and_failed_probes_exclude_sites() -> None:
    a = slurm_site("a", [shape()])
    stale = slurm_site("stale", [shape()])
    failed = slurm_site("failed", [shape()])
    never = slurm_site("never", [shape()])
    pr = probes(
        ("a", a.shapes[0], ok(0.0), 0),
        ("stale", stale.shapes[0], ok(0.0), 2 * H),
        ("failed", failed.shapes[0], ProbeResult(False, ProbeReason.TIME_LIMIT, "x"), 0),
    )
    sites = {"a": a, "stale": stale, "failed": failed, "never": never}
    plan = make_plan(sites, pr, params(1e6, max_probe_age_s=H), NOW)
    assert plan.sites["stale"].reason.startswith("stale_probe")
    assert plan.sites["failed"].reason == "probe_failed: s: time_limit"
    assert plan.sites["never"].reason.startswith("no_probe")
    for s in ("stale", "failed", "never"):
        assert not plan.sites[s].submit and plan.sites[s].units == 0
    assert plan.sites["a"].units == pytest.approx(1e6)


def test_newest_probe_of_a_shape_wins() -> None:
    a = slurm_site("a", [shape()])
    pr = probes(
        ("a", a.shapes[0], ok(0.0), 600),
        ("a", a.shapes[0], ProbeResult(False, ProbeReason.NODE_CONFIG, "x"), 60),
    )
    plan = make_plan({"a": a}, pr, params(1e6), NOW)
    assert plan.mode == "infeasible" and "node_config" in plan.sites["a"].reason


def test_shape_choice_minimises_finish() -> None:
    fast_late = shape("big-late", nodes=4, gpn=4, wall_h=24)
    small_now = shape("small-now", nodes=1, gpn=4, wall_h=8)
    a = slurm_site("a", [fast_late, small_now], qos=4)
    pr = probes(("a", fast_late, ok(50 * H), 0), ("a", small_now, ok(0.0), 0))
    plan = make_plan({"a": a}, pr, params(1e8), NOW)
    assert plan.sites["a"].shape == "small-now"
    pr2 = probes(("a", fast_late, ok(0.0), 0), ("a", small_now, ok(0.0), 0))
    # equal throughput under QoS 4: prefer the smaller allocation
    assert make_plan({"a": a}, pr2, params(1e8), NOW).sites["a"].shape == "small-now"


def test_shape_over_site_limits_is_skipped() -> None:
    long = shape("long", wall_h=200)
    wide = shape("wide", nodes=8)
    a = slurm_site("a", [long, wide], max_wall_h=48, qos=4)
    pr = probes(("a", long, ok(0.0), 0), ("a", wide, ok(0.0), 0))
    plan = make_plan({"a": a}, pr, params(1e6), NOW)
    assert not plan.sites["a"].submit
    assert "walltime over site maximum" in plan.sites["a"].reason
    assert "nodes over QoS limit" in plan.sites["a"].reason


def test_jobs_chain_and_are_capped_at_walltime() -> None:
    a = slurm_site("a", [shape(wall_h=1.0)], rate=1.0, qos=1)
    pr = probes(("a", a.shapes[0], ok(0.0), 0))
    # 4 tokens/s on one lane: 10 h of work -> 10 one-hour jobs
    plan = make_plan({"a": a}, pr, params(4 * 10 * H), NOW)
    sp = plan.sites["a"]
    assert sp.jobs == 10 and sp.lanes == 1
    assert all(j.end_s - j.start_s <= H + 1e-6 for j in sp.planned_jobs())
    assert all(
        b.start_s == pytest.approx(a.end_s) for a, b in itertools.pairwise(sp.planned_jobs())
    )


def test_reserve_pads_last_job_but_not_beyond_walltime() -> None:
    a = slurm_site("a", [shape(wall_h=1.0)], rate=1.0, qos=1)
    pr = probes(("a", a.shapes[0], ok(0.0), 0))
    plan = make_plan({"a": a}, pr, params(4 * 2.5 * H, reserve_s=600), NOW)
    last = plan.sites["a"].planned_jobs()[-1]
    assert last.end_s - last.start_s == pytest.approx(0.5 * H)
    assert last.walltime_s == pytest.approx(0.5 * H + 600)
    big = make_plan({"a": a}, pr, params(4 * 2.5 * H, reserve_s=5 * H), NOW)
    assert big.sites["a"].planned_jobs()[-1].walltime_s == pytest.approx(H)


def test_min_units_per_job_drops_small_contributors() -> None:
    a = slurm_site("a", [shape()], qos=1)
    b = slurm_site("b", [shape()], qos=1)
    pr = probes(("a", a.shapes[0], ok(0.0), 0), ("b", b.shapes[0], ok(9 * H), 0))
    # a alone: 4000 tokens/s; 40 h of work. b would start at 9 h.
    units = 4000 * 10 * H
    both = make_plan({"a": a, "b": b}, pr, params(units), NOW)
    assert both.sites["b"].submit
    b_units = both.sites["b"].units
    plan = make_plan({"a": a, "b": b}, pr, params(units, min_units_per_job=b_units * 1.5), NOW)
    assert not plan.sites["b"].submit and "min_units_per_job" in plan.sites["b"].reason
    assert plan.sites["a"].units == pytest.approx(units)


def test_min_units_never_leaves_the_work_unassigned() -> None:
    a = slurm_site("a", [shape()], qos=1)
    pr = probes(("a", a.shapes[0], ok(0.0), 0))
    plan = make_plan({"a": a}, pr, params(10.0, min_units_per_job=1e9), NOW)
    assert plan.sites["a"].units == pytest.approx(10.0)


def test_running_jobs_are_kept_and_only_the_remainder_is_planned() -> None:
    a = slurm_site("a", [shape(wall_h=8)], rate=1000.0, qos=1)
    pr = probes(("a", a.shapes[0], ok(0.0), 0))
    running = FixedJob("a", "s", start=NOW - timedelta(hours=2), end=NOW + timedelta(hours=6))
    units = 4000 * 10 * H  # 10 h of one lane
    plan = make_plan({"a": a}, pr, params(units), NOW, fixed=[running])
    sp = plan.sites["a"]
    assert sp.fixed_units == pytest.approx(4000 * 6 * H)
    assert sp.units == pytest.approx(4000 * 4 * H)
    # the QoS lane is busy: the next job starts when the running one ends
    assert sp.predicted_start_s == pytest.approx(6 * H)
    assert plan.predicted_finish_s == pytest.approx(10 * H)


def test_fixed_job_for_unknown_site_or_shape_is_an_error() -> None:
    a = slurm_site("a", [shape()])
    pr = probes(("a", a.shapes[0], ok(0.0), 0))
    with pytest.raises(PlanError, match="unknown site"):
        make_plan({"a": a}, pr, params(1.0), NOW, fixed=[FixedJob("zz", None)])
    with pytest.raises(PlanError, match="unknown shape"):
        make_plan({"a": a}, pr, params(1.0), NOW, fixed=[FixedJob("a", "zz")])


def test_all_local_sites_start_now_with_configured_accumulation() -> None:
    x = SiteConfig("x", ranks=1, micro_batch=2, accumulation=3, tokens_per_s_per_gpu=100.0)
    y = SiteConfig("y", ranks=2, micro_batch=2, accumulation=1, tokens_per_s_per_gpu=100.0)
    plan = make_plan({"x": x, "y": y}, probes(), params(3000.0), NOW)
    assert plan.mode == "all_now"
    for name, a in (("x", 3), ("y", 1)):
        sp = plan.sites[name]
        assert sp.submit and sp.predicted_start_s == 0 and sp.jobs == 1
        assert sp.accumulation == a and "no batch scheduler" in sp.reason
    assert plan.sites["y"].units == pytest.approx(2 * plan.sites["x"].units)


def test_accumulation_proportional_to_throughput() -> None:
    sites = {
        "slow": slurm_site("slow", [shape()], acc=2),
        "fast": slurm_site("fast", [shape()]),
        "faster": slurm_site("faster", [shape()]),
    }
    acc = accumulation_steps(sites, {"slow": 100.0, "fast": 250.0, "faster": 1000.0})
    assert acc == {"slow": 2, "fast": 5, "faster": 20}
    one = accumulation_steps({"s": slurm_site("s", [shape()])}, {"s": 5.0})
    assert one == {"s": 1}


def test_plan_sets_accumulation_for_submitting_sites() -> None:
    a = slurm_site("a", [shape(gpn=4)], rate=1000.0)
    b = slurm_site("b", [shape(gpn=4)], rate=3000.0)
    pr = probes(("a", a.shapes[0], ok(0.0), 0), ("b", b.shapes[0], ok(0.0), 0))
    plan = make_plan({"a": a, "b": b}, pr, params(1e9), NOW)
    assert (plan.sites["a"].accumulation, plan.sites["b"].accumulation) == (1, 3)


def test_round_progress_and_done() -> None:
    a = slurm_site("a", [shape()], qos=1, rate=1.0)
    pr = probes(("a", a.shapes[0], ok(0.0), 0))
    plan = make_plan({"a": a}, pr, params(100.0, units_per_round=10.0, round=4), NOW)
    assert plan.units_outstanding == 60.0 and plan.rounds_remaining == 6
    assert plan.round_ends_s == pytest.approx([10 / 4 * k for k in range(1, 7)])
    done = make_plan({"a": a}, pr, params(100.0, units_per_round=10.0, round=10), NOW)
    assert done.mode == "done" and not done.sites["a"].submit


def test_plan_json_round_trip(tmp_path) -> None:
    a = slurm_site("a", [shape()])
    pr = probes(("a", a.shapes[0], ok(H), 0))
    plan = make_plan({"a": a}, pr, params(1e8, units_per_round=1e6), NOW)
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    data = json.loads(path.read_text())
    assert data["sites"]["a"]["submit"] is True and data["sites"]["a"]["shape"] == "s"
    assert {
        "jobs",
        "units",
        "accumulation",
        "predicted_start",
        "predicted_finish",
        "reason",
    } <= set(data["sites"]["a"])
    assert read_plan(path) == plan
    with pytest.raises(PlanError):
        Plan.from_dict({"sites": {}})


def test_bad_params_are_plan_errors() -> None:
    with pytest.raises(PlanError, match="gamma"):
        PlanParams(units_total=1.0, gamma=1.5)
    with pytest.raises(PlanError, match="units_per_round"):
        PlanParams(units_total=1.0, units_per_round=0)


# ----------------------------------------------------------------------------- properties


@st.composite
def scenarios(draw):
    n_sites = draw(st.integers(1, 5))
    sites, rows = {}, []
    for i in range(n_sites):
        name = f"site{i}"
        shapes = []
        for k in range(draw(st.integers(1, 3))):
            shapes.append(
                shape(
                    f"sh{k}",
                    nodes=draw(st.integers(1, 4)),
                    gpn=draw(st.integers(1, 8)),
                    wall_h=draw(st.sampled_from([0.5, 1.0, 2.0, 8.0, 24.0])),
                )
            )
        site = slurm_site(
            name,
            shapes,
            rate=draw(st.floats(100, 20000)),
            qos=draw(st.integers(1, 8)),
            max_wall_h=draw(st.sampled_from([1, 8, 48])),
        )
        sites[name] = site
        for sh in shapes:
            if draw(st.booleans()) or len(shapes) == 1:
                res = draw(
                    st.one_of(
                        st.builds(ok, st.floats(0, 100 * H)),
                        st.just(ProbeResult(False, ProbeReason.TIME_LIMIT, "x")),
                    )
                )
                rows.append((name, sh, res, draw(st.floats(0, 2 * H))))
    units = draw(st.floats(1e3, 1e10))
    return sites, probes(*rows), units


def _eligible(sites, pr, max_age):
    for name, site in sites.items():
        for sh in site.shapes:
            r = pr[(pr["site"] == name) & (pr["shape"] == sh.name)]
            fresh = [
                row.ok
                and (NOW - datetime.fromisoformat(row.probed_at)).total_seconds() <= max_age
                and sh.walltime_s <= site.max_walltime_s
                and sh.nodes <= site.qos_max_nodes
                for row in r.itertuples()
            ]
            if fresh and fresh[-1]:
                return True
    return False


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.floats(0, 1e6))
def test_waterfill_properties(case, min_units) -> None:
    sites, pr, units = case
    p = params(units, max_probe_age_s=H, min_units_per_job=min_units, reserve_s=600)
    plan = make_plan(sites, pr, p, NOW)
    assigned = sum(sp.units for sp in plan.sites.values())
    if _eligible(sites, pr, H):
        # all units assigned when any site is eligible
        assert plan.mode == "queue_aware"
        assert assigned == pytest.approx(units, rel=1e-6)
    else:
        assert plan.mode == "infeasible" and assigned == 0
    for name, sp in plan.sites.items():
        if not sp.submit:
            assert sp.units == 0 and sp.jobs == 0
            continue
        site = sites[name]
        cap = min(site.shape(sp.shape).walltime_s, site.max_walltime_s)
        assert sp.jobs == sum(ln.jobs for ln in sp.lane_plans) > 0
        for ln in sp.lane_plans:
            # no job over walltime, requested or trained; the chain covers the lane exactly
            dur = ln.end_s - ln.start_s
            assert ln.job_walltime_s <= cap + 1e-6 and ln.last_walltime_s <= cap + 1e-6
            assert (ln.jobs - 1) * ln.job_walltime_s < dur <= ln.jobs * ln.job_walltime_s + 1e-6
        if sp.jobs <= 2000:
            jobs = sp.planned_jobs()
            assert len(jobs) == sp.jobs
            assert all(j.end_s - j.start_s <= cap + 1e-6 for j in jobs)
            assert sum(j.units for j in jobs) == pytest.approx(sp.units)
        assert sp.lanes <= site.qos_max_nodes // site.shape(sp.shape).nodes
        assert sp.predicted_finish_s == pytest.approx(plan.predicted_finish_s)
        assert sp.accumulation is not None and sp.accumulation >= 1


def test_running_local_job_without_end_keeps_its_slot() -> None:
    x = SiteConfig("x", ranks=2, micro_batch=2, accumulation=1, tokens_per_s_per_gpu=10.0)
    plan = make_plan({"x": x}, probes(), params(200.0), NOW, fixed=[FixedJob("x", None, NOW)])
    sp = plan.sites["x"]
    assert not sp.submit and sp.reason.startswith("busy")
    assert sp.fixed_units == pytest.approx(200.0)
    assert plan.predicted_finish_s == pytest.approx(10.0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(100, 20000), st.integers(1, 8), st.integers(1, 8)),
        min_size=2,
        max_size=6,
    ),
    st.floats(1e6, 1e12),
)
def test_sites_free_together_split_in_proportion_to_throughput(raw, units) -> None:
    sites, rows = {}, []
    for i, (rate, gpn, qos) in enumerate(raw):
        sh = shape(gpn=gpn)
        sites[f"s{i}"] = slurm_site(f"s{i}", [sh], rate=rate, qos=qos)
        rows.append((f"s{i}", sh, ok(0.0), 0))
    plan = make_plan(sites, probes(*rows), params(units), NOW)
    thr = {n: s.tokens_per_s_per_gpu * s.shapes[0].gpus * s.qos_max_nodes for n, s in sites.items()}
    total = sum(thr.values())
    for n, sp in plan.sites.items():
        assert sp.submit and sp.predicted_start_s == 0
        assert sp.units == pytest.approx(units * thr[n] / total, rel=1e-6)


# ----------------------------------------------------------------------------- probe advice

REFUSED = [
    (ProbeReason.TIME_LIMIT, "shorten_walltime"),
    (ProbeReason.NODE_COUNT, "resize_nodes"),
    (ProbeReason.NODE_CONFIG, "reshape"),
    (ProbeReason.SHAPE, "reshape"),
    (ProbeReason.PARTITION, "fix_access"),
    (ProbeReason.ACCOUNT, "fix_access"),
    (ProbeReason.WAIT, "wait"),
    (ProbeReason.POLICY, "check"),
    (ProbeReason.UNAVAILABLE, "check"),
    (ProbeReason.UNPARSED, "check"),
]


def _two_shapes():
    """A site whose wide shape beats its narrow one whenever the wide one may run."""
    wide, narrow = shape("wide", nodes=4, gpn=4), shape("narrow", nodes=1, gpn=1)
    return slurm_site("a", [wide, narrow], qos=4), wide, narrow


@pytest.mark.parametrize(("reason", "advice"), REFUSED)
def test_a_refused_shape_is_skipped_with_its_advice(reason: ProbeReason, advice: str) -> None:
    a, wide, narrow = _two_shapes()
    pr = probes(
        ("a", wide, ok(0.0), 600),  # an older estimate the refusal overrides
        ("a", wide, ProbeResult(False, reason, "x"), 60),
        ("a", narrow, ok(0.0), 60),
    )
    plan = make_plan({"a": a}, pr, params(1e6), NOW)
    sp = plan.sites["a"]
    assert sp.submit and sp.shape == "narrow"
    assert sp.advice == {"wide": advice}
    assert f"wide: {reason} ({advice})" in sp.reason


@pytest.mark.parametrize("reason", [ProbeReason.TRY_LATER, ProbeReason.TIMEOUT])
def test_try_later_keeps_the_newest_informative_probe(reason: ProbeReason) -> None:
    a, wide, narrow = _two_shapes()
    pr = probes(
        ("a", wide, ok(0.0), 600),
        ("a", wide, ProbeResult(False, reason, "x"), 60),
        ("a", narrow, ok(0.0), 60),
    )
    sp = make_plan({"a": a}, pr, params(1e6), NOW).sites["a"]
    assert sp.submit and sp.shape == "wide" and sp.advice == {}
    assert f"wide: {reason}, read the probe of 600s ago" in sp.reason


def test_try_later_falls_back_to_an_older_refusal_too() -> None:
    a, wide, narrow = _two_shapes()
    pr = probes(
        ("a", wide, ProbeResult(False, ProbeReason.WAIT, "x"), 600),
        ("a", wide, ProbeResult(False, ProbeReason.TRY_LATER, "x"), 60),
        ("a", narrow, ok(0.0), 60),
    )
    sp = make_plan({"a": a}, pr, params(1e6), NOW).sites["a"]
    assert sp.shape == "narrow" and sp.advice == {"wide": "wait"}


def test_try_later_alone_skips_the_site_and_says_so() -> None:
    a = slurm_site("a", [shape()])
    b = slurm_site("b", [shape()])
    pr = probes(
        ("a", a.shapes[0], ProbeResult(False, ProbeReason.TRY_LATER, "x"), 0),
        ("b", b.shapes[0], ok(0.0), 0),
    )
    plan = make_plan({"a": a, "b": b}, pr, params(1e6), NOW)
    assert not plan.sites["a"].submit and plan.sites["a"].reason == "probe_failed: s: try_later"
    assert plan.sites["a"].advice == {"s": "try_later"} and plan.sites["b"].submit


def test_an_older_try_later_does_not_hide_a_newer_estimate() -> None:
    a = slurm_site("a", [shape()])
    pr = probes(
        ("a", a.shapes[0], ProbeResult(False, ProbeReason.TRY_LATER, "x"), 600),
        ("a", a.shapes[0], ok(2 * H), 60),
    )
    sp = make_plan({"a": a}, pr, params(1e6), NOW).sites["a"]
    assert sp.submit and sp.wait_s == 2 * H and sp.advice == {}


def test_infeasible_plan_keeps_the_advice_and_plans_round_trip() -> None:
    a = slurm_site("a", [shape()])
    pr = probes(("a", a.shapes[0], ProbeResult(False, ProbeReason.SHAPE, "x"), 0))
    plan = make_plan({"a": a}, pr, params(1e6), NOW)
    assert plan.mode == "infeasible" and plan.sites["a"].advice == {"s": "reshape"}
    assert Plan.from_dict(json.loads(plan.to_json())).sites["a"].advice == {"s": "reshape"}
