"""Round trips a site spends per round, which a long link multiplies: a fresh delta goes up
without questions and is joined by its own submission, a merged model comes down without a
size probe, and a site waiting for a merge hears of it in the request that waits."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx

from crossfed.client.http import CoordinatorClient
from crossfed.coordinator.blobs import BlobStore
from crossfed.wire.digests import digest_file
from tests.conftest import LiveCoordinator
from tests.unit.test_coordinator_http import (
    delta_file,
    global_model,
    join_and_lease,
    wait_round_closed,
)

KiB = 1 << 10


def requests_of(client: CoordinatorClient, streams: int) -> list[httpx.Request]:
    """Every request the client makes from now on, over its main and stream connections."""
    seen: list[httpx.Request] = []
    for http in [client.http, *client._stream_clients(streams)]:
        http.event_hooks["request"] = [seen.append]
    return seen


def fields(lease: dict) -> dict:
    return dict(site="lumi", lease_id=lease["lease_id"], generation=0, tokens=256, steps=4,
                consumed=lease["n_blocks"], loss=3.0)  # fmt: skip


def test_a_fresh_delta_in_parts_goes_up_in_one_submission_that_joins_it(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    path = delta_file(tmp_path, global_model(run, 0, tmp_path))
    lease = join_and_lease(run, "lumi", tiny_data)
    client = run.client("lumi", streams=3, stream_min_bytes=64 * KiB)
    assert client.streams_for(path.stat().st_size) == 3
    seen = requests_of(client, 3)
    reply = client.submit_delta(1, path, inline=False, fresh=True, **fields(lease))
    assert reply["accepted"]
    asked = [(r.method, r.url.path) for r in seen if r.method != "PUT"]
    # no reference check, no upload state, no separate join: one POST after the parts
    assert asked == [("POST", "/v1/rounds/1/deltas")]
    puts = [r for r in seen if r.method == "PUT"]
    assert {r.url.params["offset"] for r in puts} == {"0"}  # each part whole, from its start
    assert len({r.url.path for r in puts}) == 3
    # joined: the delta alone is stored, its parts are gone, nothing is staged
    assert BlobStore(run.state_dir / "blobs").keys() == [digest_file(path)]
    assert not list((run.state_dir / "blobs" / ".uploads").glob("*"))
    # the same delta sent again (a restarted job) is one request by reference, no bytes
    seen.clear()
    again = client.submit_delta(1, path, inline=False, **fields(lease))
    assert again["accepted"] and again.get("already")
    assert [(r.method, r.url.path) for r in seen] == [("POST", "/v1/rounds/1/deltas")]


def test_a_submission_whose_parts_are_gone_sends_them_again(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """A submission naming parts the coordinator does not hold is refused 404
    ``unknown_blob`` and nothing is accepted; the client's own then goes through."""
    path = delta_file(tmp_path, global_model(run, 0, tmp_path))
    lease = join_and_lease(run, "lumi", tiny_data)
    client = run.client("lumi", streams=2, stream_min_bytes=64 * KiB)
    body = {
        **fields(lease),
        "blob": digest_file(path),
        "parts": [digest_file(path, "blake3", 0, 1)],
    }
    refused = client.http.post("/v1/rounds/1/deltas", json=body)
    assert refused.status_code == 404 and refused.json()["error"] == "unknown_blob"
    assert run.client().round_info(1)["deltas"] == []
    reply = client.submit_delta(1, path, inline=False, fresh=True, **fields(lease))
    assert reply["accepted"] and not reply.get("already")


def test_two_sites_sending_the_same_bytes_in_parts_store_them_once(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """The second site's parts prove it holds the same bytes: its submission joins them
    against the stored blob (no second copy) and is accepted as its own."""
    path = delta_file(tmp_path, global_model(run, 0, tmp_path))
    # both leases are held before either delta goes in: a round with no active lease left
    # closes once its join window has passed, which a busy machine can reach in between
    leases = {site: join_and_lease(run, site, tiny_data) for site in ("lumi", "snellius")}
    for site, lease in leases.items():
        client = run.client(site, streams=3, stream_min_bytes=64 * KiB)
        reply = client.submit_delta(
            1, path, inline=False, fresh=True, **{**fields(lease), "site": site}
        )
        assert reply["accepted"] and not reply.get("already"), site
    assert BlobStore(run.state_dir / "blobs").keys() == [digest_file(path)]
    assert sorted(d["site"] for d in run.client().round_info(1)["deltas"]) == ["lumi", "snellius"]


def test_a_merged_model_comes_down_in_parallel_without_a_size_probe(
    run: LiveCoordinator, tmp_path: Path
) -> None:
    client = run.client("lumi", streams=3, stream_min_bytes=64 * KiB)
    status = client.status()
    model = status["model"]
    assert model["generation"] == status["generation"] == 0 and model["digest"].startswith("b")
    seen = requests_of(client, 3)
    path = client.download_model(0, tmp_path / "known.safetensors", model)
    ranges = [r.headers["range"] for r in seen]
    assert "bytes=0-0" not in ranges and len(ranges) >= 3
    assert path.stat().st_size == model["bytes"] and digest_file(path) == model["digest"]
    seen.clear()  # without the status's figures it asks for them with one byte first
    client.download_model(0, tmp_path / "asked.safetensors")
    assert seen[0].headers["range"] == "bytes=0-0"


def test_a_site_waiting_for_a_merge_hears_of_it_in_the_waiting_request(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    lumi = run.client("lumi")
    # nothing closes: the poll answers after its wait with the round still open
    assert lumi.status(1, wait_s=0.3)["round"] == 1
    assert lumi.status(0, wait_s=20)["round"] == 1  # already past: answered at once
    assert lumi.status(7, wait_s=20)["round"] == 1  # not open yet: nothing to wait for
    path = delta_file(tmp_path, global_model(run, 0, tmp_path))
    lease = join_and_lease(run, "lumi", tiny_data)
    answers: list[dict] = []
    seen = requests_of(lumi, 1)
    poll = threading.Thread(target=lambda: answers.append(lumi.status(1, wait_s=20)))
    poll.start()
    run.client("lumi").submit_delta(1, path, inline=False, **fields(lease))
    wait_round_closed(run, 1)
    poll.join(timeout=30)
    assert not poll.is_alive()
    assert answers[0]["round"] == 2 and answers[0]["model"]["generation"] == 1
    assert len([r for r in seen if r.url.path == "/v1/status"]) == 1  # one request, held


def test_a_site_that_measured_its_rtt_asks_nothing_more_to_learn_the_blob_backend(
    run: LiveCoordinator,
) -> None:
    client = run.client("lumi", blobs=None)  # the backend not known from a config
    seen = requests_of(client, 1)
    client.rtt_ms()
    assert [r.url.path for r in seen] == ["/v1/health"] * 3
    assert client.backend == "file"
    assert len(seen) == 3  # the backend came with the health checks' answers


def test_a_site_that_heartbeats_measures_its_rtt_without_asking_more(
    run: LiveCoordinator, tiny_data: Path
) -> None:
    lease = join_and_lease(run, "lumi", tiny_data)
    client = run.client("lumi")
    seen = requests_of(client, 1)
    for _ in range(2):
        client.heartbeat(lease["lease_id"], "lumi", 0, None)
    # two short requests are not enough: the third sample comes from health checks
    first = client.rtt_ms()
    assert [r.url.path for r in seen].count("/v1/health") == 3
    assert first > 0
    seen.clear()
    for _ in range(3):
        client.heartbeat(lease["lease_id"], "lumi", 0, None)
    again = client.rtt_ms()  # the next round's join: the heartbeats' round trips answer it
    assert [r.url.path for r in seen] == [f"/v1/leases/{lease['lease_id']}/heartbeat"] * 3
    assert again > 0


def test_a_long_poll_or_a_stale_sample_is_not_a_round_trip(
    run: LiveCoordinator, tiny_data: Path, monkeypatch
) -> None:
    import crossfed.client.http as http_client

    client = run.client("lumi")
    for _ in range(3):
        client.status(1, wait_s=0.3)  # waits by design: its time is not the link's
    seen = requests_of(client, 1)
    client.rtt_ms()
    assert [r.url.path for r in seen] == ["/v1/health"] * 3
    seen.clear()
    monkeypatch.setattr(http_client, "RTT_FRESH_S", 0.0)  # the samples above are now stale
    client.rtt_ms()
    assert [r.url.path for r in seen] == ["/v1/health"] * 3
