"""The coordinator as a real HTTP server: protocol, elasticity, bad input, durability."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from crossfed.client.http import (
    BEAT_TRY_RTTS,
    BEAT_TRY_S,
    HELD_TRY_S,
    CoordinatorClient,
    Refused,
    Unreachable,
    beat_try_s,
)
from crossfed.client.reach import EndpointError
from crossfed.coordinator.embedded import ServeCommand, ensure_secrets, wait_until_serving
from crossfed.darl.ledger import COMMITTED_TABLE, META_TABLE
from crossfed.site.control import Heartbeat
from crossfed.testing.wan_emulator import EmulatorProcess, Link
from tests.conftest import SITES, LiveCoordinator, digest_of, stop
from tests.helpers.lost_reply import CutConnections, StalledFirst


def global_model(live: LiveCoordinator, generation: int, tmp: Path) -> dict[str, torch.Tensor]:
    path = live.client().download_model(generation, tmp / f"g{generation}.safetensors")
    return load_file(str(path))


def delta_file(
    tmp: Path,
    reference: dict[str, torch.Tensor],
    scale: float = 0.01,
    seed: int = 0,
    name: str = "delta",
) -> Path:
    gen = torch.Generator().manual_seed(seed)
    delta = {
        k: (torch.randn(v.shape, generator=gen) * scale).to(torch.bfloat16)
        for k, v in reference.items()
    }
    path = tmp / f"{name}.safetensors"
    save_file(delta, str(path))
    return path


def join_and_lease(
    live: LiveCoordinator,
    site: str,
    data: Path,
    round_no: int = 1,
    n_blocks: int = 2,
    t_step_s: float | None = None,
) -> dict:
    """Register and lease; without a step time the lease gets the long initial TTL."""
    client = live.client(site)
    client.register(site, digest_of(data), 1, 1.0)
    reply = client.lease(site, round_no, n_blocks, t_step_s, 1.0)
    assert reply["lease"] is not None
    return reply["lease"]


def lease_expiry(live: LiveCoordinator, lease_id: int) -> float:
    """When the coordinator's status says the active lease ``lease_id`` expires."""
    leases = live.client().status()["active_leases"]
    return float(next(x["expires_at"] for x in leases if x["lease_id"] == lease_id))


def submit(
    live: LiveCoordinator,
    site: str,
    lease: dict,
    path: Path,
    *,
    generation: int = 0,
    round_no: int = 1,
    inline: bool = False,
    tokens: int = 256,  # within what 2 blocks of 8 windows x 32 tokens hold
) -> dict:
    return live.client(site).submit_delta(
        round_no,
        path,
        inline=inline,
        site=site,
        lease_id=lease["lease_id"],
        generation=generation,
        tokens=tokens,
        steps=4,
        consumed=lease["n_blocks"],
        loss=3.0,
    )


def wait_round_closed(live: LiveCoordinator, round_no: int, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = live.client().round_info(round_no)
        if info["status"] == "closed":
            return info
        time.sleep(0.1)
    raise AssertionError(f"round {round_no} did not close")


def committed_rows(live: LiveCoordinator) -> list[tuple]:
    with sqlite3.connect(live.state_dir / "state.sqlite") as conn:
        return conn.execute(f"SELECT * FROM {COMMITTED_TABLE} ORDER BY epoch, block").fetchall()


def test_health_needs_no_token_but_everything_else_does(run: LiveCoordinator) -> None:
    assert httpx.get(f"{run.url}/v1/health").json()["ok"] is True
    response = httpx.get(f"{run.url}/v1/status")
    assert response.status_code == 401
    response = httpx.get(f"{run.url}/v1/status", headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401 and response.json()["error"] == "unauthenticated"


def test_waiting_for_a_coordinator_does_not_take_another_one_on_its_port(
    coordinator: LiveCoordinator, tmp_path: Path
) -> None:
    """A second coordinator launched on a port the first one serves (two tests that drew the
    same free port): waiting for it fails once it cannot bind, though the port answers."""
    state = tmp_path / "second"
    state.mkdir()
    ensure_secrets(state / "secrets.yaml", SITES)
    second = ServeCommand(state, state / "secrets.yaml", "127.0.0.1", coordinator.port).launch()
    try:
        with pytest.raises(EndpointError, match="exited"):
            wait_until_serving(second, state, "127.0.0.1", coordinator.port, 240)
    finally:
        stop(second)
    health = httpx.get(f"{coordinator.url}/v1/health").json()
    assert health["pid"] == coordinator.process.pid != second.pid


def test_round_with_two_sites_merges_token_weighted(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    g0 = global_model(run, 0, tmp_path)
    a, b = join_and_lease(run, "snellius", tiny_data), join_and_lease(run, "lumi", tiny_data)
    da, db = delta_file(tmp_path, g0, seed=1, name="a"), delta_file(tmp_path, g0, seed=2, name="b")
    assert submit(run, "snellius", a, da, tokens=240)["accepted"]
    assert submit(run, "lumi", b, db, tokens=80, inline=True)["accepted"]
    info = wait_round_closed(run, 1)
    report = info["report"]
    assert sorted(report["contributors"]) == ["lumi", "snellius"]
    assert report["shares"] == pytest.approx([0.75, 0.25])
    assert report["reason"] == "all_in" and report["generation"] == 1
    g1 = global_model(run, 1, tmp_path)
    # first outer step from zero momentum: w1 = w0 + eta * (1 + beta) * mean delta
    name = "norm.weight"
    mean = 0.75 * load_file(str(da))[name].float() + 0.25 * load_file(str(db))[name].float()
    expected = g0[name].float() + 0.7 * 1.9 * mean
    assert torch.allclose(g1[name].float(), expected, atol=1e-2)
    assert run.client().status()["global_step"] == 4
    assert len(committed_rows(run)) == a["n_blocks"] + b["n_blocks"]


def test_straggler_lease_expires_and_round_closes_without_it(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    g0 = global_model(run, 0, tmp_path)
    fast = join_and_lease(run, "snellius", tiny_data)
    # never heartbeats again: a crash; a short step time gives it the minimum TTL
    dead = join_and_lease(run, "frontier", tiny_data, t_step_s=0.01)
    submit(run, "snellius", fast, delta_file(tmp_path, g0))
    info = wait_round_closed(run, 1, timeout_s=30)
    assert info["report"]["contributors"] == ["snellius"]
    assert info["report"]["eta"] == 1.0  # a solo round takes the full step
    ledger = {row["site"]: row for row in run.client().ledger()}
    assert ledger["frontier"]["ttl_expiries"] == 1
    assert ledger["frontier"]["blocks_lost"] == dead["n_blocks"]
    assert ledger["total"]["blocks_committed"] == ledger["snellius"]["blocks_committed"]
    # the dead site rejoins later as a joiner and may lease again in round 2
    again = join_and_lease(run, "frontier", tiny_data, round_no=2)
    assert again["round"] == 2


def test_stale_generation_is_rejected_and_blocks_return(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    g0 = global_model(run, 0, tmp_path)
    lease = join_and_lease(run, "lumi", tiny_data)
    with pytest.raises(Refused) as refused:
        submit(run, "lumi", lease, delta_file(tmp_path, g0), generation=5)
    assert refused.value.status == 409 and refused.value.code == "stale_generation"
    assert committed_rows(run) == []
    assert run.client().status()["generation"] == 0


def test_zero_live_sites_round_stays_open(run: LiveCoordinator) -> None:
    time.sleep(1.5)  # well past the join window
    status = run.client().status()
    assert status["round"] == 1 and status["generation"] == 0


@pytest.mark.parametrize("case", ["shape", "nan", "dtype", "missing", "not_safetensors"])
def test_bad_deltas_get_4xx_naming_the_problem_and_change_nothing(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path, case: str
) -> None:
    g0 = global_model(run, 0, tmp_path)
    lease = join_and_lease(run, "snellius", tiny_data)
    delta = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in g0.items()}
    path = tmp_path / "bad.safetensors"
    expected = {
        "shape": "norm.weight",
        "nan": "norm.weight",
        "dtype": "norm.weight",
        "missing": "norm.weight",
        "not_safetensors": "safetensors",
    }[case]
    if case == "shape":
        delta["norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    elif case == "nan":
        delta["norm.weight"][0] = float("nan")
    elif case == "dtype":
        delta["norm.weight"] = torch.zeros(delta["norm.weight"].shape, dtype=torch.int32)
    elif case == "missing":
        del delta["norm.weight"]
    if case == "not_safetensors":
        path.write_bytes(b"\xff" * 64)
    else:
        save_file(delta, str(path))
    with pytest.raises(Refused) as refused:
        submit(run, "snellius", lease, path)
    assert 400 <= refused.value.status < 500
    assert expected in refused.value.detail
    assert committed_rows(run) == []
    status = run.client().status()
    assert status["generation"] == 0 and status["blocks_committed_total"] == 0
    assert torch.equal(global_model(run, 0, tmp_path / "again")["norm.weight"], g0["norm.weight"])


def test_wrong_digest_unknown_site_and_foreign_token_are_refused(
    run: LiveCoordinator, tiny_data: Path
) -> None:
    with pytest.raises(Refused) as refused:
        run.client("lumi").register("lumi", digest_of(tiny_data, seed=8), 1, None)
    assert refused.value.status == 409 and refused.value.code == "digest_mismatch"
    with pytest.raises(Refused) as refused:
        run.client().register("nowhere", digest_of(tiny_data), 1, None)
    assert refused.value.status == 404 and "nowhere" in refused.value.detail
    with pytest.raises(Refused) as refused:
        run.client("lumi").register("snellius", digest_of(tiny_data), 1, None)
    assert refused.value.status == 403
    entries = {row["site"]: row["entries"] for row in run.client().ledger()}
    assert entries.get("lumi", 0) == 0 and entries.get("snellius", 0) == 0


def test_malformed_bodies_are_422(run: LiveCoordinator) -> None:
    headers = {"Authorization": f"Bearer {run.secrets['sites']['lumi']}"}
    response = httpx.post(f"{run.url}/v1/leases", headers=headers, content=b"{not json")
    assert response.status_code == 422
    response = httpx.post(
        f"{run.url}/v1/leases", headers=headers, json={"site": "lumi", "round": 1, "n_blocks": -3}
    )
    assert response.status_code == 422 and "n_blocks" in response.text
    response = httpx.put(
        f"{run.url}/v1/blobs/..%2F..%2Fetc%2Fpasswd", headers=headers, content=b"x"
    )
    assert response.status_code in (400, 404)


def test_corrupted_blob_upload_is_rejected(run: LiveCoordinator) -> None:
    headers = {"Authorization": f"Bearer {run.secrets['sites']['lumi']}"}
    key = "0" * 64
    response = httpx.put(f"{run.url}/v1/blobs/{key}", headers=headers, content=b"hello")
    assert response.status_code == 422 and "mismatch" in response.json()["detail"]
    assert not any((run.state_dir / "blobs").rglob(key))


def test_sigkilled_coordinator_comes_back_with_its_state(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    g0 = global_model(run, 0, tmp_path)
    a = join_and_lease(run, "snellius", tiny_data)
    b = join_and_lease(run, "lumi", tiny_data)
    path = delta_file(tmp_path, g0, seed=3)
    assert submit(run, "snellius", a, path)["accepted"]
    run.kill()
    run.restart()
    # the accepted delta is remembered: resending it is answered idempotently
    again = submit(run, "snellius", a, path)
    assert again["accepted"] and again["already"]
    assert submit(run, "lumi", b, delta_file(tmp_path, g0, seed=4, name="b"))["accepted"]
    info = wait_round_closed(run, 1)
    assert sorted(info["report"]["contributors"]) == ["lumi", "snellius"]
    rows = committed_rows(run)
    assert len(rows) == len({(r[0], r[1]) for r in rows}) == a["n_blocks"] + b["n_blocks"]


def test_the_ledger_is_bound_to_the_runs_block_space(run: LiveCoordinator, tiny_data: Path) -> None:
    """A run's DARL ledger records the block space it leases from (an auditor checks it, and
    a ledger of another space is refused when the coordinator loads it)."""
    with sqlite3.connect(run.state_dir / "state.sqlite") as conn:
        bound = dict(conn.execute(f"SELECT key, value FROM {META_TABLE}").fetchall())
    assert bound["space_digest"] == digest_of(tiny_data)
    run.kill()
    run.restart()  # loading it again binds the same space: no refusal
    assert run.client().status()["round"] == 1


@pytest.mark.parametrize("hold_s", [0.6, 0.0], ids=["held_then_cut", "cut_at_once"])
def test_a_long_poll_whose_connections_are_cut_is_asked_again_at_once_not_later_and_later(
    run: LiveCoordinator, hold_s: float
) -> None:
    """The merge's long poll (``status(after_round, wait_s)``) through a proxy that ends
    every connection after ``hold_s``: the coordinator was holding each try when it was cut,
    so the client asks again after its first delay every time, not after delays grown by
    the earlier cuts (which would learn of a closed round seconds late); a server it cannot
    reach (each connection closed at once) still gets the growing delays. Either way the
    retry budget ends it, naming what it asked."""
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    with CutConnections(run.port, hold_s) as proxy:
        url = f"http://127.0.0.1:{proxy.port}"
        client = CoordinatorClient(url, run.secrets["admin"], retry_budget_s=4.0, sleep=sleep)
        with pytest.raises(Unreachable, match="/v1/status"):
            client.status(after_round=1, wait_s=20.0)
    assert proxy.cuts >= 3 and len(slept) >= 2
    if hold_s:
        assert max(slept) <= 1.5 * HELD_TRY_S  # the first delay each time (jittered)
    else:
        assert max(slept) > 4 * HELD_TRY_S  # grown: 0.2, 0.4, 0.8, 1.6 s ...


def test_a_committed_leases_last_heartbeat_retrying_does_not_hold_up_what_comes_next(
    run: LiveCoordinator, tiny_data: Path
) -> None:
    """A site's round in flight stops its lease's heartbeat once the delta is answered, and
    then waits for the merge. A beat still retrying through a failing network (here every
    connection closed at once, for the client's whole retry budget) is left to finish on
    its own: ``stop(wait=False)`` returns with the beat's thread still retrying, where
    ``stop()`` waits for it (until the budget ends it)."""
    lease = join_and_lease(run, "snellius", tiny_data)
    with CutConnections(run.port, 0.0) as proxy:
        url = f"http://127.0.0.1:{proxy.port}"
        client = CoordinatorClient(url, run.secrets["sites"]["snellius"], retry_budget_s=3.0)
        beat = Heartbeat(client, "snellius", lease, interval_s=0.05)
        with beat:
            deadline = time.monotonic() + 30
            while proxy.cuts < 2:  # a beat is under way, retrying
                assert time.monotonic() < deadline, "no heartbeat was tried"
                time.sleep(0.02)
            beat.stop(wait=False)
            assert beat._thread.is_alive()  # still retrying: not waited for
            beat.stop()
            assert not beat._thread.is_alive()  # its budget spent, the beat gave up


def test_a_heartbeat_held_by_a_silent_connection_beats_again_within_the_leases_ttl(
    run: LiveCoordinator, tiny_data: Path
) -> None:
    """A beat whose connection the network holds without a word (a NAT that dropped it)
    gives up after ``BEAT_TRY_S``, and the next beat, on a new connection, renews the lease:
    a lease (a TTL of 10 s in the workflow) outlives one silent connection, where a beat
    waiting for the client's whole timeout (30 s here, its default) would have let it expire."""
    lease = join_and_lease(run, "snellius", tiny_data)

    def expiry() -> float:
        return lease_expiry(run, lease["lease_id"])

    before = expiry()
    with StalledFirst(run.port) as proxy:
        client = CoordinatorClient(
            f"http://127.0.0.1:{proxy.port}", run.secrets["sites"]["snellius"]
        )
        assert client.timeout_s >= 30.0
        beat = Heartbeat(client, "snellius", lease, interval_s=0.1, at_once=True)
        with beat:
            deadline = time.monotonic() + 2 * BEAT_TRY_S + 2.0
            while expiry() == before and time.monotonic() < deadline:
                time.sleep(0.05)
            renewed = expiry() > before  # before the beat's thread is stopped and waited for
        assert proxy.held == 1
        assert renewed, "no beat renewed the lease past the silent connection in time"
        assert beat.lost is None


def test_a_beats_try_is_its_floor_or_its_sites_round_trips_where_those_take_longer() -> None:
    assert beat_try_s(None) == BEAT_TRY_S
    assert beat_try_s(347.0) == BEAT_TRY_S  # the paper's longest link: 1.7 s in 5 round trips
    assert beat_try_s(2000.0) == pytest.approx(BEAT_TRY_RTTS * 2.0)


def test_a_heartbeat_over_a_link_slower_than_its_floor_hears_its_answer(
    run: LiveCoordinator, tiny_data: Path
) -> None:
    """A beat's answer is how a site learns its lease was shrunk by a steal or is gone. Over
    a link whose round trip is longer than ``BEAT_TRY_S`` (emulated here), a beat has
    ``BEAT_TRY_RTTS`` of the site's measured round trips, so the answer arrives: here the
    refusal of a lease released behind the site's back. Bounded by ``BEAT_TRY_S`` alone,
    every beat gave up before its answer came, and the site trained on, none the wiser."""
    lease = join_and_lease(run, "snellius", tiny_data)
    run.client("snellius").release(lease["lease_id"], "snellius")
    rtt_ms = (BEAT_TRY_S + 1.0) * 1000.0
    with EmulatorProcess([Link("slow", "127.0.0.1", run.port, rtt_ms=rtt_ms)]) as ports:
        client = CoordinatorClient(
            f"http://127.0.0.1:{ports['slow']}", run.secrets["sites"]["snellius"]
        )
        client.health()  # a round trip measured, as a site's join measures its RTT
        assert (client.recent_rtt_ms() or 0.0) >= rtt_ms
        beat = Heartbeat(client, "snellius", lease, interval_s=0.5, at_once=True)
        with beat:
            deadline = time.monotonic() + 2 * beat_try_s(rtt_ms) + 5.0
            while beat.lost is None and time.monotonic() < deadline:
                time.sleep(0.1)
        assert beat.lost is not None, "no beat over the slow link heard its answer"


def test_a_heartbeat_at_once_renews_its_lease_before_its_first_interval(
    run: LiveCoordinator, tiny_data: Path
) -> None:
    """A restarted job's resend beats the lease its killed job held, whose TTL may be near
    its end: with ``at_once`` the first beat goes out as the thread starts, not an interval
    (here an hour) later."""
    lease = join_and_lease(run, "snellius", tiny_data)
    client = run.client("snellius")

    def expiry() -> float:
        return lease_expiry(run, lease["lease_id"])

    before = expiry()
    for at_once in (False, True):
        beat = Heartbeat(client, "snellius", lease, interval_s=3600.0, at_once=at_once)
        with beat:
            deadline = time.monotonic() + (30 if at_once else 1.0)
            while expiry() == before and time.monotonic() < deadline:
                time.sleep(0.05)
        assert (expiry() > before) is at_once, at_once
