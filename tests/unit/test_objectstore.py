"""Deltas and global models in an S3-compatible store (``blobs.backend: s3``), against a real
SeaweedFS and a real coordinator process: sites move the bytes through presigned URLs, the
coordinator stays the authority (who owns which object, digests, the merge)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest
import torch
import yaml
from safetensors.torch import save_file

from crossfed.client.http import CoordinatorClient, Refused
from crossfed.coordinator import objectstore
from crossfed.coordinator import store as state_db
from crossfed.coordinator.embedded import ServeCommand, ensure_secrets, free_port, spawn_coordinator
from crossfed.coordinator.generations import model_file_bytes, write_generation
from crossfed.coordinator.merger import LocalMerger
from crossfed.coordinator.objectstore import (
    ModelUpload,
    ObjectStore,
    ObjectStoreError,
    ObjectTensorFile,
    S3Settings,
    open_objects,
)
from crossfed.coordinator.s3blobs import ObjectBlobs
from crossfed.wire.digests import digest_file
from tests.conftest import SITES, LiveCoordinator, stop, tiny_spec
from tests.helpers.seaweedfs import ACCESS_KEY, REGION, SECRET_KEY, SeaweedFS
from tests.unit.test_coordinator_http import (
    delta_file,
    global_model,
    join_and_lease,
    wait_round_closed,
)

MiB = 1 << 20
PART = 5 * MiB  # S3's smallest part: a 11 MiB blob goes in three


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path_factory.mktemp("weed")).start()
    yield server
    server.stop()


def s3_coordinator(weed: SeaweedFS, state: Path, **s3: object) -> LiveCoordinator:
    """A coordinator process keeping blobs in ``weed`` under a prefix of its own, with the
    store's key in its secrets file (not in its environment)."""
    state.mkdir(parents=True)
    secrets = ensure_secrets(state / "secrets.yaml", SITES)
    secrets["s3"] = {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY}
    (state / "secrets.yaml").write_text(yaml.safe_dump(secrets))
    blobs = weed.blobs_config(prefix=f"{state.parent.name}/{state.name}/")
    blobs["s3"].update({"part_bytes": PART, **s3})
    (state / "blobs.yaml").write_text(yaml.safe_dump({"blobs": blobs}))
    port = free_port("127.0.0.1")
    blobs_path = state / "blobs.yaml"
    command = ServeCommand(state, state / "secrets.yaml", "127.0.0.1", port, blobs=blobs_path)
    proc = spawn_coordinator(command, 240)
    return LiveCoordinator(f"http://127.0.0.1:{port}", state, secrets, proc, port)


@pytest.fixture
def s3_run(weed: SeaweedFS, tmp_path: Path, tiny_data: Path) -> Iterator[LiveCoordinator]:
    if weed.process is None:  # a test that stopped the store failed before restarting it
        weed.start()
    live = s3_coordinator(weed, tmp_path / "coordinator")
    live.client().init_run(tiny_spec(tiny_data).to_dict())
    yield live
    stop(live.process)


def bucket(weed: SeaweedFS):
    return boto3.client(
        "s3",
        endpoint_url=weed.endpoint,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )


def objects(weed: SeaweedFS, live: LiveCoordinator) -> list[str]:
    prefix = f"{live.state_dir.parent.name}/{live.state_dir.name}/"
    listing = bucket(weed).list_objects_v2(Bucket=weed.bucket, Prefix=prefix)
    return sorted(o["Key"][len(prefix) :] for o in listing.get("Contents", []))


def fields(site: str, lease: dict) -> dict:
    return dict(site=site, lease_id=lease["lease_id"], generation=0, tokens=256, steps=4,
                consumed=lease["n_blocks"], loss=3.0)  # fmt: skip


def big_file(path: Path, size: int = 11 * MiB, seed: int = 1) -> Path:
    path.write_bytes(bytes((i * 7 + seed) % 251 for i in range(251)) * (size // 251 + 1))
    with open(path, "r+b") as handle:
        handle.truncate(size)
    return path


def upload_under(site: CoordinatorClient, key: str, path: Path) -> httpx.Response:
    """``path``'s bytes put to the store as blob ``key`` (in one part) and the upload
    completed: the coordinator's answer to the completion."""
    size = path.stat().st_size
    plan = site.post(f"/v1/blobs/{key}/uploads", {"bytes": size})
    (part,) = plan["parts"]
    assert httpx.put(part["url"], content=path.read_bytes()).status_code == 200
    return site.http.post(
        f"/v1/blobs/{key}/uploads/{plan['upload_id']}/complete", json={"bytes": size}
    )


def test_a_round_goes_through_the_store_and_not_through_the_coordinator(
    s3_run: LiveCoordinator, weed: SeaweedFS, tiny_data: Path, tmp_path: Path
) -> None:
    """Three sites' deltas go up in parts to presigned URLs, are merged from the store and the
    next global model comes down from it; no weight byte crosses the coordinator's API."""
    assert httpx.get(f"{s3_run.url}/v1/health").json()["blobs"] == "s3"
    reference = global_model(s3_run, 0, tmp_path)
    seen: list[httpx.Request] = []
    keys = []
    # frontier's lease (the long initial TTL) keeps round 1 open while the store is listed:
    # once every site has delivered, the merge may delete the deltas' objects before a listing
    sites = ["frontier", "lumi", "snellius"]
    leases = {site: join_and_lease(s3_run, site, tiny_data) for site in sites}

    def submit(i: int, site: str) -> None:
        path = delta_file(tmp_path, reference, seed=i, name=site)
        keys.append(digest_file(path))
        client = s3_run.client(site, streams=4, blobs="s3")
        client.http.event_hooks["request"] = [seen.append]
        reply = client.submit_delta(1, path, inline=True, fresh=True, **fields(site, leases[site]))
        assert reply["accepted"]

    for i, site in enumerate(sites[1:]):
        submit(i, site)
    stored = objects(weed, s3_run)
    for site, key in zip(sites[1:], keys, strict=True):
        assert f"blobs/{site}/{key.replace(':', '/')}" in stored
    submit(2, "frontier")
    # only JSON went to the coordinator: no PUT, no inline body
    assert {r.method for r in seen} <= {"GET", "POST"}
    assert all(len(r.content) < 4096 for r in seen)
    info = wait_round_closed(s3_run, 1)
    assert sorted(d["site"] for d in info["deltas"]) == sites
    # generation 1 is in the store, and what a site downloads is what the coordinator wrote
    assert "models/global-000001.safetensors" in objects(weed, s3_run)
    got = s3_run.client("lumi").download_model(1, tmp_path / "g1.safetensors")
    local = s3_run.state_dir / "models" / "global-000001.safetensors"
    assert got.read_bytes() == local.read_bytes()
    assert digest_file(got) == s3_run.client().status()["model"]["digest"]
    # the coordinator serves no weight bytes itself: a client expecting the file store is
    # told so, and follows (global_model above used one)
    refused = s3_run.client("lumi").http.get("/v1/models/1")
    assert refused.status_code == 409 and refused.json()["error"] == "wrong_backend"
    # the merged deltas' objects are gone (retention), as their files are with the file store
    assert not [name for name in objects(weed, s3_run) if name.startswith("blobs/")]


def test_another_sites_object_is_refused(
    s3_run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    path = big_file(tmp_path / "blob", 1 * MiB)
    key = s3_run.client("lumi").upload_blob(path)
    other = s3_run.client("snellius")
    for method, url, body in [
        ("POST", f"/v1/blobs/{key}/uploads", {"bytes": 1 * MiB}),
        ("POST", f"/v1/blobs/{key}/uploads/x/complete", {"bytes": 1 * MiB}),
        ("GET", f"/v1/blobs/{key}/url", None),
    ]:
        answer = other.http.request(method, url, json=body)
        assert answer.status_code == 403, (url, answer.text)
        assert answer.json()["error"] == "forbidden" and "another site" in answer.json()["detail"]
    # the owner reads its own object; another site cannot submit it as its delta
    assert s3_run.client("lumi").download_blob(key, tmp_path / "back").read_bytes() == (
        path.read_bytes()
    )
    lease = join_and_lease(s3_run, "snellius", tiny_data)
    with pytest.raises(Refused) as refused:
        other.post("/v1/rounds/1/deltas", {**fields("snellius", lease), "blob": key})
    assert refused.value.code in ("unknown_blob", "forbidden")
    assert s3_run.client().round_info(1)["deltas"] == []


def test_bytes_that_do_not_hash_to_their_key_are_refused_and_deleted(
    s3_run: LiveCoordinator, weed: SeaweedFS, tiny_data: Path, tmp_path: Path
) -> None:
    reference = global_model(s3_run, 0, tmp_path)
    good = delta_file(tmp_path, reference, seed=0, name="good")
    bad = delta_file(tmp_path, reference, seed=1, name="bad")
    key = digest_file(good)
    site = s3_run.client("lumi")
    answer = upload_under(site, key, bad)
    assert answer.status_code == 422 and answer.json()["error"] == "digest_mismatch"
    assert "hashes to" in answer.json()["detail"]
    assert not [n for n in objects(weed, s3_run) if n.startswith("blobs/")]  # deleted
    lease = join_and_lease(s3_run, "lumi", tiny_data)
    with pytest.raises(Refused) as refused:
        site.post("/v1/rounds/1/deltas", {**fields("lumi", lease), "blob": key})
    assert refused.value.code == "unknown_blob"
    # the right bytes then go through, and nothing refused was kept
    reply = site.submit_delta(1, good, inline=False, fresh=True, **fields("lumi", lease))
    assert reply["accepted"]


def test_a_missing_part_is_named_and_the_upload_finishes_once_it_is_sent(
    s3_run: LiveCoordinator, tmp_path: Path
) -> None:
    path = big_file(tmp_path / "blob")
    key = digest_file(path)
    site = s3_run.client("lumi")
    plan = site.post(f"/v1/blobs/{key}/uploads", {"bytes": path.stat().st_size})
    assert [p["number"] for p in plan["parts"]] == [1, 2, 3]
    data = path.read_bytes()
    for part in (plan["parts"][0], plan["parts"][2]):
        body = data[part["offset"] : part["offset"] + part["bytes"]]
        assert httpx.put(part["url"], content=body).status_code == 200
    complete = f"/v1/blobs/{key}/uploads/{plan['upload_id']}/complete"
    answer = site.http.post(complete, json={"bytes": len(data)})
    assert answer.status_code == 409 and answer.json()["error"] == "missing_part"
    assert answer.json()["missing"] == [2]
    with pytest.raises(Refused):  # not stored: no URL to read it
        site.get(f"/v1/blobs/{key}/url")
    # the client finishes it (a new upload: the refused one stays open until retention)
    assert site.upload_blob(path, key) == key
    assert site.download_blob(key, tmp_path / "back").read_bytes() == data


def test_an_expired_url_is_refused_by_the_store_and_the_client_asks_again(
    weed: SeaweedFS, tmp_path: Path, tiny_data: Path
) -> None:
    live = s3_coordinator(weed, tmp_path / "coordinator", url_expiry_s=3)
    try:
        path = big_file(tmp_path / "blob", 1 * MiB)
        key = digest_file(path)
        site = live.client("lumi")
        plan = site.post(f"/v1/blobs/{key}/uploads", {"bytes": path.stat().st_size})
        time.sleep(4.5)
        answer = httpx.put(plan["parts"][0]["url"], content=path.read_bytes())
        assert answer.status_code == 403, answer.text
        # fresh URLs for the same upload go through
        fresh = site.post(
            f"/v1/blobs/{key}/uploads",
            {"bytes": path.stat().st_size, "upload_id": plan["upload_id"]},
        )
        assert fresh["upload_id"] == plan["upload_id"]
        assert httpx.put(fresh["parts"][0]["url"], content=path.read_bytes()).status_code == 200
        done = site.post(
            f"/v1/blobs/{key}/uploads/{plan['upload_id']}/complete",
            {"bytes": path.stat().st_size},
        )
        assert done["complete"] and done["bytes"] == path.stat().st_size
    finally:
        stop(live.process)


def test_a_replayed_part_url_changes_nothing(s3_run: LiveCoordinator, tmp_path: Path) -> None:
    """Once the coordinator completed an upload, its part URLs lead nowhere: a replay with
    other bytes is refused by the store and the object keeps the bytes that were checked."""
    path = big_file(tmp_path / "blob", 1 * MiB)
    key = digest_file(path)
    site = s3_run.client("lumi")
    plan = site.post(f"/v1/blobs/{key}/uploads", {"bytes": path.stat().st_size})
    url = plan["parts"][0]["url"]
    assert httpx.put(url, content=path.read_bytes()).status_code == 200
    site.post(f"/v1/blobs/{key}/uploads/{plan['upload_id']}/complete", {"bytes": 1 * MiB})
    replay = httpx.put(url, content=b"x" * MiB)
    assert replay.status_code == 404 and "NoSuchUpload" in replay.text
    # completing again is answered complete; asking for an upload again gets no URLs
    again = site.post(f"/v1/blobs/{key}/uploads/{plan['upload_id']}/complete", {"bytes": MiB})
    assert again["complete"]
    assert site.post(f"/v1/blobs/{key}/uploads", {"bytes": MiB}) == {
        "key": key,
        "complete": True,
        "bytes": MiB,
    }
    assert site.download_blob(key, tmp_path / "back").read_bytes() == path.read_bytes()


def test_the_store_going_down_mid_upload_loses_nothing(
    s3_run: LiveCoordinator, weed: SeaweedFS, tiny_data: Path, tmp_path: Path
) -> None:
    """A part stored before the store went down is still there after it comes back; a site
    whose upload starts while it is down gets through once it is back; an accepted delta
    is merged after it."""
    reference = global_model(s3_run, 0, tmp_path)
    lease = join_and_lease(s3_run, "lumi", tiny_data)
    # snellius leases now: its lease keeps round 1 open after lumi's commit (leased after
    # it, a loaded machine could see the round close first, merged without snellius)
    snellius_lease = join_and_lease(s3_run, "snellius", tiny_data)
    accepted = delta_file(tmp_path, reference, seed=0, name="lumi")
    lumi = s3_run.client("lumi")
    assert lumi.submit_delta(1, accepted, inline=False, fresh=True, **fields("lumi", lease))[
        "accepted"
    ]
    path = big_file(tmp_path / "blob")
    key = digest_file(path)
    plan = lumi.post(f"/v1/blobs/{key}/uploads", {"bytes": path.stat().st_size})
    data = path.read_bytes()
    first = plan["parts"][0]
    assert httpx.put(first["url"], content=data[: first["bytes"]]).status_code == 200
    weed.stop()
    with pytest.raises(httpx.TransportError):
        httpx.put(plan["parts"][1]["url"], content=data[: plan["parts"][1]["bytes"]])
    late = delta_file(tmp_path, reference, seed=1, name="snellius")
    results: dict[str, object] = {}

    def send() -> None:
        client = s3_run.client("snellius", retry_budget_s=180)
        try:
            results["reply"] = client.submit_delta(
                1, late, inline=False, fresh=True, **fields("snellius", snellius_lease)
            )
        except Exception as exc:  # reported below
            results["error"] = exc

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(1.0)
    weed.start()
    sender.join(timeout=240)
    assert "error" not in results, results
    assert results["reply"]["accepted"]  # type: ignore[index]
    # the part stored before the outage is still there: only the others are missing
    answer = lumi.http.post(
        f"/v1/blobs/{key}/uploads/{plan['upload_id']}/complete", json={"bytes": len(data)}
    )
    assert answer.status_code == 409 and answer.json()["missing"] == [2, 3]
    for part in plan["parts"][1:]:
        body = data[part["offset"] : part["offset"] + part["bytes"]]
        assert httpx.put(part["url"], content=body).status_code == 200
    assert lumi.post(f"/v1/blobs/{key}/uploads/{plan['upload_id']}/complete", {"bytes": len(data)})[
        "complete"
    ]
    info = wait_round_closed(s3_run, 1, timeout_s=60)
    assert sorted(d["site"] for d in info["deltas"]) == ["lumi", "snellius"]


def test_a_misconfigured_store_is_named_at_start(weed: SeaweedFS, tmp_path: Path) -> None:
    secrets = tmp_path / "secrets.yaml"
    ensure_secrets(secrets, SITES)
    cases = {
        "bucket": ({"backend": "s3", "s3": {"endpoint": weed.endpoint}}, weed.env()),
        "credentials": (weed.blobs_config(), {}),
        "does not exist": (
            {"backend": "s3", "s3": {"endpoint": weed.endpoint, "bucket": "nope"}},
            weed.env(),
        ),
    }
    for expected, (blobs, env) in cases.items():
        config = tmp_path / "blobs.yaml"
        config.write_text(yaml.safe_dump({"blobs": blobs}))
        done = subprocess.run(
            [sys.executable, "-m", "crossfed", "coordinator", "serve", "--state-dir",
             str(tmp_path / "state"), "--secrets", str(secrets), "--port", "0",
             "--blobs", str(config)],
            capture_output=True, text=True, timeout=120,
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env},
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert expected in done.stderr, done.stderr


def test_a_store_out_of_reach_is_a_503_never_a_bad_delta() -> None:
    """Reads the coordinator makes of an object (the delta check, the merge) fail as the
    store being away (503, retried by the site), never as a delta refused (422, dropped)."""
    port = free_port("127.0.0.1")
    store = ObjectStore(
        S3Settings(bucket="b", access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                   endpoint=f"http://127.0.0.1:{port}")
    )  # fmt: skip
    with pytest.raises(ObjectStoreError) as opening:
        ObjectTensorFile(store, "blobs/lumi/blake3/00")
    with pytest.raises(ObjectStoreError) as reading:
        store.read_range("blobs/lumi/blake3/00", 0, memoryview(bytearray(8)))
    for refused in (opening.value, reading.value):
        assert refused.status == 503 and refused.code == "store_unavailable"


def test_a_delta_with_a_non_finite_value_is_refused_at_submission(
    s3_run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """Its object hashes to its key, so the upload completes; the check made in the same
    pass does not vouch for it, and the submission's full check refuses it."""
    reference = global_model(s3_run, 0, tmp_path)
    poisoned = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in reference.items()}
    name = next(iter(poisoned))
    poisoned[name].view(-1)[0] = float("nan")
    path = tmp_path / "nan.safetensors"
    save_file(poisoned, str(path))
    lease = join_and_lease(s3_run, "lumi", tiny_data)
    site = s3_run.client("lumi", blobs="s3")
    with pytest.raises(Refused) as refused:
        site.submit_delta(1, path, inline=False, fresh=True, **fields("lumi", lease))
    assert refused.value.status == 422 and refused.value.code == "bad_delta"
    assert "non-finite" in refused.value.detail
    assert s3_run.client().round_info(1)["deltas"] == []


def model_store(weed: SeaweedFS, prefix: str) -> ObjectStore:
    """The coordinator's view of ``weed`` under ``prefix``, with S3's smallest parts."""
    return ObjectStore(
        S3Settings(bucket=weed.bucket, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                   endpoint=weed.endpoint, region=REGION, prefix=prefix, part_bytes=PART)
    )  # fmt: skip


def model_tensors(count: int = 6) -> dict[str, torch.Tensor]:
    """Tensors of 2 MiB each in bf16: a 12 MiB model file goes up in three parts."""
    gen = torch.Generator().manual_seed(0)
    return {f"layer.{i}": torch.randn(1024, 1024, generator=gen) for i in range(count)}


def open_uploads(weed: SeaweedFS, key: str) -> list[str]:
    listing = bucket(weed).list_multipart_uploads(Bucket=weed.bucket, Prefix=key)
    return [u["UploadId"] for u in listing.get("Uploads", [])]


def test_a_global_model_goes_up_in_parts_while_the_merge_writes_it(
    weed: SeaweedFS, tmp_path: Path
) -> None:
    """The merge's global model is uploaded part by part as the file grows: the first part
    is stored while the last tensors are still to be written, and the object is the file."""
    shapes = {k: tuple(v.shape) for k, v in model_tensors().items()}
    values = model_tensors()
    store = model_store(weed, "stream/")
    blobs = ObjectBlobs(store, state_db.connect(tmp_path / "state.db"), threading.RLock())
    size = model_file_bytes(shapes, 1)
    upload = ModelUpload(store, blobs.model_name(1), size)
    assert len(upload.layout) == 3  # 12 MiB and a header, in parts of 5 MiB
    while_writing: list[tuple[bool, int]] = []

    def fill(emit):  # noqa: ANN001, ANN202
        for i, (name, value) in enumerate(values.items()):
            written = emit(name, value, None)
            if i == len(values) - 2:  # five of six tensors written: 10 MiB and the header
                written.wait(timeout=30)
                upload.sent[0].result(timeout=30)
                while_writing.append((upload.sent[0].done(), len(upload.sent)))

    digest, _, _ = write_generation(
        tmp_path / "master-1", tmp_path / "global-1", shapes, 1, fill, momentum=False,
        model_progress=upload.written,
    )  # fmt: skip
    # the first part is stored and the second on its way before the last tensor is written;
    # the third, the file's tail, only once it is
    assert while_writing == [(True, 2)]
    upload.finish()
    assert (tmp_path / "global-1").stat().st_size == size
    body = bucket(weed).get_object(Bucket=weed.bucket, Key=blobs.model_name(1))["Body"].read()
    assert body == (tmp_path / "global-1").read_bytes()
    assert open_uploads(weed, blobs.model_name(1)) == []
    assert store.moved["written"] == size


def test_a_merge_that_fails_leaves_no_model_object_and_no_open_upload(
    weed: SeaweedFS, tmp_path: Path
) -> None:
    """A merge that fails after the first part went up aborts the model's upload: no
    object, no open upload; one left open by a merge that was killed is reaped by retention
    once it is older than the grace."""
    shapes = {k: tuple(v.shape) for k, v in model_tensors().items()}
    values = model_tensors()
    store = model_store(weed, "failed/")
    blobs = ObjectBlobs(store, state_db.connect(tmp_path / "state.db"), threading.RLock())
    upload = ModelUpload(store, blobs.model_name(1), model_file_bytes(shapes, 1))

    def fill(emit):  # noqa: ANN001, ANN202
        for i, (name, value) in enumerate(values.items()):
            emit(name, value, None).wait(timeout=30)
            if i == 3:
                upload.sent[0].result(timeout=30)
                raise OSError("a delta is unreadable")

    with pytest.raises(OSError, match="unreadable"):
        try:
            write_generation(
                tmp_path / "master-1", tmp_path / "global-1", shapes, 1, fill, momentum=False,
                model_progress=upload.written,
            )  # fmt: skip
        except BaseException:
            upload.abort()
            raise
    assert open_uploads(weed, blobs.model_name(1)) == []
    assert store.size(blobs.model_name(1)) is None
    assert not (tmp_path / "global-1").exists()
    # a killed merge's upload stays open until retention reaps it
    killed = ModelUpload(store, blobs.model_name(2), model_file_bytes(shapes, 2))
    assert open_uploads(weed, blobs.model_name(2)) == [killed.upload_id]
    blobs.prune([], [], models_before=0, grace_s=3600)
    assert open_uploads(weed, blobs.model_name(2)) == [killed.upload_id]
    blobs.prune([], [], models_before=0, grace_s=-60)
    assert open_uploads(weed, blobs.model_name(2)) == []


def test_an_object_is_read_back_for_its_digest_in_ranges_side_by_side(
    weed: SeaweedFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 23 MiB object read back in 5 MiB ranges: the first four are in flight at once (each
    waits until all four have started), the digest is the file's, the check made in the same
    pass sees every byte in order, and the bytes are counted once."""
    monkeypatch.setattr(objectstore, "STRIPE_BYTES", 5 * MiB)
    store = model_store(weed, "digest/")
    path = big_file(tmp_path / "blob", size=23 * MiB + 7)
    bucket(weed).upload_file(str(path), weed.bucket, "digest/blob")
    together = threading.Barrier(store.transfer.max_concurrency, timeout=10)
    fetch, started = store._fetch, []

    def gated(name: str, offset: int, view: memoryview) -> int:
        started.append(offset)
        if len(started) <= store.transfer.max_concurrency:
            together.wait()
        return fetch(name, offset, view)

    monkeypatch.setattr(store, "_fetch", gated)
    seen = bytearray()
    digest, size = store.digest("digest/blob", "blake3", seen.extend)
    assert (digest, size) == (digest_file(path), path.stat().st_size)
    assert bytes(seen) == path.read_bytes()
    assert sorted(started) == list(range(0, size, 5 * MiB))
    assert store.moved["read"] == size


def store_calls(store: ObjectStore) -> list[str]:
    """The S3 operations ``store`` sends from now on, in order (boto3's own event hook)."""
    calls: list[str] = []
    store.client.meta.events.register("before-call.s3", lambda model, **_: calls.append(model.name))
    return calls


def test_an_object_a_merge_opens_costs_one_get(
    weed: SeaweedFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a delta's object reads its header and size in one GET (a HEAD and two GETs
    before: three round trips a delta, before the merge starts); a header longer than that
    first read costs one GET more; tensors read as from the file; a missing object is named,
    an empty one is too short."""
    store = model_store(weed, "open/")
    values = {k: v.to(torch.bfloat16) for k, v in model_tensors(3).items()}
    path = tmp_path / "delta.safetensors"
    save_file(values, str(path))
    bucket(weed).upload_file(str(path), weed.bucket, "open/delta")
    calls = store_calls(store)
    handle = ObjectTensorFile(store, "open/delta")
    assert calls == ["GetObject"]
    assert handle.keys() == list(values)
    assert all(torch.equal(handle.get_tensor(k), v) for k, v in values.items())
    monkeypatch.setattr(objectstore, "HEAD_BYTES", 16)  # the header's length, not the header
    calls.clear()
    again = ObjectTensorFile(store, "open/delta")
    assert calls == ["GetObject", "GetObject"] and again.keys() == list(values)
    with pytest.raises(FileNotFoundError, match="no object open/none"):
        ObjectTensorFile(store, "open/none")
    bucket(weed).put_object(Bucket=weed.bucket, Key="open/empty", Body=b"")
    with pytest.raises(ValueError, match="0 bytes, too short"):
        ObjectTensorFile(store, "open/empty")


def test_a_rounds_deltas_are_opened_side_by_side(weed: SeaweedFS, tmp_path: Path) -> None:
    """The merge opens its three deltas' objects at once (each opening waits until all three
    have begun), in order; one that fails is raised by name."""
    store = model_store(weed, "many/")
    blobs = ObjectBlobs(store, state_db.connect(tmp_path / "state.db"), threading.RLock())
    refs = []
    for i, site in enumerate(SITES):
        values = {f"w.{j}": torch.full((4, 4), float(i + j)) for j in range(2)}
        path = tmp_path / f"{site}.safetensors"
        save_file(values, str(path))
        key = digest_file(path)
        bucket(weed).upload_file(str(path), weed.bucket, blobs.blob_name(key, site))
        refs.append((key, site))
    together = threading.Barrier(len(refs), timeout=10)
    read_head = store.read_head

    def gated(name: str, length: int) -> tuple[bytes, int]:
        together.wait()  # broken (an error) unless the three are opened at once
        return read_head(name, length)

    store.read_head = gated  # type: ignore[method-assign]
    names = [blobs.blob_name(k, s) for k, s in refs]
    opened = LocalMerger(tmp_path / "models", store)._open(names)
    assert [h.name for h in opened] == names  # type: ignore[union-attr]
    assert [float(h.get_tensor("w.0")[0, 0]) for h in opened] == [0.0, 1.0, 2.0]  # type: ignore[union-attr]
    store.read_head = read_head  # type: ignore[method-assign]
    missing = blobs.blob_name(refs[0][0], "nobody")
    with pytest.raises(FileNotFoundError, match="blobs/nobody/"):
        open_objects(store, [names[0], missing])


def test_completing_an_upload_asks_the_store_no_more_than_it_must(
    weed: SeaweedFS, tmp_path: Path
) -> None:
    """A site's upload is joined and checked with one ListParts, the completion and the
    ranged reads of the check: the parts' listing is not asked twice and the joined object's
    size (the checked parts' sum) not asked at all, two round trips fewer on a site's
    commit path (70 ms each from LUMI-O). The object is kept, with its size."""
    store = model_store(weed, "complete/")
    blobs = ObjectBlobs(store, state_db.connect(tmp_path / "state.db"), threading.RLock())
    path = big_file(tmp_path / "blob")
    key, data = digest_file(path), path.read_bytes()
    plan = blobs.begin(key, "lumi", len(data))
    for part in plan["parts"]:
        body = data[part["offset"] : part["offset"] + part["bytes"]]
        assert httpx.put(part["url"], content=body).status_code == 200
    calls = store_calls(store)
    assert blobs.complete(key, "lumi", plan["upload_id"], len(data))["bytes"] == len(data)
    reads = -(-len(data) // objectstore.STRIPE_BYTES)
    assert calls == ["ListParts", "CompleteMultipartUpload"] + ["GetObject"] * reads
    assert blobs.stored(key) == {"lumi": len(data)}
