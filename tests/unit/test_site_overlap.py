"""Overlapped rounds against a real coordinator: a site sends its delta and trains its next
lease at once, waits for the merge only at the end of that phase (at most one round ahead),
folds the merged model in and measures its next delta against it; every block is still
committed exactly once."""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from crossfed import moments
from crossfed.config import RunConfig, load_run_config, load_sites
from crossfed.coordinator.runspec import LeasePolicy
from crossfed.report import goodput
from crossfed.site import SiteRunner
from crossfed.site.control import EarlyAsk
from crossfed.site.job import site_settings
from crossfed.site.loop import ChainSettings, run_chain
from crossfed.train import overlap
from tests.conftest import REPO, SITES, LiveCoordinator, tiny_spec, write_yaml
from tests.unit.test_coordinator_http import delta_file, global_model

ROUNDS = 3


def overlap_config(
    tmp_path: Path, live: LiveCoordinator, data: Path, overlap: dict | None = None, **inner
) -> RunConfig:
    sites = yaml.safe_load((REPO / "config" / "sites.yaml").read_text())
    for site in sites["sites"].values():
        site.update(ranks=1, micro_batch=4, accumulation=1, slowdown=1.0)
    write_yaml(tmp_path / "sites.yaml", sites)
    config = {
        "results": str(tmp_path / "results"),
        "sites_file": str(tmp_path / "sites.yaml"),
        "data": {"dir": str(data), "block_size": 8, "seed": 7},
        "darl": {"heartbeat_s": 0.3, "initial_ttl_s": 60},
        "round_policy": {"join_window_s": 0.5},
        "overlap": {"enabled": True, **(overlap or {})},
        "coordinator": {"url": live.url, "secrets": str(live.state_dir / "secrets.yaml")},
        **({"inner": inner} if inner else {}),
    }
    return load_run_config(write_yaml(tmp_path / "config.yaml", config))


def lease_of(live: LiveCoordinator, site: str, round_no: int) -> bool:
    """Whether ``site`` holds an active lease of ``round_no`` at the coordinator."""
    leases = live.client().status()["active_leases"]
    return any(x["site"] == site and x["round"] == round_no for x in leases)


def grants(live: LiveCoordinator, site: str, round_no: int) -> list[dict]:
    """The ledger's grant events of ``site`` for ``round_no``, in order."""
    with closing(sqlite3.connect(live.state_dir / "state.sqlite")) as conn:
        rows = conn.execute("SELECT args FROM darl_events WHERE op = 'grant' ORDER BY seq")
        events = [json.loads(args) for (args,) in rows]
    return [e for e in events if e["site"] == site and e["round_no"] == round_no]


class HeldBack(SiteRunner):
    """A real site runner whose phase of round k starts only once ``gates[k]`` is set; it
    holds (and heartbeats) the round's lease meanwhile, which keeps the round open."""

    gates: dict[int, threading.Event]

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        #: per round: the window its row counts start at, the windows trained, their sum
        self.counted: dict[int, tuple[int, int, int]] = {}
        #: per round: set once the phase's steps are done (before any wait for the merge)
        self.trained = {r: threading.Event() for r in range(1, ROUNDS + 1)}
        #: per round: the model tensors of the delta the site sent (side tensors left out)
        self.sent_deltas: dict[int, dict[str, torch.Tensor]] = {}

    def _train(self, round_no, fold, state, beat):  # type: ignore[no-untyped-def]
        gate = self.gates.get(round_no)
        if gate is not None:  # longer than any scenario's own waits, which name what is
            # late; this one only ends a thread the scenario forgot
            assert gate.wait(900), f"{self.s.site} was never let train round {round_no}"
        state = super()._train(round_no, fold, state, beat)
        self.trained[round_no].set()
        return state

    def _checkpoint(self, round_no, start, state, outcome):  # type: ignore[no-untyped-def]
        pending = super()._checkpoint(round_no, start, state, outcome)
        if pending is not None:  # rank 0: the delta file before it is sent
            tensors = load_file(pending.delta)
            self.sent_deltas[round_no] = {
                k: v for k, v in tensors.items() if not moments.is_side_key(k)
            }
        return pending

    def _row_counts(self, start, state):  # type: ignore[no-untyped-def]
        counts = super()._row_counts(start, state)
        total = int(sum(int(c.sum()) for c in counts.values()))
        self.counted[start.lease["round"]] = (state.counted_from, state.windows, total)
        return counts


Outcomes = dict[str, dict[int, object]]


def start_pair(
    live: LiveCoordinator,
    data: Path,
    tmp_path: Path,
    held: dict[str, dict[int, threading.Event]],
    runners: dict[str, SiteRunner] | None = None,
    accumulation_for: Callable[[str, int], int | None] = lambda site, round_no: None,
    overlap: dict | None = None,
) -> tuple[Outcomes, dict[str, object], list[BaseException], list[threading.Thread]]:
    """A run of two sites, snellius and frontier, each a real runner in a chain of its own
    (a thread), held back by ``held[site]``: their outcomes by round, their chains, the
    errors they met and the threads, started (the runners go into ``runners``; the plans give
    ``site`` the accumulation ``accumulation_for(site, round)`` where that is not None;
    ``overlap``: the config's overlap settings beside ``enabled``)."""
    spec = tiny_spec(
        data,
        sites={name: 1 for name in SITES},
        # the phases as asked: these tests pin step counts (the probe has tests of its own)
        leases=LeasePolicy(min_ttl_s=60.0, initial_ttl_s=60.0, probe_share=1.0),
    )
    live.client().init_run(spec.to_dict())
    config = overlap_config(tmp_path, live, data, overlap)
    sites = load_sites(config)
    outcomes: Outcomes = {name: {} for name in held}
    chains: dict[str, object] = {}
    errors: list[BaseException] = []

    def site_loop(name: str) -> None:
        try:
            client = live.client(name)
            runner = HeldBack(site_settings(config, name, sites[name]), client)
            runner.gates = held[name]
            if runners is not None:
                runners[name] = runner
            chains[name] = run_chain(
                name, runner, client, ChainSettings(through_round=ROUNDS),
                on_round=lambda o, s: outcomes[name].__setitem__(o.round, o),
                accumulation_for=lambda r: accumulation_for(name, r),
            )  # fmt: skip
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=site_loop, args=(name,)) for name in held]
    for thread in threads:
        thread.start()
    return outcomes, chains, errors, threads


@pytest.mark.parametrize("new_a", [None, 2], ids=["same_a", "plan_doubles_a"])
def test_a_site_trains_its_next_lease_while_its_delta_is_merged(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path, new_a: int | None
) -> None:
    """``plan_doubles_a``: the plans give snellius twice the accumulation from round 2 on,
    after it asked round 2's early lease at the old size: round 2 trains that lease at the
    A it was asked at (nothing goes back to the pool), and round 3, asked at the plan's A,
    at the new size."""
    frontier_leased = threading.Event()  # frontier holds its lease of round 1
    gate = threading.Event()  # snellius holds an early lease of round 2
    # round 1 waits for frontier by its lease, not by timing: snellius trains round 1 once
    # frontier holds its lease, frontier once snellius is a round ahead
    held = {"snellius": {1: frontier_leased}, "frontier": {1: gate}}
    runners: dict[str, SiteRunner] = {}
    outcomes, chains, errors, threads = start_pair(
        coordinator, tiny_data, tmp_path, held, runners,
        lambda site, r: new_a if site == "snellius" and r >= 2 else None,
        overlap={"stale_burst": 0},  # every phase folds a quarter in at the latest
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not gate.is_set() and time.monotonic() < deadline and not errors:
        if lease_of(coordinator, "frontier", 1):
            frontier_leased.set()
        if lease_of(coordinator, "snellius", 2):
            gate.set()
        time.sleep(0.1)
    frontier_leased.set()
    gate.set()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    # a job that ends leaves no in-flight thread behind (one still inside torch when the
    # interpreter exits aborts the site process)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("in-flight-")]
    client = coordinator.client()
    # both jobs ended once their last delta was in; the coordinator merges it after them
    assert all(chain.stopped == "run_complete" for chain in chains.values())  # type: ignore[attr-defined]
    deadline = time.monotonic() + 120
    while client.status()["round"] <= ROUNDS and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.status()["round"] == ROUNDS + 1
    for name in ("snellius", "frontier"):
        assert sorted(outcomes[name]) == [1, 2, 3]
        assert all(o.status == "accepted" for o in outcomes[name].values()), outcomes[name]
    ahead = outcomes["snellius"][2]
    # round 2 was leased while round 1 waited for frontier: the merge had not arrived when
    # a quarter of its 4 steps, rounded up, were done (overlap.max_stale, with no stale
    # burst to spend), so it waited (idle)
    # there, folded the merged model in after step 1 and trained the other three from it
    assert ahead.merge_wait_s > 0 and ahead.fold_step == 1 and ahead.steps == 4
    # the embedding rows' counts it sent take in the windows of the three steps trained from
    # the merged model, not the stale one before the fold-in; round 1's, every window
    per_window = ahead.tokens // ahead.windows
    counted = runners["snellius"].counted  # type: ignore[attr-defined]
    assert counted[2] == (ahead.windows // 4, ahead.windows, ahead.windows * 3 // 4 * per_window)
    first = outcomes["snellius"][1]
    assert counted[1] == (0, first.windows, first.tokens)  # type: ignore[attr-defined]
    assert ahead.generation == client.round_info(2)["generation"]  # measured against g+1
    # snellius asked its early leases during the last step of the phase before, not after
    # it (rounds 2 and 3; none past the chain's last round, so none went back unused)
    assert runners["snellius"].early_asks_taken == 2
    second, third = grants(coordinator, "snellius", 2), grants(coordinator, "snellius", 3)
    assert len(second) == len(third) == 1  # one lease a round: none given back and asked again
    assert [outcomes["snellius"][r].accumulation for r in (2, 3)] == [1, new_a or 1]
    assert third[0]["requested"] == (new_a or 1) * second[0]["requested"]
    for round_no in range(1, ROUNDS + 1):
        deltas = client.round_info(round_no)["deltas"]
        assert sorted(d["site"] for d in deltas) == ["frontier", "snellius"]
    rows = {row["site"]: row for row in client.ledger()}
    committed = sum(o.blocks_committed for name in outcomes for o in outcomes[name].values())
    # each commit's blocks counted once in the book: none trained twice, none lost
    assert rows["total"]["blocks_committed"] == committed >= 2 * ROUNDS
    assert client.status()["blocks_committed_in_epoch"] == committed
    assert rows["total"]["blocks_lost"] == 0
    jobs = [chain.to_dict() for chain in chains.values()]  # type: ignore[attr-defined]
    run_goodput = goodput(jobs)
    assert run_goodput is not None and 0 < run_goodput < 1


def test_a_phase_folded_at_its_end_sends_the_steps_it_trained_before_the_fold(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """With the whole phase allowed before the fold-in (``max_stale: 1``), snellius trains
    all of round 2 while round 1 waits for frontier, and folds the merged model in at the
    phase's end: ``rebase`` keeps every step, so the delta it sends for round 2, measured
    against generation 1, carries them. (On CPU the weights kept for the fold-in once moved
    with the model, and this delta was all zeros.)"""
    gate = threading.Event()  # frontier trains round 1 once snellius has trained round 2
    held = {"snellius": {}, "frontier": {1: gate}}
    runners: dict[str, SiteRunner] = {}
    outcomes, _chains, errors, threads = start_pair(
        coordinator, tiny_data, tmp_path, held, runners,
        overlap={"max_stale": 1.0, "stale_burst": 0},
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not gate.is_set() and time.monotonic() < deadline and not errors:
        ahead = runners.get("snellius")
        if ahead is not None and ahead.trained[2].is_set():  # type: ignore[attr-defined]
            gate.set()
        time.sleep(0.1)
    gate.set()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    folded = outcomes["snellius"][2]
    assert folded.status == "accepted" and folded.fold_step == folded.steps >= 1, folded
    delta = runners["snellius"].sent_deltas[2]  # type: ignore[attr-defined]
    moved = sum(float(t.float().abs().sum()) for t in delta.values())
    assert moved > 0, "the delta of a phase folded at its end lost the phase's steps"
    # measured against the merged model it folded in, round 2's generation
    assert folded.generation == coordinator.client().round_info(2)["generation"]


def test_a_site_that_waits_for_the_merge_round_after_round_is_told_what_hides_it(
    coordinator: LiveCoordinator,
    tiny_data: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Frontier trains rounds 1 and 2 only once snellius holds its early lease of the next
    round, so snellius waits at the fold-in of rounds 2 and 3 (a long link's round trip of
    the weights, as it looks to a site): its job warns once, naming the settings that hide
    the wait; frontier, which never waits, says nothing. (The waits here are short on a
    tiny model: the threshold in seconds is lifted, the share of the phase is kept.)

    With the workflow's stale budget (``overlap.stale_burst``, the bucket full as the job
    starts) snellius trains all of round 2's phase before it waits, which spends the
    budget: round 3's late merge is waited for a quarter into the phase
    (``overlap.max_stale``), as every phase's is when the merge is late round after round."""
    monkeypatch.setattr(overlap, "LONG_WAIT_S", 0.0)
    gates = {1: threading.Event(), 2: threading.Event()}  # frontier's rounds 1 and 2
    with caplog.at_level(logging.WARNING, logger="crossfed.site"):
        held = {"snellius": {}, "frontier": gates}
        outcomes, _, errors, threads = start_pair(coordinator, tiny_data, tmp_path, held)
        deadline = time.monotonic() + 300
        while not gates[2].is_set() and time.monotonic() < deadline and not errors:
            for round_no, gate in gates.items():  # snellius is a round ahead: let frontier go
                if lease_of(coordinator, "snellius", round_no + 1):
                    gate.set()
            time.sleep(0.1)
        for gate in gates.values():
            gate.set()
        for thread in threads:
            thread.join(timeout=600)
    assert not errors, errors
    waited = {r: o.merge_wait_s for r, o in outcomes["snellius"].items()}  # type: ignore[attr-defined]
    assert waited[2] > 0 and waited[3] > 0, waited
    folded = {r: (o.fold_step, o.steps) for r, o in outcomes["snellius"].items()}  # type: ignore[attr-defined]
    (at_2, steps_2), (at_3, steps_3) = folded[2], folded[3]  # phases sized by the sites' pace
    assert at_2 == steps_2, folded  # round 2: the whole phase before it waited
    assert at_3 == math.ceil(0.25 * steps_3) < steps_3, folded  # round 3: a quarter in
    said = [r.getMessage() for r in caplog.records if "for the merged model" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("[snellius r3]"), said
    assert "overlap.max_stale" in said[0] and "inner.steps" in said[0]


def joined_lumi(coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path) -> SiteRunner:
    """A run with 60 s leases, and lumi's site runner joined to its round 1."""
    spec = tiny_spec(tiny_data, leases=LeasePolicy(min_ttl_s=60.0, initial_ttl_s=60.0))
    coordinator.client().init_run(spec.to_dict())
    config = overlap_config(tmp_path, coordinator, tiny_data)
    sites = load_sites(config)
    runner = SiteRunner(site_settings(config, "lumi", sites["lumi"]), coordinator.client("lumi"))
    assert runner.control is not None
    runner.control.join(1)
    return runner


def test_an_early_lease_asked_but_not_trained_goes_back_to_the_pool_at_once(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    runner = joined_lumi(coordinator, tiny_data, tmp_path)
    assert runner.control is not None
    ask = EarlyAsk(runner.control, 2, 2, 1.0, 1)  # round 2 while round 1 is open: early
    taken = ask.take()
    assert taken is not None and taken[0]["n_blocks"] >= 1
    assert lease_of(coordinator, "lumi", 2)
    time.sleep(1.0)  # its heartbeat runs from the grant on: the lease stays alive
    assert taken[2].lost is None
    ask.drop()  # the phase that would train it never starts (the job ends)
    assert not lease_of(coordinator, "lumi", 2)
    row = {r["site"]: r for r in coordinator.client().ledger()}["lumi"]
    assert row["blocks_lost"] == taken[0]["n_blocks"]  # released, not left to its TTL


def test_an_early_lease_asked_before_the_round_before_it_opened_is_asked_again_once_it_has(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """A site that trained round 2's phase early asks round 3's lease during its last step
    while round 1 is still being merged: refused (``round_not_open``). It waits for round 2
    to open (the merge's seconds) and asks again, rather than idling through all of round
    2 until its merge."""
    runner = joined_lumi(coordinator, tiny_data, tmp_path)
    assert runner.control is not None
    ask = EarlyAsk(runner.control, 3, 2, 1.0, 1)  # round 3 while round 1 is open
    try:
        time.sleep(1.0)
        assert not ask._done.is_set()  # waiting for round 2, not given up
        g0 = global_model(coordinator, 0, tmp_path)
        for site in SITES:  # every site joins before any delivers
            if site != "lumi":
                coordinator.client(site).register(site, runner.space.digest(), 1, 1.0)
        # every site leases before any delivers: round 1 closes once all three are in, never
        # between two of them (a registration holds it open only for the join window)
        held = {
            site: coordinator.client(site).lease(site, 1, 1, 4.0, 1.0)["lease"] for site in SITES
        }
        for i, site in enumerate(SITES):
            coordinator.client(site).submit_delta(
                1, delta_file(tmp_path, g0, seed=i, name=site), inline=False, site=site,
                lease_id=held[site]["lease_id"], generation=0, tokens=200, steps=1,
                consumed=held[site]["n_blocks"],
            )  # fmt: skip
        taken = ask.take()
        assert coordinator.client().status()["round"] == 2
        assert taken is not None and taken[0]["round"] == 3  # asked again once round 2 opened
        assert lease_of(coordinator, "lumi", 3)
    finally:
        ask.drop()
