"""DARL through the real coordinator: steals, epochs, RTT and TTL, forged and replayed
commits, a SIGKILLed coordinator, and site processes killed around their checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from bench import soak_check
from crossfed.client.http import Refused
from crossfed.coordinator.runspec import LeasePolicy, RoundPolicy
from crossfed.darl.blockspace import BlockSpace
from crossfed.darl.ledger import COMMITTED_TABLE
from crossfed.data.windows import read_meta
from tests.conftest import REPO, LiveCoordinator, tiny_spec
from tests.unit.test_coordinator_http import delta_file, global_model, wait_round_closed

#: big blocks: the tiny corpus is cut into M of them, whatever its size (the embedded corpus
#: is the Python build's own documentation, so its windows differ from build to build)
M = 14


def block_size_of(data: Path) -> int:
    """The block size that cuts ``data``'s windows into exactly :data:`M` blocks."""
    n_windows = read_meta(data)["n_windows"]
    size = math.ceil(n_windows / M)
    assert math.ceil(n_windows / size) == M, n_windows
    return size


def space_of(data: Path) -> BlockSpace:
    return BlockSpace(read_meta(data)["n_windows"], block_size_of(data), 7)


@pytest.fixture
def darl(coordinator: LiveCoordinator, tiny_data: Path) -> LiveCoordinator:
    """A coordinator serving the tiny corpus in M = 14 blocks."""
    coordinator.client().init_run(
        tiny_spec(tiny_data, block_size=block_size_of(tiny_data)).to_dict()
    )
    return coordinator


@pytest.fixture
def darl_long_leases(coordinator: LiveCoordinator, tiny_data: Path) -> LiveCoordinator:
    """``darl`` with leases that outlive a site process's restart however busy the machine
    (``darl``'s TTL of 2 s does not: a restart's Python start can take longer)."""
    leases = LeasePolicy(min_ttl_s=60.0, initial_ttl_s=60.0, probe_share=1.0)
    spec = tiny_spec(tiny_data, block_size=block_size_of(tiny_data), leases=leases)
    coordinator.client().init_run(spec.to_dict())
    return coordinator


def join(live: LiveCoordinator, site: str, data: Path) -> None:
    live.client(site).register(site, space_of(data).digest(), 1, 1.0)


def early(live: LiveCoordinator, site: str, n: int, round_no: int = 2, t_step: float = 4.0):
    """A lease request's whole reply, not only its lease (e.g. an early lease's forecast)."""
    return live.client(site).lease(site, round_no, n, t_step, 1.0)


def lease(live: LiveCoordinator, site: str, n: int, round_no: int = 1, t_step: float = 4.0):
    return early(live, site, n, round_no, t_step)["lease"]


def commit(live, site, held, path, consumed=None, round_no=1, generation=0, steps=4, **kw) -> dict:
    return live.client(site, **kw).submit_delta(
        round_no,
        path,
        inline=False,
        site=site,
        lease_id=held["lease_id"],
        generation=generation,
        tokens=1000,
        steps=steps,
        consumed=held["n_blocks"] if consumed is None else consumed,
    )


def audit(live: LiveCoordinator) -> list[tuple]:
    with sqlite3.connect(live.state_dir / "state.sqlite") as conn:
        return conn.execute(
            f"SELECT epoch, block, site, lease_id FROM {COMMITTED_TABLE} ORDER BY epoch, block"
        ).fetchall()


def deltas(live: LiveCoordinator) -> list[tuple]:
    with sqlite3.connect(live.state_dir / "state.sqlite") as conn:
        return conn.execute("SELECT lease_id, site, consumed, blob FROM deltas").fetchall()


def ledger(live: LiveCoordinator) -> dict[str, dict]:
    return {row["site"]: row for row in live.client().ledger()}


def active(live: LiveCoordinator) -> dict[int, dict]:
    return {x["lease_id"]: x for x in live.client().status()["active_leases"]}


def state(live: LiveCoordinator) -> tuple:
    """Everything a commit could change."""
    status = live.client().status()
    status.pop("active_leases")
    return audit(live), deltas(live), ledger(live), status, active(live)


# ------------------------------------------------------------------ steal and epochs
def test_steal_reaches_the_victim_and_the_epoch_rolls_over(
    darl: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    space = space_of(tiny_data)
    assert space.n_blocks == 14
    g0 = global_model(darl, 0, tmp_path)
    join(darl, "snellius", tiny_data)
    join(darl, "lumi", tiny_data)
    big = lease(darl, "snellius", 14)
    assert big["blocks"] == space.permutation(0)[:14].tolist()
    darl.client("snellius").heartbeat(big["lease_id"], "snellius", 2, 4.0)
    # the pool is dry: lumi steals the untouched tail of the largest lease (rest 11 -> 6)
    stolen = lease(darl, "lumi", 4)
    assert stolen["blocks"] == big["blocks"][8:]
    # the victim learns it on its next heartbeat and stops before the stolen part
    beat = darl.client("snellius").heartbeat(big["lease_id"], "snellius", 3, 4.0)
    assert beat["lease"]["n_blocks"] == 8 and beat["lease"]["blocks"] == big["blocks"][:8]
    with pytest.raises(Refused) as refused:  # past the new end: refused, nothing committed
        commit(darl, "snellius", big, delta_file(tmp_path, g0, name="a"), consumed=9)
    assert refused.value.status == 422 and audit(darl) == []
    assert commit(darl, "snellius", beat["lease"], delta_file(tmp_path, g0, name="a"))["accepted"]
    assert commit(darl, "lumi", stolen, delta_file(tmp_path, g0, seed=1, name="b"))["accepted"]
    # every block of epoch 0 committed exactly once, by the site that trained it
    rows = audit(darl)
    assert [r[1] for r in rows] == list(range(14))
    owner = {block: site for _, block, site, _ in rows}
    assert {b for b, s in owner.items() if s == "snellius"} == set(big["blocks"][:8])
    assert {b for b, s in owner.items() if s == "lumi"} == set(big["blocks"][8:])
    status = darl.client().status()
    assert status["epoch"] == 1 and status["blocks_committed_in_epoch"] == 0
    assert status["blocks_committed_total"] == 14
    table = ledger(darl)
    assert table["snellius"]["blocks_granted"] == 8 and table["lumi"]["blocks_granted"] == 6
    assert table["total"]["blocks_committed"] == 14 and table["total"]["blocks_lost"] == 0
    # the next epoch walks the permutation derived from (s, epoch 1)
    wait_round_closed(darl, 1)
    join(darl, "frontier", tiny_data)
    nxt = lease(darl, "frontier", 3, round_no=2)
    assert nxt["epoch"] == 1
    assert nxt["blocks"] == space.permutation(1)[:3].tolist()
    assert nxt["blocks"] != space.permutation(0)[:3].tolist()


# ------------------------------------------------------------------ RTT and TTL
def test_coordinator_measures_rtt_itself_and_the_ttl_uses_it(
    darl: LiveCoordinator, tiny_data: Path
) -> None:
    join(darl, "snellius", tiny_data)
    held = lease(darl, "snellius", 2, t_step=0.4)
    site = darl.client("snellius")
    first = site.heartbeat(held["lease_id"], "snellius", 0, 0.4)
    assert first["rtt_ms"] is None and isinstance(first["echo"], int)
    # a site that hides 0.6 s of its own delay: the coordinator still sees the full trip
    time.sleep(0.6)
    lied = site.heartbeat(held["lease_id"], "snellius", 1, 0.4, first["echo"], 0.0)
    assert lied["rtt_ms"] >= 600
    # TTL = alpha * t_step + beta * RTT (2.5 and 2.0), above the 2 s floor here
    assert lied["lease"]["ttl_s"] == pytest.approx(2.5 * 0.4 + 2.0 * lied["rtt_ms"] / 1000)
    received = time.perf_counter()
    time.sleep(0.3)
    honest = site.heartbeat(
        held["lease_id"], "snellius", 1, 0.4, lied["echo"], time.perf_counter() - received
    )
    assert honest["rtt_ms"] < lied["rtt_ms"]  # the honest sample pulls the average down
    stale = site.heartbeat(held["lease_id"], "snellius", 1, 0.4, first["echo"], 0.0)
    assert stale["rtt_ms"] == honest["rtt_ms"]  # a nonce is good for one measurement only


def test_grants_follow_measured_commit_rates(
    darl: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    g0 = global_model(darl, 0, tmp_path)
    join(darl, "snellius", tiny_data)
    join(darl, "lumi", tiny_data)
    fast, slow = lease(darl, "snellius", 2), lease(darl, "lumi", 2)
    assert commit(darl, "snellius", fast, delta_file(tmp_path, g0, name="a"))["accepted"]
    # lumi takes far longer for the same two blocks: 3 s, against snellius's commit right
    # after its grant, which on a loaded machine may itself take a second
    time.sleep(3.0)
    assert commit(darl, "lumi", slow, delta_file(tmp_path, g0, seed=1, name="b"))["accepted"]
    wait_round_closed(darl, 1)
    # same request, different grants: the faster committer gets more, the slower fewer
    big, small = lease(darl, "snellius", 2, round_no=2), lease(darl, "lumi", 2, round_no=2)
    assert big["n_blocks"] > 2 and small["n_blocks"] == 1


def test_the_second_round_is_sized_from_the_first_rounds_step_times(
    darl: LiveCoordinator, tiny_data: Path
) -> None:
    """No commit needed: the heartbeats' mean step times size the early leases of round 2,
    and an early lease also covers what the open round's other leases have left to train
    (its round starts only when they are in), so a site ahead ends with the others."""
    join(darl, "snellius", tiny_data)
    join(darl, "lumi", tiny_data)
    fast, slow = lease(darl, "snellius", 2), lease(darl, "lumi", 2)
    assert fast["n_blocks"] == slow["n_blocks"] == 2
    darl.client("snellius").heartbeat(fast["lease_id"], "snellius", 1, 0.1)
    darl.client("lumi").heartbeat(slow["lease_id"], "lumi", 0, 0.4)
    # paces 1 / (H * t_step): snellius 4x lumi; paced grants 2 * 4 / 2.5 = 3 and
    # 2 * 1 / 2.5 = 1. Rates: snellius 2 / (4 * 0.1) = 5 blocks a second, lumi 1.25. lumi
    # has 2 blocks of round 1 left, 1.6 s: 8 of snellius's blocks, at most half its paced
    # grant more (a forecast): 3 + 1
    assert early(darl, "snellius", 2)["lease"]["n_blocks"] == 4
    # snellius has 1 block left, 0.2 s at most: less than one of lumi's blocks
    assert early(darl, "lumi", 2)["lease"]["n_blocks"] == 1


def test_a_site_of_unknown_pace_leases_a_probe_then_its_paced_share(
    coordinator: LiveCoordinator, tiny_data: Path
) -> None:
    """Round 1 is sized blind: a quarter of the phase each, then the step times pace."""
    spec = tiny_spec(tiny_data, block_size=block_size_of(tiny_data))
    spec = dataclasses.replace(spec, leases=dataclasses.replace(spec.leases, probe_share=0.25))
    coordinator.client().init_run(spec.to_dict())
    join(coordinator, "snellius", tiny_data)
    join(coordinator, "lumi", tiny_data)
    fast, slow = lease(coordinator, "snellius", 4), lease(coordinator, "lumi", 4)
    assert (fast["n_blocks"], slow["n_blocks"]) == (1, 1)  # a quarter of the phase each
    # both probes trained: an early lease has no open-round training to cover beside its own
    coordinator.client("snellius").heartbeat(fast["lease_id"], "snellius", 1, 0.1)
    coordinator.client("lumi").heartbeat(slow["lease_id"], "lumi", 1, 0.3)
    # paced now: 4 * (1/0.1) / mean(1/0.1, 1/0.3) = 6 and 4 * (1/0.3) / that mean = 2
    assert early(coordinator, "snellius", 4)["lease"]["n_blocks"] == 6
    assert early(coordinator, "lumi", 4)["lease"]["n_blocks"] == 2
    # a late joiner's pace is unknown: it is probed, not granted its whole phase
    join(coordinator, "frontier", tiny_data)
    assert lease(coordinator, "frontier", 4)["n_blocks"] == 1


def test_a_run_of_one_site_is_never_probed(coordinator: LiveCoordinator, tiny_data: Path) -> None:
    spec = tiny_spec(tiny_data, block_size=block_size_of(tiny_data), sites={"snellius": 1})
    spec = dataclasses.replace(spec, leases=dataclasses.replace(spec.leases, probe_share=0.25))
    coordinator.client().init_run(spec.to_dict())
    join(coordinator, "snellius", tiny_data)
    assert lease(coordinator, "snellius", 4)["n_blocks"] == 4  # nobody to wait for it


def test_a_round_every_site_delivered_to_closes_without_waiting_out_its_join_window(
    coordinator: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """A join window of ten minutes: two of three sites in keep the round open, the third
    closes it at once (no site of the run is left to join)."""
    spec = tiny_spec(
        tiny_data, block_size=block_size_of(tiny_data), rounds=RoundPolicy(600.0, 3600.0)
    )
    coordinator.client().init_run(spec.to_dict())
    g0 = global_model(coordinator, 0, tmp_path)
    for site in ("snellius", "lumi", "frontier"):
        join(coordinator, site, tiny_data)
    held = {site: lease(coordinator, site, 2) for site in ("snellius", "lumi", "frontier")}
    for i, site in enumerate(("snellius", "lumi")):
        commit(coordinator, site, held[site], delta_file(tmp_path, g0, seed=i, name=site))
    time.sleep(2.0)  # several of the closer's ticks
    assert coordinator.client().round_info(1)["status"] == "open"  # frontier may still send
    commit(coordinator, "frontier", held["frontier"], delta_file(tmp_path, g0, seed=2, name="f"))
    closed = wait_round_closed(coordinator, 1)  # well inside the 600 s window
    assert closed["close_reason"] == "all_in"


# ------------------------------------------------------------------ forged and replayed
def test_forged_and_replayed_commits_are_refused_and_change_nothing(
    darl_long_leases: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    # leases of 60 s: no TTL runs out between the state compared before and after each
    # refusal however busy the machine (with ``darl``'s, one did at four pytest workers)
    darl = darl_long_leases
    g0 = global_model(darl, 0, tmp_path)
    join(darl, "snellius", tiny_data)
    join(darl, "lumi", tiny_data)
    mine, theirs = lease(darl, "lumi", 2), lease(darl, "snellius", 3)
    path = delta_file(tmp_path, g0, name="d")
    before = state(darl)
    forgeries = [
        (lambda: commit(darl, "lumi", theirs, path), 403),  # someone else's lease
        (lambda: commit(darl, "lumi", {**mine, "lease_id": 999}, path), 404),  # no such lease
        (lambda: commit(darl, "lumi", mine, path, consumed=3), 422),  # more than it holds
    ]
    for forge, status in forgeries:
        with pytest.raises(Refused) as refused:
            forge()
        assert refused.value.status == status
        assert state(darl) == before
    # another site's name under one's own token, or no valid token at all
    body = {
        "site": "snellius",
        "lease_id": theirs["lease_id"],
        "generation": 0,
        "tokens": 1000,
        "steps": 4,
        "consumed": 3,
        "blob": "0" * 64,
    }
    for headers, status in (
        ({"Authorization": f"Bearer {darl.secrets['sites']['lumi']}"}, 403),
        ({"Authorization": "Bearer forged"}, 401),
        ({}, 401),
    ):
        answer = httpx.post(f"{darl.url}/v1/rounds/1/deltas", json=body, headers=headers)
        assert answer.status_code == status
        assert state(darl) == before
    # the real commit, then replays of it: the same one is a no-op, a different one refused
    first = commit(darl, "lumi", mine, path)
    assert first["accepted"] and not first["already"]
    after = state(darl)
    assert len(after[0]) == 2 and after != before
    assert commit(darl, "lumi", mine, path)["already"] is True
    assert state(darl) == after
    other = delta_file(tmp_path, g0, seed=5, name="other")
    for replay, status in (
        (lambda: commit(darl, "lumi", mine, other), 409),  # a different delta on a used lease
        (lambda: commit(darl, "snellius", mine, path), 409),  # replayed by another site
        (lambda: commit(darl, "lumi", mine, path, consumed=1), 409),  # altered progress
    ):
        with pytest.raises(Refused) as refused:
            replay()
        assert refused.value.status == status
        assert state(darl) == after
    # a made-up generation is refused and hands the lease back without committing it
    with pytest.raises(Refused) as refused:
        commit(darl, "snellius", theirs, path, generation=1)
    assert refused.value.code == "stale_generation"
    assert audit(darl) == after[0] and deltas(darl) == after[1]
    assert theirs["lease_id"] not in active(darl)
    assert ledger(darl)["snellius"]["blocks_lost"] == 3


# ------------------------------------------------------------------ early leases


def test_an_early_lease_of_the_next_round_trains_beside_the_open_one_and_commits_in_it(
    darl: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    g0 = global_model(darl, 0, tmp_path)
    join(darl, "snellius", tiny_data)
    join(darl, "lumi", tiny_data)
    now_reply = darl.client("snellius").lease("snellius", 1, 4, 4.0, 1.0)
    assert (now_reply["early"], now_reply["global_step"]) == (False, 0)
    mine = now_reply["lease"]
    # lumi's delta of round 1 (3 inner steps, of 4) is in before snellius leases early
    other = lease(darl, "lumi", 2)
    assert commit(darl, "lumi", other, delta_file(tmp_path, g0, seed=2, name="b"), steps=3)
    reply = early(darl, "snellius", 3)
    ahead = reply["lease"]
    assert (reply["early"], reply["generation"], ahead["round"]) == (True, 0, 2)
    assert reply["global_step"] == 3  # round 1's longest phase so far: where round 2 starts
    assert ahead["blocks"] == space_of(tiny_data).permutation(0)[6:9].tolist()
    # never two rounds ahead, never a second lease of one round, never a third
    for round_no, code in ((3, "round_not_open"), (2, "already_holding")):
        with pytest.raises(Refused) as refused:
            early(darl, "snellius", 1, round_no=round_no)
        assert refused.value.status == 409 and refused.value.code == code
    assert set(active(darl)) == {mine["lease_id"], ahead["lease_id"]}  # both listed
    assert {x["lease_id"] for x in darl.client("snellius").status()["active_leases"]} == set(
        active(darl)
    )
    # both leases heartbeat, each its own; one's beat does not spoil the other's RTT echo
    site = darl.client("snellius")
    before = active(darl)
    beat_now = site.heartbeat(mine["lease_id"], "snellius", 1, 4.0)
    beat_ahead = site.heartbeat(ahead["lease_id"], "snellius", 1, 4.0)
    assert beat_now["lease"]["round"] == 1 and beat_ahead["lease"]["round"] == 2
    again = site.heartbeat(mine["lease_id"], "snellius", 1, 4.0, beat_now["echo"], 0.0)
    assert again["rtt_ms"] is not None  # its echo still good after the other lease's beat
    ahead_again = site.heartbeat(ahead["lease_id"], "snellius", 1, 4.0, beat_ahead["echo"], 0.0)
    assert ahead_again["rtt_ms"] is not None
    after = active(darl)
    for lease_id in before:
        assert after[lease_id]["expires_at"] > before[lease_id]["expires_at"]
        assert after[lease_id]["consumed"] == 1
    # its round is not open: the delta is refused and the lease stays live; sent for the
    # open round instead, it is refused as well (the lease is of round 2)
    early_delta = delta_file(tmp_path, g0, seed=3, name="early")
    for round_no, code in ((2, "round_not_open"), (1, "wrong_round")):
        with pytest.raises(Refused) as refused:
            commit(darl, "snellius", ahead, early_delta, round_no=round_no)
        assert refused.value.status == 409 and refused.value.code == code
        assert "round 2" in refused.value.detail
    assert ahead["lease_id"] in active(darl) and len(audit(darl)) == 2
    # round 1 closes once its own leases are in: the early lease of round 2 does not hold it
    done = commit(darl, "snellius", mine, delta_file(tmp_path, g0, seed=1, name="a"), steps=3)
    assert done["accepted"]
    closed = wait_round_closed(darl, 1)
    assert closed["report"]["reason"] == "all_in"
    opened = darl.client().round_info(2)
    assert opened["first_lease_at"] == opened["opened_at"]  # as if leased at the opening
    status = darl.client().status()
    assert (status["round"], status["generation"]) == (2, 1)
    assert status["global_step"] == reply["global_step"]  # the forecast held: no longer phase
    # now current, round 2 takes the early lease's delta (against generation 1) and commits it
    done = commit(darl, "snellius", ahead, early_delta, round_no=2, generation=1)
    assert (done["accepted"], done["round"], done["committed"]) == (True, 2, 3)
    owner = {block: (site, lease_id) for _, block, site, lease_id in audit(darl)}
    assert all(owner[b] == ("snellius", ahead["lease_id"]) for b in ahead["blocks"])
    assert ahead["lease_id"] not in active(darl)


def test_a_steal_leaves_a_fast_victim_what_it_trained_since_its_heartbeat(
    darl: LiveCoordinator, tiny_data: Path
) -> None:
    """A holder hears of a steal only at its next heartbeat and trains on meanwhile: the
    coordinator projects its progress from its step rate and the time since its last
    heartbeat, and the victim keeps what that covers (a slow victim is stolen from as in
    the test above). The projection goes into the ledger's event, so a replay agrees."""
    join(darl, "snellius", tiny_data)
    join(darl, "lumi", tiny_data)
    big = lease(darl, "snellius", 14)
    # H=4 steps of 0.05 s for a phase of 14 blocks: 70 blocks a second
    darl.client("snellius").heartbeat(big["lease_id"], "snellius", 2, 0.05)
    time.sleep(0.3)  # 21 blocks' worth since: more than the 12 it has left
    reply = early(darl, "lumi", 4, round_no=1)
    assert reply["lease"] is None and reply["reason"] == "pool_empty"
    beat = darl.client("snellius").heartbeat(big["lease_id"], "snellius", 3, 0.05)
    assert beat["lease"]["n_blocks"] == 14  # nothing was stolen
    with sqlite3.connect(darl.state_dir / "state.sqlite") as conn:
        (args,) = conn.execute(
            "SELECT args FROM darl_events WHERE op = 'steal' ORDER BY seq DESC LIMIT 1"
        ).fetchone()
    assert json.loads(args)["ahead"] == {str(big["lease_id"]): 12}
    assert ledger(darl)["lumi"]["blocks_granted"] == 0


def test_an_early_lease_at_an_epochs_end_leases_ahead_and_never_steals(
    darl: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """With the epoch's pool dry, an early lease takes the next epoch's first blocks instead
    of idling its site until the epoch ends (or stealing); a lease of the open round still
    steals from the current epoch only. A block of the current epoch that goes back to the
    pool is granted before any more of the next; the next epoch's lease commits in its own
    epoch, its blocks counted once, and becomes current's when the epoch rolls over."""
    space = space_of(tiny_data)
    g0 = global_model(darl, 0, tmp_path)
    join(darl, "snellius", tiny_data)
    join(darl, "lumi", tiny_data)
    join(darl, "frontier", tiny_data)
    big = lease(darl, "snellius", 14)  # the whole pool of epoch 0
    reply = early(darl, "lumi", 4)
    ahead = reply["lease"]
    assert reply["early"] is True and (ahead["epoch"], ahead["round"]) == (1, 2)
    assert ahead["blocks"] == space.permutation(1)[:4].tolist()
    assert active(darl)[big["lease_id"]]["n_blocks"] == 14  # untouched: nothing stolen
    # a lease of the open round, with the epoch's pool as dry, steals from epoch 0
    stolen = lease(darl, "frontier", 4)
    assert stolen["epoch"] == 0 and stolen["blocks"] == big["blocks"][7:]
    assert active(darl)[big["lease_id"]]["n_blocks"] == 7
    assert active(darl)[ahead["lease_id"]]["n_blocks"] == 4  # a steal never takes ahead
    # snellius commits 5 of its 7: the other 2 go back to epoch 0's pool and come first
    done = commit(darl, "snellius", {**big, "n_blocks": 7}, delta_file(tmp_path, g0, name="a"),
                  consumed=5)  # fmt: skip
    assert done["accepted"] and darl.client().status()["epoch"] == 0
    again = early(darl, "snellius", 4)["lease"]
    assert (again["epoch"], again["blocks"]) == (0, big["blocks"][5:7])
    assert commit(darl, "frontier", stolen, delta_file(tmp_path, g0, seed=1, name="b"))
    wait_round_closed(darl, 1)
    # epoch 0 ends when its last block is committed, in round 2: epoch 1 becomes current
    # with lumi's lease of it as it is, and the pool goes on after it
    assert commit(darl, "snellius", again, delta_file(tmp_path, g0, seed=2, name="c"),
                  round_no=2, generation=1)  # fmt: skip
    status = darl.client().status()
    assert status["epoch"] == 1 and status["blocks_committed_total"] == 14
    assert active(darl)[ahead["lease_id"]]["epoch"] == 1
    nxt = lease(darl, "frontier", 3, round_no=2)  # sized by its pace: 3 or more
    end = 4 + nxt["n_blocks"]
    assert (nxt["epoch"], nxt["blocks"]) == (1, space.permutation(1)[4:end].tolist())
    assert commit(darl, "lumi", ahead, delta_file(tmp_path, g0, seed=3, name="d"),
                  round_no=2, generation=1)  # fmt: skip
    rows = audit(darl)
    assert sorted(b for e, b, _, _ in rows if e == 0) == list(range(14))  # each once
    assert sorted(b for e, b, _, _ in rows if e == 1) == sorted(ahead["blocks"])
    assert darl.client().status()["blocks_committed_in_epoch"] == 4
    table = ledger(darl)
    assert table["total"]["blocks_committed"] == 18 and table["total"]["blocks_lost"] == 2


def test_an_early_lease_whose_ttl_lapses_returns_only_its_blocks(
    darl: LiveCoordinator, tiny_data: Path
) -> None:
    join(darl, "snellius", tiny_data)
    join(darl, "lumi", tiny_data)
    mine = lease(darl, "snellius", 2, t_step=4.0)  # TTL 10 s, kept alive below
    ahead = early(darl, "snellius", 3, t_step=0.4)["lease"]  # TTL 2 s, never heartbeaten
    assert ahead["ttl_s"] == pytest.approx(2.0)
    site = darl.client("snellius")
    deadline = time.monotonic() + 30
    while ledger(darl)["snellius"]["ttl_expiries"] == 0:
        assert time.monotonic() < deadline, "the early lease never expired"
        site.heartbeat(mine["lease_id"], "snellius", 1, 4.0)
        time.sleep(0.3)
    assert list(active(darl)) == [mine["lease_id"]]
    row = ledger(darl)["snellius"]
    assert (row["blocks_granted"], row["blocks_lost"], row["ttl_expiries"]) == (5, 3, 1)
    # its blocks are back in the pool: the next grant of round 1 gets exactly them
    regained = lease(darl, "lumi", 3)
    assert regained["blocks"] == ahead["blocks"]


def test_a_grant_takes_the_epochs_last_blocks_rather_than_leave_a_crumb(
    darl: LiveCoordinator, tiny_data: Path
) -> None:
    """A grant of 11 of the 14 blocks would leave 3 behind, more than a quarter of 11: a
    lease of their own. One of 12 would leave 2: it takes all 14, so no site trains a
    lease of a few steps at the epoch's end and then waits out the merge."""
    join(darl, "snellius", tiny_data)
    join(darl, "lumi", tiny_data)
    first = lease(darl, "snellius", 11)
    assert first["n_blocks"] == 11
    darl.client("snellius").release(first["lease_id"], "snellius")
    whole = lease(darl, "lumi", 12)
    assert whole["n_blocks"] == 14
    assert whole["blocks"] == space_of(tiny_data).permutation(0).tolist()


def test_a_lease_heard_from_after_its_ttl_lives_again_while_its_blocks_are_pooled(
    darl: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """Sites whose requests were held up past their leases' TTL (a proxy holding them) are
    heard from again: a heartbeat, or a commit, finds the lease's blocks still pooled (no
    grant took them since), so the lease lives again at the progress it reports and its
    delta commits its blocks, each once; lumi's lives again beside the early lease of the
    next round it took as its delta went. The per-site ledger counts the blocks granted
    again; the independent checker's replay of the event log agrees."""
    g0 = global_model(darl, 0, tmp_path)
    for site in ("snellius", "lumi", "frontier"):
        join(darl, site, tiny_data)
    cut = lease(darl, "snellius", 3, t_step=0.4)  # TTL 2 s, its heartbeats held up
    held_up = lease(darl, "lumi", 3, t_step=0.4)  # TTL 2 s, its commit held up
    kept = lease(darl, "frontier", 2, t_step=4.0)  # TTL 10 s, beating
    ahead = early(darl, "lumi", 2, t_step=4.0)["lease"]  # lumi's next, beating
    deadline = time.monotonic() + 30
    while sum(row["ttl_expiries"] for row in ledger(darl).values() if row["site"] != "total") < 2:
        assert time.monotonic() < deadline, "the leases never expired"
        darl.client("frontier").heartbeat(kept["lease_id"], "frontier", 1, 4.0)
        darl.client("lumi").heartbeat(ahead["lease_id"], "lumi", 1, 4.0)
        time.sleep(0.3)
    assert sorted(active(darl)) == sorted([kept["lease_id"], ahead["lease_id"]])
    reply = darl.client("snellius").heartbeat(cut["lease_id"], "snellius", 2, 0.4)
    assert (reply["lease"]["lease_id"], reply["lease"]["consumed"]) == (cut["lease_id"], 2)
    assert active(darl)[cut["lease_id"]]["blocks"] == cut["blocks"]
    row = ledger(darl)["snellius"]
    assert (row["blocks_granted"], row["blocks_lost"], row["ttl_expiries"]) == (6, 3, 1)
    assert commit(darl, "snellius", cut, delta_file(tmp_path, g0, name="a"))["accepted"]
    assert commit(darl, "lumi", held_up, delta_file(tmp_path, g0, seed=1, name="b"))["accepted"]
    assert commit(darl, "frontier", kept, delta_file(tmp_path, g0, seed=2, name="c"))["accepted"]
    space = space_of(tiny_data)
    committed = [b for _, b, _, _ in audit(darl)]
    want = space.permutation(0)[:8].tolist()
    assert sorted(committed) == sorted(want) and len(committed) == 8  # each block once
    assert list(active(darl)) == [ahead["lease_id"]]  # lumi's early lease, untouched
    for site, blocks in (("snellius", 3), ("lumi", 3), ("frontier", 2)):
        row = ledger(darl)[site]
        assert row["blocks_committed"] == blocks
        held = ahead["n_blocks"] if site == "lumi" else 0
        assert row["blocks_granted"] == row["blocks_committed"] + row["blocks_lost"] + held
    # the checker counts a delta's tokens once its round is merged, and the round closes
    # after the last commit's reply, in the coordinator's own time
    wait_round_closed(darl, 1)
    result = soak_check.check(darl.state_dir, rebuild=False)
    assert (result["ok"], result["problems"], result["granted_mismatch"]) == (True, [], 0)
    n = ahead["n_blocks"]
    assert result["sites"]["lumi"] == {
        "granted": 6 + n, "committed": 3, "reclaimed": 3, "held": n, "tokens": 1000,
    }  # fmt: skip


def test_a_lease_whose_blocks_were_granted_after_its_ttl_stays_expired(
    darl: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """Once another site was granted blocks of an expired lease, its holder's late
    heartbeat and late commit are refused (``expired``) and change nothing."""
    g0 = global_model(darl, 0, tmp_path)
    join(darl, "snellius", tiny_data)
    join(darl, "lumi", tiny_data)
    cut = lease(darl, "snellius", 3, t_step=0.4)  # TTL 2 s
    deadline = time.monotonic() + 30
    while ledger(darl)["snellius"]["ttl_expiries"] == 0:
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.2)
    taken = lease(darl, "lumi", 2)  # the lowest pooled run: two of the expired lease's blocks
    assert taken["blocks"] == cut["blocks"][:2]
    before = state(darl)
    with pytest.raises(Refused) as late_beat:
        darl.client("snellius").heartbeat(cut["lease_id"], "snellius", 2, 0.4)
    with pytest.raises(Refused) as late_commit:
        commit(darl, "snellius", cut, delta_file(tmp_path, g0, name="a"))
    assert (late_beat.value.code, late_commit.value.code) == ("expired", "expired")
    assert state(darl) == before


# ------------------------------------------------------------------ a SIGKILLed coordinator
def test_sigkilled_coordinator_loses_nothing_and_renews_active_leases(
    darl: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    g0 = global_model(darl, 0, tmp_path)
    join(darl, "snellius", tiny_data)
    join(darl, "lumi", tiny_data)
    # TTL 4 s (2.5 x 1.6 s steps): shorter than the coordinator's downtime below, and long
    # enough that the renewed lease outlives a busy machine's slow restart and reply
    running = lease(darl, "snellius", 4, t_step=1.6)
    done = lease(darl, "lumi", 3)
    darl.client("snellius").heartbeat(running["lease_id"], "snellius", 2, 1.6)
    assert commit(darl, "lumi", done, delta_file(tmp_path, g0, name="a"))["accepted"]
    before = state(darl)
    darl.kill()
    with sqlite3.connect(darl.state_dir / "state.sqlite") as db:  # the restart restores it
        (checkpoint,) = db.execute("SELECT seq FROM darl_checkpoints").fetchone()
        (last,) = db.execute("SELECT MAX(seq) FROM darl_events").fetchone()
    assert 0 < checkpoint <= last, (checkpoint, last)
    time.sleep(5.0)  # longer than the running lease's TTL
    started = time.time()
    darl.restart()
    after = state(darl)
    assert after[:3] == before[:3]  # audit, deltas and Table 3: nothing lost or doubled
    renewed = after[4][running["lease_id"]]
    assert renewed["consumed"] == 2  # the unsynced heartbeat survived the SIGKILL
    assert renewed["expires_at"] >= started + renewed["ttl_s"]  # the restart grace
    time.sleep(0.5)  # a tick or two: the renewed lease is not expired
    beat = darl.client("snellius").heartbeat(running["lease_id"], "snellius", 4, 1.6)
    assert beat["lease"]["status"] == "active"
    last = delta_file(tmp_path, g0, seed=1, name="b")
    assert commit(darl, "snellius", running, last)["accepted"]
    assert len(audit(darl)) == 7
    assert ledger(darl)["total"]["ttl_expiries"] == 0


# ------------------------------------------------------------------ killed site processes
def run_site(live: LiveCoordinator, site: str, data: Path, work: Path, delta: Path, *extra):
    work.mkdir(parents=True, exist_ok=True)
    token = work / f"{site}.token"
    token.write_text(live.secrets["sites"][site])
    cmd = [
        sys.executable,
        str(REPO / "tests" / "helpers" / "darl_chaos_site.py"),
        "--url",
        live.url,
        "--token-file",
        str(token),
        "--site",
        site,
        "--work",
        str(work / site),
        "--digest",
        space_of(data).digest(),
        "--delta",
        str(delta),
        "--want",
        "3",
        "--per-block",
        "0.05",
        "--once",
        *extra,
    ]
    return subprocess.run(cmd, cwd=REPO, timeout=120, capture_output=True, text=True)


def journal(work: Path, site: str) -> list[dict]:
    path = work / site / "journal.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_site_killed_after_its_checkpoint_commits_exactly_once_after_restart(
    darl_long_leases: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    darl = darl_long_leases  # the restart resends within its lease's life
    g0 = global_model(darl, 0, tmp_path)
    delta = tmp_path / "delta.safetensors"
    save_file({k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in g0.items()}, str(delta))
    work = tmp_path / "sites"
    killed = run_site(darl, "snellius", tiny_data, work, delta, "--die", "after_checkpoint")
    assert killed.returncode == -9, killed.stderr
    pending = work / "snellius" / "pending.json"
    record = json.loads(pending.read_text())
    assert audit(darl) == [] and deltas(darl) == []  # checkpointed, not committed
    keep = tmp_path / "keep"
    keep.mkdir()
    shutil.copy(pending, keep / "pending.json")
    shutil.copy(record["delta"], keep / "delta")
    again = run_site(darl, "snellius", tiny_data, work, delta)
    assert again.returncode == 0, again.stderr
    rows = audit(darl)
    assert [(r[1], r[3]) for r in rows] == sorted((b, record["lease_id"]) for b in record["blocks"])
    events = [e["ev"] for e in journal(work, "snellius")]
    assert events[-3:] == ["start", "resend", "commit"]
    # the same checkpoint resent once more (a crash right after the commit): a no-op
    shutil.copy(keep / "pending.json", pending)
    shutil.copy(keep / "delta", record["delta"])
    table = ledger(darl)
    assert run_site(darl, "snellius", tiny_data, work, delta).returncode == 0
    assert journal(work, "snellius")[-1]["already"] is True
    assert audit(darl) == rows and len(deltas(darl)) == 1 and ledger(darl) == table


def test_site_killed_before_its_checkpoint_loses_only_its_lease(
    darl: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    g0 = global_model(darl, 0, tmp_path)
    delta = tmp_path / "delta.safetensors"
    save_file({k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in g0.items()}, str(delta))
    work = tmp_path / "sites"
    killed = run_site(darl, "lumi", tiny_data, work, delta, "--die", "before_checkpoint")
    assert killed.returncode == -9, killed.stderr
    assert not (work / "lumi" / "pending.json").exists()
    lost = next(e for e in journal(work, "lumi") if e["ev"] == "lease")
    deadline = time.monotonic() + 30
    while ledger(darl)["lumi"]["ttl_expiries"] == 0:  # the 2 s TTL runs out
        assert time.monotonic() < deadline, "the dead site's lease never expired"
        time.sleep(0.2)
    row = ledger(darl)["lumi"]
    assert row["blocks_lost"] == row["blocks_granted"] == len(lost["blocks"])
    assert row["blocks_committed"] == 0 and audit(darl) == []
    # the blocks are back in the pool: the next site gets exactly them and commits them once
    assert run_site(darl, "frontier", tiny_data, work, delta).returncode == 0
    got = next(e for e in journal(work, "frontier") if e["ev"] == "lease")
    assert got["blocks"] == lost["blocks"]
    assert sorted(r[1] for r in audit(darl)) == sorted(lost["blocks"])


# ------------------------------------------------------------------ a restarted job's lease
def test_a_restarted_job_takes_over_the_live_lease_its_predecessor_held(
    darl: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """The job that held lumi's lease died after training two blocks of it; a new job of
    lumi is refused a second lease of the round but takes the live one over at the
    progress its site's status shows, trains it from the start and commits it: nothing
    lost, no TTL waited. A replay of the adoption, another site, a made-up lease and an
    early lease of the next round are answered as such."""
    join(darl, "lumi", tiny_data)
    join(darl, "snellius", tiny_data)
    held = lease(darl, "lumi", 4)
    # snellius's lease of round 1, renewed below, keeps the round open after lumi's commit
    # however long the steps take (its registration alone would for join_window_s only)
    other = lease(darl, "snellius", 4)
    darl.client("lumi").heartbeat(held["lease_id"], "lumi", 2, 4.0)  # then the job dies
    with pytest.raises(Refused) as refused:  # the restarted job asks for the round again
        lease(darl, "lumi", 4)
    assert refused.value.code == "already_holding"
    (seen,) = [x for x in darl.client("lumi").status()["active_leases"] if x["site"] == "lumi"]
    assert seen["consumed"] == 2
    reply = darl.client("lumi").adopt(held["lease_id"], "lumi", seen["consumed"])
    taken = reply["lease"]
    assert (taken["lease_id"], taken["blocks"], taken["consumed"]) == (
        held["lease_id"], held["blocks"], 0,
    )  # fmt: skip
    assert reply["early"] is False and reply["generation"] == 0
    after = state(darl)
    for who, lease_id, consumed, code in [
        ("lumi", held["lease_id"], 2, "bad_progress"),  # the same adoption, replayed late
        ("snellius", held["lease_id"], 0, "not_owner"),
        ("lumi", 999, 0, "unknown_lease"),
    ]:
        with pytest.raises(Refused) as refused:
            darl.client(who).adopt(lease_id, who, consumed)
        assert refused.value.code == code
        assert state(darl) == after
    darl.client("lumi").heartbeat(held["lease_id"], "lumi", 1, 4.0)  # progress from 0 again
    g0 = global_model(darl, 0, tmp_path)
    commit(darl, "lumi", taken, delta_file(tmp_path, g0, seed=1))
    row = ledger(darl)["lumi"]
    assert (row["grants"], row["blocks_committed"], row["blocks_lost"], row["ttl_expiries"]) == (
        1, held["n_blocks"], 0, 0,
    )  # fmt: skip
    assert len(audit(darl)) == held["n_blocks"]
    # an early lease of round 2 (round 1 still open: snellius holds a lease of it) is
    # taken over as an early lease, with the forecast of its round's first global step
    darl.client("snellius").heartbeat(other["lease_id"], "snellius", 0, 4.0)
    assert darl.client().status()["round"] == 1
    ahead = early(darl, "lumi", 2)
    reply = darl.client("lumi").adopt(ahead["lease"]["lease_id"], "lumi", 0)
    assert reply["early"] is True and reply["global_step"] == ahead["global_step"]
