"""Large transfers over several connections: byte spans up and down, joined and checked."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossfed.client.http import (
    SPAN_ALIGN,
    CoordinatorClient,
    IntegrityError,
    split_spans,
)
from crossfed.wire.digests import CHUNK, digest_file
from tests.helpers.fake_coordinator import blake
from tests.helpers.live_app import Server

MiB = 1 << 20


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with Server(tmp_path / "state", max_request_s=60.0) as live:
        yield live


def write(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def record_requests(client: CoordinatorClient, n: int) -> list[list[httpx.Request]]:
    """The requests each of the client's ``n`` stream connections makes, per connection."""
    seen: list[list[httpx.Request]] = []
    for http in client._stream_clients(n):
        log: list[httpx.Request] = []
        http.event_hooks["request"] = [log.append]
        seen.append(log)
    return seen


@given(size=st.integers(0, 64 * SPAN_ALIGN + 5), n=st.integers(1, 16))
def test_spans_cover_the_blob_once_in_order_on_chunk_bounds(size: int, n: int) -> None:
    spans = split_spans(size, n)
    assert spans[0][0] == 0 and spans[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert 1 <= len(spans) <= max(1, n)
    assert all(start % SPAN_ALIGN == 0 for start, _ in spans)
    if size:
        assert all(end > start for start, end in spans)  # no empty span
        assert len(spans) == min(n, -(-size // SPAN_ALIGN))


def test_a_large_blob_goes_up_and_down_as_spans_over_separate_connections(
    server: Server, tmp_path: Path
) -> None:
    data = write(tmp_path / "blob.bin", 5 * CHUNK + 12345)
    client = server.client(streams=4, stream_min_bytes=MiB, part_bytes=3 * MiB)
    assert client.streams_for(len(data)) == 4
    seen = record_requests(client, 4)
    key = client.upload_blob(tmp_path / "blob.bin")
    assert key == blake(data)
    spans = split_spans(len(data), 4)
    # each connection sent one span as its own blob, in parts of at most part_bytes
    for log, (start, end) in zip(seen, spans, strict=True):
        puts = [r for r in log if r.method == "PUT"]
        assert sum(int(r.headers["content-length"]) for r in puts) == end - start
        assert {r.url.path for r in puts} == {f"/v1/blobs/{blake(data[start:end])}"}
    # joined: only the whole blob is stored, its parts are gone
    store = server.coordinator.blobs
    assert store.keys() == [key] and store.path(key).read_bytes() == data
    assert server.coordinator.blob_holders(key) == {"lumi"}
    for log in seen:
        log.clear()
    out = client.download_blob(key, tmp_path / "out" / "blob.bin")
    assert out.read_bytes() == data
    assert [p.name for p in out.parent.iterdir()] == ["blob.bin"]
    for log, (start, end) in zip(seen, spans, strict=True):
        ranges = [r.headers["range"] for r in log]
        assert ranges[0] == f"bytes={start}-{min(end, start + 3 * MiB) - 1}"


def test_small_blobs_stay_on_one_connection(server: Server, tmp_path: Path) -> None:
    data = write(tmp_path / "small.bin", 3 * MiB)
    client = server.client(streams=8, stream_min_bytes=2 * MiB)
    assert client.streams_for(len(data)) == 1
    seen = record_requests(client, 8)
    key = client.upload_blob(tmp_path / "small.bin")
    assert client.download_blob(key, tmp_path / "back.bin").read_bytes() == data
    assert not any(seen)


def test_spans_cut_at_the_request_deadline_each_resume(tmp_path: Path) -> None:
    """Every response is cut after one chunk (a proxy reaping connections): each span
    resumes on its own from the bytes it wrote, and the whole still checks out."""
    with Server(tmp_path / "state", max_request_s=0.0) as live:
        data = write(tmp_path / "blob.bin", 7 * CHUNK + 99)
        client = live.client(streams=3, stream_min_bytes=MiB)
        key = client.upload_blob(tmp_path / "blob.bin")
        seen = record_requests(client, 3)
        out = client.download_blob(key, tmp_path / "out.bin")
    assert out.read_bytes() == data
    spans = split_spans(len(data), 3)
    for log, (start, end) in zip(seen, spans, strict=True):
        starts = [int(r.headers["range"].split("=")[1].split("-")[0]) for r in log]
        assert starts == list(range(start, end, CHUNK))  # resumed chunk by chunk


def test_a_download_that_does_not_hash_to_its_digest_leaves_nothing(
    server: Server, tmp_path: Path
) -> None:
    data = write(tmp_path / "blob.bin", 4 * CHUNK)
    client = server.client(streams=2, stream_min_bytes=MiB)
    key = client.upload_blob(tmp_path / "blob.bin")
    stored = server.coordinator.blobs.path(key)
    stored.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit off
    with pytest.raises(IntegrityError, match="do not match"):
        client.download_blob(key, tmp_path / "out" / "blob.bin")
    assert list((tmp_path / "out").iterdir()) == []


def test_joining_refuses_foreign_missing_and_mismatched_parts(
    server: Server, tmp_path: Path
) -> None:
    lumi, frontier = server.client("lumi"), server.client("frontier")
    a, b = b"a" * 1000, b"b" * 1000
    for who, data in ((lumi, a), (frontier, b)):
        (tmp_path / "p").write_bytes(data)
        who.upload_blob(tmp_path / "p")
    whole = blake(a + b)

    def compose(who: CoordinatorClient, key: str, parts: list[str]) -> httpx.Response:
        return who.http.post(f"/v1/blobs/{key}/compose", json={"parts": parts})

    foreign = compose(lumi, whole, [blake(a), blake(b)])
    assert foreign.status_code == 403 and "frontier" not in foreign.text
    missing = compose(lumi, whole, [blake(a), blake(b"c")])
    assert missing.status_code == 404 and missing.json()["error"] == "unknown_blob"
    wrong = compose(lumi, blake(a + a + b"x"), [blake(a), blake(a)])
    assert wrong.status_code == 422 and wrong.json()["error"] == "digest_mismatch"
    assert not server.coordinator.blobs.exists(blake(a + a + b"x"))
    assert server.coordinator.blobs.exists(blake(a)) and server.coordinator.blobs.exists(blake(b))
    good = compose(lumi, blake(a + a), [blake(a), blake(a)])
    assert good.status_code == 200 and good.json()["complete"] is True
    assert not server.coordinator.blobs.exists(blake(a))  # the part went once joined
    assert server.coordinator.blobs.exists(blake(b))  # frontier's own upload stays
    assert compose(frontier, blake(a + a), [blake(b)]).status_code == 422


def test_the_same_delta_joined_again_stores_it_once(server: Server, tmp_path: Path) -> None:
    """A restarted job sends its delta again: the parts arrive, the join finds the blob
    already stored and checks them against it; one copy, no parts left."""
    data = write(tmp_path / "d.bin", 3 * CHUNK)
    first = server.client(streams=3, stream_min_bytes=MiB)
    key = first.upload_blob(tmp_path / "d.bin")
    again = server.client(streams=3, stream_min_bytes=MiB)
    parts = [
        again._upload_range(
            again.http,
            tmp_path / "d.bin",
            digest_file(tmp_path / "d.bin", "blake3", s, e),
            s,
            e,
            fresh=False,
        )
        for s, e in split_spans(len(data), 3)
    ]
    reply = again.http.post(f"/v1/blobs/{key}/compose", json={"parts": parts})
    assert reply.status_code == 200 and reply.json()["complete"] is True
    assert server.coordinator.blobs.keys() == [key]


def test_a_file_changing_under_a_parallel_upload_is_not_stored(
    server: Server, tmp_path: Path
) -> None:
    path = tmp_path / "d.bin"
    data = write(path, 2 * CHUNK)
    client = server.client(streams=2, stream_min_bytes=MiB)
    stale_key = blake(data)
    write(path, 2 * CHUNK)  # rewritten after its digest was taken
    with pytest.raises(IntegrityError, match="do not join"):
        client.upload_blob(path, stale_key)
    assert not server.coordinator.blobs.exists(stale_key)


def test_parallel_uploads_of_two_sites_at_once(server: Server, tmp_path: Path) -> None:
    files = {site: tmp_path / f"{site}.bin" for site in ("lumi", "frontier")}
    contents = {site: write(path, 3 * CHUNK + 1) for site, path in files.items()}
    keys: dict[str, str] = {}

    def send(site: str) -> None:
        client = server.client(site, streams=3, stream_min_bytes=MiB)
        keys[site] = client.upload_blob(files[site])

    threads = [threading.Thread(target=send, args=(site,)) for site in files]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store = server.coordinator.blobs
    assert sorted(store.keys()) == sorted(keys.values())
    for site, key in keys.items():
        assert store.path(key).read_bytes() == contents[site]
        assert server.coordinator.blob_holders(key) == {site}


def test_the_blob_store_joins_parts_in_order(tmp_path: Path) -> None:
    from crossfed.coordinator.blobs import BlobError, BlobStore

    store = BlobStore(tmp_path / "blobs")
    pieces = [os.urandom(CHUNK + 3), os.urandom(17), b""]
    for piece in pieces:
        asyncio.run(store.write_stream(blake(piece), _body(piece), max_bytes=1 << 30))
    key = blake(b"".join(pieces))
    state = asyncio.run(store.compose(key, [blake(p) for p in pieces]))
    assert state["complete"] and store.path(key).read_bytes() == b"".join(pieces)
    with pytest.raises(BlobError) as caught:
        asyncio.run(store.compose(blake(pieces[1] + pieces[0]), [blake(pieces[0])]))
    assert caught.value.status == 422
    assert list(store.staging.iterdir()) == []


async def _body(data: bytes):
    yield data


@given(
    size=st.integers(0, 40 * CHUNK),
    streams=st.integers(1, 16),
    min_bytes=st.sampled_from([1, MiB, CHUNK, 16 * MiB]),
)
def test_the_streams_a_blob_uses_are_the_spans_it_splits_into(
    size: int, streams: int, min_bytes: int
) -> None:
    client = CoordinatorClient("http://x", "t", streams=streams, stream_min_bytes=min_bytes)
    n = client.streams_for(size)
    assert 1 <= n <= streams and len(split_spans(size, n)) == n
    client.close()
