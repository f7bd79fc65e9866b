"""Site loops: rounds back to back, stopping before the walltime (crossfed.site.loop, .slurm)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from crossfed.config import ConnectivitySection
from crossfed.sched.sacct import parse_sacct, walltime_discount
from crossfed.site.job import proxy_env, short_requests
from crossfed.site.loop import (
    ChainError,
    ChainOutcome,
    ChainRecord,
    ChainSettings,
    chain_continues,
    estimate_round_s,
    fits,
    history_durations,
    next_action,
    planned_accumulation,
    round_prior_s,
    run_chain,
)
from crossfed.site.slurm import (
    Allocation,
    parse_end_time,
    parse_node_address,
    parse_squeue_job,
    planned_job,
    rendezvous_endpoint,
    slurm_allocation,
    srun_per_node,
)
from tests.helpers.fake_coordinator import FakeCoordinator

# ---------------------------------------------------------------------------- Slurm facts


def test_end_time_is_read_as_local_time_and_unset_values_are_none() -> None:
    assert parse_end_time("2026-11-29T16:45:00") == datetime(2026, 11, 29, 16, 45).timestamp()
    for unset in ("N/A", "Unknown", "NONE", "", "UNLIMITED"):
        assert parse_end_time(unset) is None
    with pytest.raises(ChainError, match="not an ISO timestamp"):
        parse_end_time("tomorrow")


def test_squeue_line_gives_end_and_nodelist() -> None:
    end, nodes = parse_squeue_job("2026-11-29T16:45:00|n[1-2]\n")
    assert end == datetime(2026, 11, 29, 16, 45).timestamp() and nodes == "n[1-2]"
    with pytest.raises(ChainError, match="unexpected squeue output"):
        parse_squeue_job("slurm_load_jobs error: Invalid job id specified\n")


def test_allocation_asks_squeue_and_scontrol_for_the_job_in_the_environment() -> None:
    calls: list[list[str]] = []

    def run(cmd):
        calls.append(list(cmd))
        if cmd[0] == "squeue":
            return "2026-11-29T16:45:00|n[1-2]\n"
        return "n1\nn2\n"

    alloc = slurm_allocation({"SLURM_JOB_ID": "42"}, run)
    assert alloc == Allocation("42", ("n1", "n2"), datetime(2026, 11, 29, 16, 45).timestamp())
    assert calls == [
        ["squeue", "-h", "-j", "42", "-o", "%e|%N"],
        ["scontrol", "show", "hostnames", "n[1-2]"],
    ]
    assert slurm_allocation({}, run) is None  # outside Slurm: no walltime


def test_multi_node_launch_is_one_srun_task_per_node_meeting_at_the_head() -> None:
    alloc = Allocation("7", ("n3", "n4"), None)
    assert srun_per_node(alloc) == [
        "srun",
        "--jobid=7",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]
    shown = "NodeName=n3 Arch=x86_64 CoresPerSocket=1\n   NodeAddr=127.0.0.1 NodeHostName=vm\n"
    assert parse_node_address(shown, "n3") == "127.0.0.1"
    assert parse_node_address("NodeName=n3 State=IDLE", "n3") == "n3"
    assert rendezvous_endpoint(parse_node_address(shown, alloc.head)) == "127.0.0.1:29400"


# ---------------------------------------------------------------------------- estimates


def test_estimate_is_the_slowest_recent_round_with_a_safety_factor() -> None:
    assert estimate_round_s([10.0, 30.0, 12.0, 11.0, 9.0], None, recent=3) == 12.0 * 1.25
    assert estimate_round_s([], 20.0) == 25.0
    assert estimate_round_s([], None) is None
    assert round_prior_s(7000 * 60, 7000.0, overhead_s=30) == 90.0
    assert round_prior_s(1000, None) is None


def test_fits_leaves_the_margin_before_the_deadline() -> None:
    assert fits(100.0, 200.0, 80.0, 20.0)
    assert not fits(100.0, 200.0, 80.0, 20.5)
    assert fits(100.0, None, 1e9, 0.0)  # no walltime


# ---------------------------------------------------------------------------- decisions


def decide(current, done=(), deadline=None, durations=(), now=0.0, started=0.0, **kw):
    settings = ChainSettings(through_round=5, deadline=deadline, margin_s=10.0, **kw)
    out = ChainOutcome("lumi", "walltime", started_at=started)
    out.rounds = [ChainRecord(r, "accepted", 1.0) for r in done]
    return next_action(current, set(done), settings, out, list(durations), now), out


def test_next_action_trains_waits_and_stops() -> None:
    assert decide(2)[0] == ("train", 2)
    assert decide(2, done={2})[0] == ("wait", 2)
    action, out = decide(6)
    assert action == ("stop", 6) and out.stopped == "run_complete" and not out.next_job


def test_a_round_that_would_overrun_the_walltime_is_not_started() -> None:
    (action, current), out = decide(3, done={2}, deadline=100.0, durations=[40.0], now=45.0)
    assert (action, current) == ("stop", 3) and out.stopped == "walltime"  # 45+50+10 > 100
    assert out.next_job and "round 3 would not end before the walltime" in out.detail


def test_a_job_too_short_for_any_round_says_so_instead_of_chaining_forever() -> None:
    (action, _), out = decide(3, deadline=100.0, durations=[80.0], now=5.0, started=5.0)
    assert action == "stop" and out.stopped == "too_short" and not out.next_job
    assert "longer walltime" in out.detail


# ---------------------------------------------------------------------------- the loop


@dataclass
class Outcome:
    round: int
    status: str = "accepted"
    detail: str = ""


class FakeRunner:
    """Trains the open round in ``seconds`` of the fake clock; the fake coordinator closes it
    (round r closes once the site has trained it and ``lag`` status polls have passed)."""

    def __init__(self, coordinator: FakeCoordinator, clock: list[float], seconds: float) -> None:
        self.coordinator, self.clock, self.seconds = coordinator, clock, seconds
        self.trained: list[int] = []

    def run_round(self, round_no: int, accumulation: int | None = None) -> Outcome:
        assert round_no == self.coordinator.round, "trained a round that is not open"
        self.clock[0] += self.seconds
        self.trained.append(round_no)
        self.coordinator.pending = round_no
        return Outcome(round_no)


def chain(deadline: float | None, seconds: float = 10.0, through: int = 4, **kw):
    clock = [0.0]
    coordinator = FakeCoordinator()
    runner = FakeRunner(coordinator, clock, seconds)
    seen: list[tuple[int, float]] = []
    settings = ChainSettings(through_round=through, deadline=deadline, margin_s=5.0, **kw)

    def sleep(s: float) -> None:
        clock[0] += s

    out = run_chain(
        "lumi",
        runner,
        coordinator,
        settings,
        on_round=lambda o, s: seen.append((o.round, s)),
        clock=lambda: clock[0],
        sleep=sleep,
    )
    return out, runner, seen


def test_chain_trains_every_round_back_to_back_until_the_run_is_complete() -> None:
    out, runner, seen = chain(deadline=None)
    assert runner.trained == [1, 2, 3, 4]
    assert out.stopped == "run_complete" and out.trained == 4 and not out.next_job
    assert seen == [(1, 10.0), (2, 10.0), (3, 10.0), (4, 10.0)]
    assert (out.first_round, out.next_round) == (1, 5)


def test_chain_stops_before_a_round_it_cannot_finish_and_asks_for_the_next_job() -> None:
    out, runner, _ = chain(deadline=40.0, prior_s=8.0)
    # 10 s rounds, 3 s waits for each to close: round 3 would start at 26 s and, estimated
    # at 12.5 s, end past 40 - 5
    assert runner.trained == [1, 2]
    assert out.stopped == "walltime" and out.next_job and "round 3" in out.detail
    assert out.ended_at <= 40.0 - 5.0


def test_chain_whose_first_round_cannot_fit_is_too_short() -> None:
    out, runner, _ = chain(deadline=20.0, prior_s=30.0)
    assert runner.trained == [] and out.stopped == "too_short" and not out.next_job


def test_history_from_earlier_jobs_sets_the_first_estimate() -> None:
    records = [
        {"site": "lumi", "round": 2, "status": "accepted", "extra": {"round_s": 30.0}},
        {"site": "lumi", "round": 1, "status": "accepted", "extra": {"round_s": 20.0}},
        {"site": "lumi", "round": 3, "status": "missed", "extra": {"round_s": 99.0}},
        {"site": "snellius", "round": 3, "status": "accepted", "extra": {"round_s": 99.0}},
    ]
    assert history_durations(records, "lumi") == (20.0, 30.0)
    out, runner, _ = chain(deadline=40.0, history_s=(30.0,))
    assert runner.trained == [] and out.stopped == "too_short"  # 30 * 1.25 + 5 > 40


def test_decisions_are_shared_with_every_rank() -> None:
    shared: list[tuple[str, int]] = []

    def share(decision):
        shared.append(decision)
        return decision

    clock = [0.0]
    coordinator = FakeCoordinator(lag=1)
    runner = FakeRunner(coordinator, clock, 1.0)
    settings = ChainSettings(through_round=2)
    run_chain("lumi", runner, coordinator, settings, share=share, clock=lambda: clock[0],
              sleep=lambda s: None)  # fmt: skip
    assert [a for a, _ in shared] == ["train", "wait", "train", "wait", "stop"]


def test_a_rank_without_a_client_follows_the_shared_decisions() -> None:
    decisions = iter([("train", 3), ("wait", 3), ("train", 4), ("stop", 5)])
    trained: list[int] = []

    class Follower:
        def run_round(self, round_no: int, accumulation: int | None = None) -> Outcome:
            trained.append(round_no)
            return Outcome(round_no)

    settings = ChainSettings(through_round=4)
    run_chain("lumi", Follower(), None, settings, share=lambda _: next(decisions),
              sleep=lambda s: None)  # fmt: skip
    assert trained == [3, 4]


def test_a_round_takes_the_newest_filled_plan_at_or_before_it(tmp_path: Path) -> None:
    def plan(round_no: int, body: object) -> None:
        path = tmp_path / "rounds" / str(round_no) / "plan.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body if isinstance(body, str) else json.dumps(body))

    assert planned_accumulation(tmp_path, "lumi", 1) is None  # no plan yet: configured A
    plan(1, {"sites": {"lumi": {"accumulation": 2}, "snellius": {"accumulation": 5}}})
    plan(2, {"mode": "closed", "sites": {}})  # a closed round's record plans no site
    plan(4, "{not json")  # being written, or broken: the plan before it
    assert planned_accumulation(tmp_path, "lumi", 1) == 2
    assert planned_accumulation(tmp_path, "lumi", 4) == 2  # round 4's own is unreadable
    plan(3, {"sites": {"lumi": {"accumulation": 3}}})
    assert planned_accumulation(tmp_path, "lumi", 4) == 3
    assert planned_accumulation(tmp_path, "lumi", 2) == 2  # never a later round's plan
    assert planned_accumulation(tmp_path, "frontier", 4) is None


def test_the_loop_hands_each_round_its_planned_accumulation() -> None:
    clock = [0.0]
    coordinator = FakeCoordinator(lag=1)
    seen: list[tuple[int, int | None]] = []

    class Recording(FakeRunner):
        def run_round(self, round_no: int, accumulation: int | None = None) -> Outcome:
            seen.append((round_no, accumulation))
            return super().run_round(round_no, accumulation)

    runner = Recording(coordinator, clock, 1.0)
    run_chain("lumi", runner, coordinator, ChainSettings(through_round=3),
              accumulation_for=lambda r: {1: None, 2: 4}.get(r, 5), clock=lambda: clock[0],
              sleep=lambda s: None)  # fmt: skip
    assert seen == [(1, None), (2, 4), (3, 5)]


# ---------------------------------------------------------------------------- the job's shape


SITE = {
    "max_walltime_h": 1.0,
    "shapes": [
        {"name": "small", "partition": "small-g", "nodes": 1, "gpus_per_node": 1,
         "walltime": "00:30:00"},
        {"name": "big", "partition": "standard-g", "nodes": 2, "gpus_per_node": 8,
         "walltime": "02:00:00"},
    ],
}  # fmt: skip


def test_planned_shape_is_used_with_its_walltime_capped_by_the_site_maximum() -> None:
    plan = {"sites": {"lumi": {"shape": "big", "submit": True, "accumulation": 3}}}
    job = planned_job(plan, "lumi", SITE)
    assert job["partition"] == "standard-g" and job["nodes"] == 2 and job["gpus"] == 16
    assert job["walltime_s"] == 3600.0 and job["runtime_min"] == 60
    assert job["submit"] and job["accumulation"] == 3


def test_unplanned_site_falls_back_to_its_first_shape() -> None:
    job = planned_job({"sites": {}}, "lumi", SITE)
    assert job["shape"] == "small" and job["runtime_min"] == 30 and job["gpus"] == 1
    with pytest.raises(ChainError, match="no job shapes"):
        planned_job(None, "lumi", {"shapes": []})


# ---------------------------------------------------------------------------- connectivity


def test_proxy_sites_send_deltas_as_separate_uploads_through_the_proxy() -> None:
    assert short_requests({"transport": "proxy"}) and not short_requests({"transport": "nat"})
    connectivity = ConnectivitySection(https_proxy="http://proxy:3128", no_proxy="localhost")
    env = proxy_env(connectivity)
    assert env["https_proxy"] == env["HTTPS_PROXY"] == "http://proxy:3128"
    assert env["no_proxy"] == "localhost"
    assert proxy_env(ConnectivitySection(https_proxy=None, no_proxy="")) == {}


# ---------------------------------------------------------------------------- sacct rows


def test_sacct_rows_with_fields_not_yet_filled_in_are_kept_and_skipped_by_gamma() -> None:
    text = (
        "5|00:00:00||PENDING|Unknown|Unknown|\n"
        "6||00:05:00|COMPLETED|2026-11-28T10:00:00|2026-11-28T10:00:30|cpu=1\n"
        + "".join(
            f"{i}|00:01:00|00:10:00|COMPLETED|2026-11-28T10:00:00|2026-11-28T10:01:00|cpu=1\n"
            for i in range(7, 10)
        )
    )
    records = parse_sacct(text)
    assert [r.job_id for r in records] == ["5", "6", "7", "8", "9"]
    assert records[0].timelimit_s is None and records[1].elapsed_s == 0.0
    discount = walltime_discount(records, datetime(2026, 11, 29))
    assert discount.jobs == 3 and discount.gamma == pytest.approx(0.1)


def test_slurm_commands_of_a_chain_run_with_standard_times(monkeypatch) -> None:
    """A user's SLURM_TIME_FORMAT=relative would make squeue's end time unreadable."""
    from crossfed.site.slurm import _run

    monkeypatch.setenv("SLURM_TIME_FORMAT", "relative")
    assert "SLURM_TIME_FORMAT=standard" in _run(["env"]).splitlines()


# ---------------------------------------------------------------------------- overlapped rounds


def test_with_overlap_a_site_whose_part_is_in_trains_the_next_round_but_never_two_ahead() -> None:
    settings = ChainSettings(through_round=5)
    out = ChainOutcome("lumi", "walltime")
    assert next_action(2, {2}, settings, out, [], 0.0, overlap=True) == ("train", 3)
    assert next_action(2, {2, 3}, settings, out, [], 0.0, overlap=True) == ("wait", 2)
    assert next_action(2, {2}, settings, out, [], 0.0) == ("wait", 2)  # overlap off: today's
    assert next_action(5, {5}, settings, out, [], 0.0, overlap=True) == ("wait", 5)  # the last


def test_with_overlap_a_sent_round_is_recorded_once_its_send_is_answered() -> None:
    """The runner returns "sending" and hands the outcome over later (settled or finish);
    each round is recorded once, with its final status and the seconds of its phase."""
    clock = [0.0]
    coordinator = FakeCoordinator(lag=1)
    seen: list[tuple[int, str, float]] = []

    class Overlapped:
        overlapped = True

        def __init__(self) -> None:
            self.trained: list[int] = []
            self.in_flight: Outcome | None = None
            self.ready: list[Outcome] = []

        def run_round(self, round_no: int, accumulation: int | None = None) -> Outcome:
            assert round_no in (coordinator.round, coordinator.round + 1), "two rounds ahead"
            if self.in_flight is not None:  # the previous round's merge has arrived by now
                self.ready.append(self.in_flight)
                coordinator.round = max(coordinator.round, self.in_flight.round + 1)
            clock[0] += 2.0
            self.trained.append(round_no)
            self.in_flight = Outcome(round_no, "accepted")
            return Outcome(round_no, "sending")

        def settled(self) -> list[Outcome]:
            out, self.ready = self.ready, []
            return out

        def finish(self) -> list[Outcome]:
            last, self.in_flight = self.in_flight, None
            return self.settled() + ([last] if last else [])

    runner = Overlapped()
    out = run_chain("lumi", runner, coordinator, ChainSettings(through_round=3),
                    on_round=lambda o, s: seen.append((o.round, o.status, s)),
                    clock=lambda: clock[0], sleep=lambda s: None)  # fmt: skip
    assert runner.trained == [1, 2, 3]
    assert seen == [(1, "accepted", 2.0), (2, "accepted", 2.0), (3, "accepted", 2.0)]
    assert [r.status for r in out.rounds] == ["accepted"] * 3 and out.trained == 3
    # its last delta sent, the job ends without waiting for the last merge; a run extended
    # past it still gets a job
    assert coordinator.round == 3 and out.stopped == "run_complete" and out.next_round == 4
    assert not chain_continues(out.to_dict(), 3) and chain_continues(out.to_dict(), 4)


@pytest.mark.parametrize("granted", [True, False], ids=["early_lease_granted", "none_granted"])
def test_with_an_early_lease_granted_the_next_round_starts_without_asking_the_status(
    granted: bool,
) -> None:
    """A phase change behind a long link spends no status round trip when the runner already
    holds the next round's early lease (the coordinator cannot be past that round); without
    one, the chain asks as before. The rounds trained are the same either way."""
    clock = [0.0]
    asked: list[int] = []

    class Counting(FakeCoordinator):
        def status(self) -> dict:
            answer = super().status()
            asked.append(answer["round"])
            return answer

    coordinator = Counting(lag=1)

    class Overlapped:
        overlapped = True

        def __init__(self) -> None:
            self.trained: list[int] = []
            self.in_flight = False

        def run_round(self, round_no: int, accumulation: int | None = None) -> Outcome:
            assert round_no in (coordinator.round, coordinator.round + 1), "two rounds ahead"
            if self.trained:  # the previous round's merge has arrived by now
                coordinator.round = max(coordinator.round, self.trained[-1] + 1)
            clock[0] += 2.0
            self.trained.append(round_no)
            self.in_flight = True
            return Outcome(round_no, "accepted")

        def leased_ahead(self) -> int | None:
            return self.trained[-1] + 1 if granted else None

        def settled(self) -> list[Outcome]:
            return []

        def finish(self) -> list[Outcome]:
            return []

    runner = Overlapped()
    out = run_chain("lumi", runner, coordinator, ChainSettings(through_round=4),
                    clock=lambda: clock[0], sleep=lambda s: None)  # fmt: skip
    assert runner.trained == [1, 2, 3, 4] and out.trained == 4
    assert asked == ([1] if granted else [1, 1, 2, 3])  # at the start; with none, every change
