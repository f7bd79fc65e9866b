"""Weights on the wire: streamed safetensors files, digests, the blob store, parts and ranges."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from crossfed.client.http import CoordinatorClient, IntegrityError, Refused, Unreachable
from crossfed.client.reach import client_for
from crossfed.config import load_run_config
from crossfed.coordinator.blobs import BlobError, BlobStore, check_key
from crossfed.coordinator.embedded import start_embedded, stop_embedded
from crossfed.coordinator.http_ranged import RangeError, parse_range
from crossfed.wire.deltas import delta_of, save_delta
from crossfed.wire.digests import DigestError, canonical_digest, digest_file, parse_digest
from crossfed.wire.tensors import TensorSpec, open_tensors, save_stream, save_tensors
from tests.conftest import REPO
from tests.helpers.fake_coordinator import FakeCoordinator, blake
from tests.helpers.live_app import Server

MiB = 1 << 20


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- files
def test_streamed_file_is_plain_safetensors_and_its_digest_is_the_files(tmp_path: Path) -> None:
    tensors = {
        "w": torch.randn(17, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "i": torch.arange(6, dtype=torch.int8).view(2, 3),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "x.safetensors"
    digest = save_tensors(tensors, path, {"round": "3"})
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value)
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"round": "3"}
    assert digest == digest_file(path) == blake(path.read_bytes())
    assert save_tensors(tensors, path, {"round": "3"}, algo="sha256") == sha(path.read_bytes())
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind


def test_cast_on_write_gives_bf16_without_a_copy_of_the_dict(tmp_path: Path) -> None:
    master = {"a": torch.randn(64, 3), "b": torch.randn(5)}
    path = tmp_path / "g.safetensors"
    save_tensors(master, path, dtype=torch.bfloat16)
    back = load_file(str(path))
    for name, value in master.items():
        assert torch.equal(back[name], value.to(torch.bfloat16))


def test_a_tensor_that_does_not_match_its_header_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    specs = [TensorSpec("a", torch.float32, (3,))]
    with pytest.raises(ValueError, match="header says"):
        save_stream(path, specs, lambda spec: torch.zeros(4))
    with pytest.raises(ValueError, match="header says"):
        save_stream(path, specs, lambda spec: torch.zeros(3, dtype=torch.bfloat16))
    assert list(tmp_path.iterdir()) == []


def test_streamed_delta_equals_the_in_memory_delta(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    ref = {"w": torch.randn(33, 8, generator=gen), "n": torch.randn(8, generator=gen)}
    site = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in ref.items()}
    path = tmp_path / "d.safetensors"
    digest = save_delta(site, {k: v.to(torch.bfloat16) for k, v in ref.items()}, path)
    expected = delta_of(site, {k: v.to(torch.bfloat16) for k, v in ref.items()})
    back = load_file(str(path))
    assert all(torch.equal(back[k], expected[k]) for k in ref)
    assert digest == digest_file(path)
    # the reference may be a lazy view of the global model's file: the same delta
    save_tensors(ref, tmp_path / "g.safetensors", dtype=torch.bfloat16)
    with open_tensors(tmp_path / "g.safetensors") as lazy:
        assert sorted(lazy) == sorted(ref) and len(lazy) == 2
        save_delta(site, lazy, tmp_path / "d2.safetensors")
    again = load_file(str(tmp_path / "d2.safetensors"))
    assert all(torch.equal(again[k], expected[k]) for k in ref)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("blake3:" + "a" * 64, ("blake3", "a" * 64)),
        ("sha256:" + "0" * 64, ("sha256", "0" * 64)),
        ("f" * 64, ("sha256", "f" * 64)),  # legacy bare SHA-256
    ],
)
def test_digests_name_their_algorithm(text: str, expected: tuple[str, str]) -> None:
    assert parse_digest(text) == expected
    assert canonical_digest(text) == f"{expected[0]}:{expected[1]}"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "blake3:" + "A" * 64,
        "md5:" + "a" * 64,
        "blake3:" + "a" * 63,
        "../../etc/passwd",
        "blake3:../" + "a" * 61,
        "blake3:" + "a" * 64 + "/x",
    ],
)
def test_bad_digests_and_path_like_keys_are_refused(text: str) -> None:
    with pytest.raises(DigestError):
        parse_digest(text)
    with pytest.raises(BlobError) as caught:
        check_key(text)
    assert caught.value.status == 400


# --------------------------------------------------------------------------- blob store
async def body(data: bytes, piece: int = 1000, delay: float = 0.0) -> AsyncIterator[bytes]:
    for lo in range(0, len(data), piece):
        if delay:
            await asyncio.sleep(delay)
        yield data[lo : lo + piece]


def put(store: BlobStore, key: str, data: bytes, **kwargs) -> dict:
    kwargs.setdefault("max_bytes", 1 << 30)
    return asyncio.run(store.write_part(key, body(data), **kwargs))


def test_a_blob_uploaded_in_parts_is_verified_and_renamed_into_place(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = os.urandom(10_000)
    key = blake(data)
    assert store.upload_state(key) == {"key": key, "complete": False, "offset": 0, "bytes": None}
    state = put(store, key, data[:4000], offset=0, total=len(data))
    assert state["complete"] is False and state["offset"] == 4000
    assert store.upload_state(key)["offset"] == 4000
    state = put(store, key, data[4000:], offset=4000, total=len(data))
    assert state["complete"] is True and state["bytes"] == len(data)
    assert store.path(key).read_bytes() == data
    assert list((tmp_path / "blobs" / ".uploads").iterdir()) == []
    # idempotent: the same blob again is acknowledged (its body read and dropped)
    consumed = []

    async def again() -> AsyncIterator[bytes]:
        for piece in (data[:5000], data[5000:]):
            consumed.append(len(piece))
            yield piece

    state = asyncio.run(store.write_part(key, again(), max_bytes=1 << 20))
    assert state["complete"] is True and consumed == [5000, 5000]


HEAP_PROBE = """
import sys
from crossfed.wire.libc import keep_stream_buffers_in_heap
if sys.argv[1] == "tuned":
    assert keep_stream_buffers_in_heap()
buffer = bytes(16 << 20)  # a received batch's size
heap = [line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
lo, hi = (int(x, 16) for x in heap[0].split("-")) if heap else (0, 0)
print(lo <= id(buffer) < hi)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_transfer_buffers_come_from_the_heap_once_tuned() -> None:
    def in_heap(mode: str) -> bool:
        out = subprocess.run(
            [sys.executable, "-c", HEAP_PROBE, mode], capture_output=True, text=True, check=True
        )
        return out.stdout.strip() == "True"

    assert not in_heap("default")  # glibc mmaps a fresh 16 MiB buffer (faulted in anew)
    assert in_heap("tuned")


def test_a_store_whose_folders_were_deleted_under_it_recreates_them(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    shutil.rmtree(tmp_path / "blobs")  # an operator cleans up under a running coordinator
    assert store.prune([], [], grace_s=0) == []
    data = os.urandom(5000)
    key = blake(data)
    assert store.upload_state(key)["offset"] == 0
    assert put(store, key, data)["complete"] is True
    assert store.path(key).read_bytes() == data


def test_a_part_at_the_wrong_offset_is_refused_with_the_offset_to_use(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = os.urandom(5000)
    key = sha(data)
    put(store, key, data[:2000], offset=0, total=len(data))
    with pytest.raises(BlobError) as caught:
        put(store, key, data[3000:], offset=3000, total=len(data))
    assert caught.value.status == 409 and caught.value.extra == {"offset": 2000}
    assert put(store, key, data[2000:], offset=2000, total=len(data))["complete"]


def test_a_corrupted_upload_is_rejected_and_nothing_is_kept(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = os.urandom(3000)
    key = blake(data)
    corrupted = data[:1000] + b"\x00" + data[1001:]
    with pytest.raises(BlobError) as caught:
        put(store, key, corrupted)
    assert caught.value.status == 422 and "mismatch" in str(caught.value)
    assert not store.exists(key) and store.upload_state(key)["offset"] == 0
    truncated = data[:2999]
    with pytest.raises(BlobError):
        put(store, key, truncated)
    assert put(store, key, data)["complete"]  # the retry goes through


def test_a_slow_part_is_cut_at_its_deadline_and_resumes_where_it_stopped(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = os.urandom(20_000)
    key = blake(data)

    async def slow() -> dict:
        return await store.write_part(
            key,
            body(data, piece=1000, delay=0.02),
            offset=0,
            total=len(data),
            max_bytes=1 << 20,
            deadline=time.monotonic() + 0.15,
        )

    with pytest.raises(BlobError) as caught:
        asyncio.run(slow())
    assert caught.value.status == 408
    got = caught.value.extra["offset"]
    assert 0 < got < len(data) and store.upload_state(key)["offset"] == got
    assert put(store, key, data[got:], offset=got, total=len(data))["complete"]
    assert store.path(key).read_bytes() == data


def test_a_part_past_its_deadline_before_its_first_bytes_still_keeps_one_chunk(
    tmp_path: Path,
) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = os.urandom(8_000)
    key = blake(data)
    part = store.write_part(
        key,
        body(data, piece=1000, delay=0.05),  # each piece comes after the bound has passed
        offset=0,
        total=len(data),
        max_bytes=1 << 20,
        deadline=time.monotonic() + 0.01,
    )
    with pytest.raises(BlobError) as caught:
        asyncio.run(part)
    assert caught.value.status == 408
    assert 1000 <= caught.value.extra["offset"] < len(data)  # progress, however short the bound


def test_an_upload_resumes_across_a_restart_of_the_store(tmp_path: Path) -> None:
    data = os.urandom(50_000)
    key = blake(data)
    put(BlobStore(tmp_path / "blobs"), key, data[:30_000], offset=0, total=len(data))
    fresh = BlobStore(tmp_path / "blobs")  # no hasher state: rebuilt from the staged bytes
    assert fresh.upload_state(key)["offset"] == 30_000
    assert put(fresh, key, data[30_000:], offset=30_000, total=len(data))["complete"]
    assert fresh.path(key).read_bytes() == data


def test_oversized_blobs_and_overlong_parts_are_refused(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = os.urandom(3000)
    with pytest.raises(BlobError) as caught:
        put(store, blake(data), data, max_bytes=2000)
    assert caught.value.status == 413
    with pytest.raises(BlobError) as caught:
        put(store, blake(data), data, total=10_000, max_bytes=2000)
    assert caught.value.status == 413
    with pytest.raises(BlobError) as caught:
        put(store, blake(data), data, offset=0, total=1000)
    assert caught.value.status == 400 and "declared total" in str(caught.value)


def test_prune_drops_merged_keeps_pending_and_ages_out_orphans(tmp_path: Path) -> None:
    now = [1000.0]
    store = BlobStore(tmp_path / "blobs", clock=lambda: now[0])
    blobs = {name: os.urandom(100) for name in ("merged", "pending", "orphan", "fresh")}
    keys = {name: blake(data) for name, data in blobs.items()}
    for name, data in blobs.items():
        put(store, keys[name], data)
    part_data = os.urandom(100)
    put(store, blake(part_data), part_data[:50], offset=0, total=100)
    old = now[0] - 7200
    for name in ("merged", "pending", "orphan"):
        os.utime(store.path(keys[name]), (old, old))
    os.utime(next((tmp_path / "blobs" / ".uploads").iterdir()), (old, old))
    deleted = store.prune(drop=[keys["merged"]], keep=[keys["pending"]], grace_s=3600)
    assert sorted(deleted) == sorted([keys["merged"], keys["orphan"], blake(part_data)])
    assert store.exists(keys["pending"]) and store.exists(keys["fresh"])
    assert not store.exists(keys["merged"]) and not store.exists(keys["orphan"])
    assert list((tmp_path / "blobs" / ".uploads").iterdir()) == []


# --------------------------------------------------------------------------- ranges
@pytest.mark.parametrize(
    "header, size, expected",
    [
        (None, 10, None),
        ("bytes=0-3", 10, (0, 4)),
        ("bytes=4-", 10, (4, 10)),
        ("bytes=8-100", 10, (8, 10)),
        ("bytes=-3", 10, (7, 10)),
        ("bytes=0-5", 0, None),  # an empty file is sent whole
    ],
)
def test_single_byte_ranges(header: str | None, size: int, expected) -> None:
    assert parse_range(header, size) == expected


@pytest.mark.parametrize("header", ["bytes=10-", "bytes=5-2", "bytes=0-1,3-4", "items=0-1", "x"])
def test_unsatisfiable_ranges_are_refused(header: str) -> None:
    with pytest.raises(RangeError):
        parse_range(header, 10)


# --------------------------------------------------------------------------- client logic
def fake_client(fake: FakeCoordinator, part_bytes: int = 1000) -> CoordinatorClient:
    client = CoordinatorClient(
        "http://coordinator", "tok", part_bytes=part_bytes, sleep=lambda s: None
    )
    client.http = httpx.Client(
        base_url="http://coordinator", transport=httpx.MockTransport(fake.handler)
    )
    return client


def test_upload_resumes_after_dropped_and_timed_out_parts(tmp_path: Path) -> None:
    fake = FakeCoordinator()
    data = os.urandom(4500)
    path = tmp_path / "d.bin"
    path.write_bytes(data)
    fake.faults = [None, None, "drop", None, "timeout"]  # state, part 1, part 2 breaks, ...
    key = fake_client(fake).upload_blob(path)
    assert key == blake(data) and fake.complete[key] == data
    puts = [c for c in fake.calls if c.startswith("PUT")]
    assert len(puts) > 5  # five parts plus the broken and cut ones


def test_a_blob_mismatch_is_retried_a_bounded_number_of_times(tmp_path: Path) -> None:
    fake = FakeCoordinator()
    path = tmp_path / "d.bin"
    path.write_bytes(os.urandom(500))
    with pytest.raises(IntegrityError, match="hashed it differently"):
        fake_client(fake).upload_blob(path, key=blake(b"something else"))


def test_a_resent_delta_costs_no_upload_and_inline_falls_back_to_blob(tmp_path: Path) -> None:
    fake = FakeCoordinator()
    path = tmp_path / "d.bin"
    path.write_bytes(os.urandom(2500))
    client = fake_client(fake)
    fields = dict(site="lumi", lease_id=7, generation=0, tokens=10, steps=1, consumed=1)
    fake.faults = [None, "inline_408"]  # the reference is unknown, the inline body too slow
    reply = client.submit_delta(1, path, inline=True, **fields)
    assert reply == {"accepted": True, "already": False}
    assert fake.deltas[7] == blake(path.read_bytes())
    assert any(c.startswith("PUT") for c in fake.calls)  # it went as a blob
    for inline in (False, True):  # a resend costs one short request, no bytes
        fake.calls.clear()
        again = client.submit_delta(1, path, inline=inline, **fields)
        assert again["already"] and fake.calls == ["POST /v1/rounds/1/deltas"]


def test_an_inline_delta_goes_in_one_request_after_the_reference_check(tmp_path: Path) -> None:
    fake = FakeCoordinator()
    path = tmp_path / "d.bin"
    path.write_bytes(os.urandom(2500))
    fields = dict(site="lumi", lease_id=8, generation=0, tokens=10, steps=1, consumed=1)
    assert fake_client(fake).submit_delta(1, path, inline=True, **fields)["accepted"]
    assert fake.calls == ["POST /v1/rounds/1/deltas", "POST /v1/rounds/1/deltas/inline"]


def test_refusals_other_than_resync_ones_surface(tmp_path: Path) -> None:
    path = tmp_path / "d.bin"
    path.write_bytes(b"x" * 10)
    client = CoordinatorClient("http://coordinator", "tok", sleep=lambda s: None)
    client.http = httpx.Client(
        base_url="http://coordinator",
        transport=httpx.MockTransport(
            lambda r: httpx.Response(403, json={"error": "forbidden", "detail": "no"})
        ),
    )
    with pytest.raises(Refused) as caught:
        client.upload_blob(path)
    assert caught.value.code == "forbidden"


# --------------------------------------------------------------------------- real server
@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with Server(tmp_path / "state", max_request_s=60.0) as live:
        yield live


def test_parts_up_and_ranges_down_through_the_real_app(server: Server, tmp_path: Path) -> None:
    data = os.urandom(3 * MiB + 12345)
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    client = server.client(part_bytes=MiB)
    key = client.upload_blob(path)
    assert key == blake(data) and client.blob_state(key)["complete"]
    out = client.download_blob(key, tmp_path / "out" / "blob.bin")
    assert out.read_bytes() == data
    again = client.http.put(f"/v1/blobs/{key}", content=data)  # whole again: drained, 201
    assert again.status_code == 201 and again.json()["complete"] is True
    assert [p.name for p in out.parent.iterdir()] == ["blob.bin"]
    response = client.http.get(f"/v1/blobs/{key}", headers={"Range": "bytes=5-9"})
    assert response.status_code == 206 and response.content == data[5:10]
    assert response.headers["content-range"] == f"bytes 5-9/{len(data)}"
    assert response.headers["x-content-digest"] == key


def test_a_download_cut_at_the_request_deadline_resumes(tmp_path: Path) -> None:
    data = os.urandom(9 * MiB + 7)  # three 4 MiB chunks: each response is cut after one
    with Server(tmp_path / "state", max_request_s=0.0) as live:
        key = blake(data)
        asyncio.run(
            live.coordinator.blobs.write_part(key, body(data, piece=MiB), max_bytes=1 << 30)
        )
        client = live.client(part_bytes=64 * MiB)
        ranges: list[str] = []
        client.http.event_hooks["request"] = [lambda r: ranges.append(r.headers["range"])]
        out = client.download_blob(key, tmp_path / "out.bin")
    assert out.read_bytes() == data
    assert ranges[:3] == [f"bytes={n * 4 * MiB}-{n * 4 * MiB + 64 * MiB - 1}" for n in range(3)]


def test_downloads_read_the_socket_in_large_pieces(server: Server, tmp_path: Path) -> None:
    import httpcore

    from crossfed.client.http import RESPONSE_READ_BYTES

    assert httpcore.HTTP11Connection.READ_NUM_BYTES >= RESPONSE_READ_BYTES  # set on import
    data = os.urandom(2 * RESPONSE_READ_BYTES + 7)  # pieces larger than one range: still whole
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    client = server.client(part_bytes=RESPONSE_READ_BYTES // 2)
    key = client.upload_blob(path)
    assert client.download_blob(key, tmp_path / "out.bin").read_bytes() == data


def test_an_empty_blob_round_trips(server: Server, tmp_path: Path) -> None:
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    client = server.client()
    key = client.upload_blob(path)
    assert client.download_blob(key, tmp_path / "back.bin").read_bytes() == b""


def test_http_refusals_name_the_problem(server: Server, tmp_path: Path) -> None:
    client = server.client()
    bad = client.http.put("/v1/blobs/blake3:..%2F..%2Fetc", content=b"x")
    assert bad.status_code in (400, 404)
    key = blake(b"hello")
    wrong = client.http.put(f"/v1/blobs/{key}", content=b"hullo")
    assert wrong.status_code == 422 and wrong.json()["error"] == "digest_mismatch"
    client.http.put(f"/v1/blobs/{key}", params={"offset": 0, "total": 5}, content=b"he")
    skip = client.http.put(f"/v1/blobs/{key}", params={"offset": 4, "total": 5}, content=b"o")
    assert skip.status_code == 409 and skip.json()["offset"] == 2
    missing = client.http.get(f"/v1/blobs/{blake(b'nope')}")
    assert missing.status_code == 404 and missing.json()["error"] == "unknown_blob"
    with pytest.raises(Refused) as caught:
        client.download_model(0, tmp_path / "g0.safetensors")
    assert caught.value.code in ("unknown_generation", "no_run")
    with pytest.raises(Unreachable):
        CoordinatorClient("http://127.0.0.1:9", "t", retry_budget_s=0.5).download_blob(
            key, tmp_path / "x"
        )


def _raw_exchange(port: int, head: bytes, body: bytes) -> tuple[bytes, float]:
    """Send a request head and part of its body on a raw socket, then read the whole answer
    (head and Content-Length body); (everything read, seconds it took)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(30)
        t0 = time.monotonic()
        sock.sendall(head + body)
        reply = b""
        while True:
            top, sep, rest = reply.partition(b"\r\n\r\n")
            if sep:
                length = [line for line in top.lower().split(b"\r\n") if b"content-length" in line]
                if length and len(rest) >= int(length[0].split(b":")[1]):
                    return reply, time.monotonic() - t0
            chunk = sock.recv(65536)
            if not chunk:
                return reply, time.monotonic() - t0
            reply += chunk


def test_a_json_request_whose_body_stalls_is_answered_408_within_the_bound(
    tmp_path: Path,
) -> None:
    with Server(tmp_path / "state", max_request_s=0.5) as live:
        head = (
            b"POST /v1/sites/lumi/register HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer lumi-token\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n"
        )
        reply, took = _raw_exchange(live.port, head, b'{"digest": ')  # 11 of 100 bytes
        status, _, payload = reply.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 408"), reply[:200]
        assert json.loads(payload)["error"] == "request_timeout"
        assert took < 10  # not held until the client gives up
        # the blob routes keep their own bound (408 with the offset reached), not this one
        key = blake(b"0123456789")
        blob_head = (
            f"PUT /v1/blobs/{key}?offset=0&total=10 HTTP/1.1\r\nHost: x\r\n"
            "Authorization: Bearer lumi-token\r\nContent-Length: 10\r\n\r\n"
        ).encode()
        reply, _ = _raw_exchange(live.port, blob_head, b"01234")
        status, _, payload = reply.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 408"), reply[:200]
        assert json.loads(payload)["offset"] == 5
        # a body that arrives in time is answered as usual, and the server carries on
        response = live.client().http.post("/v1/sites/lumi/register", json={"digest": "x"})
        assert response.status_code not in (408, 500), response.text
        assert live.client().health()["ok"]


def test_the_client_resends_a_json_request_answered_408(tmp_path: Path) -> None:
    """A proxy in front of the coordinator answers 408 when a body comes too slowly; the
    request never reached the coordinator, so the client sends it again. (The proxy here is
    a stand-in: a stdlib HTTP server that answers 408 once, then 200.)"""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies: list[bytes] = []

    class Proxy(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the stdlib's naming)
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            status, reply = (408, b"{}") if len(bodies) == 1 else (200, b'{"ok": true}')
            self.send_response(status)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: object) -> None:
            pass

    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        client = CoordinatorClient(
            f"http://127.0.0.1:{proxy.server_address[1]}", "t", retry_budget_s=10.0
        )
        client.sleep = lambda _s: None
        assert client.post("/v1/leases/1/heartbeat", {"consumed": 2}) == {"ok": True}
        assert len(bodies) == 2 and json.loads(bodies[0]) == json.loads(bodies[1])
    finally:
        proxy.shutdown()


def test_the_configured_request_bound_reaches_a_real_coordinator_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``coordinator.max_request_s`` goes to ``crossfed coordinator serve --max-request-s``
    and ``transport.part_bytes`` to the client: downloads come in cut-short ranges."""
    state = tmp_path / "coordinator"
    sites_file = str(REPO / "config" / "sites.yaml")
    config = load_run_config(
        None,
        {
            "sites_file": sites_file,
            "coordinator": {
                "url": "embedded",
                "state_dir": str(state),
                "secrets": str(state / "secrets.yaml"),
                "host": "127.0.0.1",
                "port": 0,
                "max_request_s": 1e-6,  # every response is cut after its first chunk
            },
            "transport": {"part_bytes": 32 * MiB, "streams": 1},
        },
    )
    url = start_embedded(config, ["lumi"])
    try:
        data = os.urandom(9 * MiB + 7)
        key = blake(data)
        store = BlobStore(state / "blobs")  # the same store on disk, written directly
        asyncio.run(store.write_part(key, body(data, piece=MiB), max_bytes=1 << 30))
        client = client_for(config, "lumi")
        assert client.part_bytes == 32 * MiB and client.url == url
        ranges: list[str] = []
        client.http.event_hooks["request"] = [lambda r: ranges.append(r.headers["range"])]
        assert client.download_blob(key, tmp_path / "out.bin").read_bytes() == data
        assert ranges == [f"bytes={n * 4 * MiB}-{n * 4 * MiB + 32 * MiB - 1}" for n in range(3)]
    finally:
        assert stop_embedded(config)
    monkeypatch.setenv("CROSSFED_TOKEN", "t")
    # the default part size when the key is absent
    config = load_run_config(None, {"sites_file": sites_file, "coordinator": {"url": url}})
    assert client_for(config, "lumi").part_bytes == 64 * MiB


def test_a_body_that_breaks_off_keeps_what_arrived(tmp_path: Path) -> None:
    """A connection a proxy resets mid-part: every byte that arrived stays, so the upload
    resumes right after it (not at the last 8 MiB batch)."""
    store = BlobStore(tmp_path / "blobs")
    data = os.urandom(3 * MiB + 17)
    key = blake(data)

    async def broken() -> AsyncIterator[bytes]:
        yield data[: 2 * MiB]
        yield data[2 * MiB : 3 * MiB]
        raise ConnectionResetError("the proxy reset the connection")

    with pytest.raises(ConnectionResetError):
        asyncio.run(store.write_part(key, broken(), total=len(data), max_bytes=1 << 30))
    assert store.upload_state(key) == {
        "key": key,
        "complete": False,
        "offset": 3 * MiB,
        "bytes": None,
    }
    rest = body(data[3 * MiB :])
    state = asyncio.run(
        store.write_part(key, rest, offset=3 * MiB, total=len(data), max_bytes=1 << 30)
    )
    assert state["complete"] and store.path(key).read_bytes() == data
