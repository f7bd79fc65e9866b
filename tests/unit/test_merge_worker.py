"""The merge worker (``crossfed coordinator worker``, ``blobs.s3.merge_worker``) beside a real
SeaweedFS, with a real coordinator process: the coordinator stays the authority, and no delta
or model byte passes through its process."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from crossfed.coordinator.embedded import (
    ServeCommand,
    ensure_secrets,
    free_port,
    spawn_coordinator,
    spawn_worker,
)
from crossfed.coordinator.merger import LocalMerger, RemoteMerger, WorkerError
from crossfed.coordinator.runspec import RunSpec
from crossfed.outer_presets import OuterConfig
from crossfed.wire.digests import digest_file
from tests.conftest import LiveCoordinator, stop, tiny_spec
from tests.helpers.seaweedfs import ACCESS_KEY, SECRET_KEY, SeaweedFS
from tests.unit.test_coordinator_http import (
    delta_file,
    global_model,
    join_and_lease,
    wait_round_closed,
)
from tests.unit.test_objectstore import PART, bucket, fields, upload_under

SITES = ["lumi", "snellius"]


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path_factory.mktemp("weed")).start()
    yield server
    server.stop()


class WorkerRun:
    """A coordinator that hands its store work to a merge worker, both real processes."""

    def __init__(self, weed: SeaweedFS, root: Path) -> None:
        self.root = root
        state = root / "coordinator"
        state.mkdir(parents=True)
        self.secrets_path = state / "secrets.yaml"
        secrets = ensure_secrets(self.secrets_path, ["lumi", "snellius", "frontier"])
        secrets["s3"] = {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY}
        self.secrets_path.write_text(yaml.safe_dump(secrets))
        blobs = weed.blobs_config(prefix=f"{root.name}/")
        blobs["s3"]["part_bytes"] = PART
        self.blobs = state / "blobs.yaml"
        self.blobs.write_text(yaml.safe_dump({"blobs": blobs}))
        self.worker_dir = root / "worker"
        self.worker, self.worker_url = spawn_worker(
            self.worker_dir, self.secrets_path, self.blobs, "127.0.0.1"
        )
        port = free_port("127.0.0.1")
        command = ServeCommand(state, self.secrets_path, "127.0.0.1", port, blobs=self.blobs,
                               merge_worker=self.worker_url)  # fmt: skip
        proc = spawn_coordinator(command, 240)
        self.live = LiveCoordinator(f"http://127.0.0.1:{port}", state, secrets, proc, port)

    def restart_worker(self) -> None:
        """The worker again, on its port and its state dir (the coordinator knows its URL)."""
        port = int(self.worker_url.rsplit(":", 1)[1])
        self.worker, _ = spawn_worker(
            self.worker_dir, self.secrets_path, self.blobs, "127.0.0.1", port=port
        )

    def close(self) -> None:
        stop(self.live.process)
        stop(self.worker)


@pytest.fixture
def worker_run(weed: SeaweedFS, tmp_path: Path, tiny_data: Path) -> Iterator[WorkerRun]:
    run = WorkerRun(weed, tmp_path / f"w{free_port('127.0.0.1')}")
    run.live.client().init_run(tiny_spec(tiny_data).to_dict())
    yield run
    run.close()


def moved(live: LiveCoordinator) -> tuple[int, int]:
    counts = live.client().http.get("/v1/admin/http").json()
    return counts["store_bytes_read"], counts["store_bytes_written"]


def submit_round(
    live: LiveCoordinator, reference: dict, data: Path, tmp_path: Path
) -> dict[str, Path]:
    """Every site of :data:`SITES` leases in round 1, then each submits a delta (all leases
    first: the round closes once every lease is in, never between two sites)."""
    leases = {site: join_and_lease(live, site, data) for site in SITES}
    deltas = {}
    for i, site in enumerate(SITES):
        deltas[site] = delta_file(tmp_path, reference, seed=i, name=site)
        reply = live.client(site, streams=2, blobs="s3").submit_delta(
            1, deltas[site], inline=True, fresh=True, **fields(site, leases[site])
        )
        assert reply["accepted"]
    return deltas


def merged_here(run: WorkerRun, info: dict, deltas: dict[str, Path], tmp_path: Path) -> str:
    """The digest of generation 1 as this process's own merge makes it from round 1's
    deltas (``info``: the closed round) and the worker's generation 0."""
    with sqlite3.connect(run.live.state_dir / "state.sqlite") as conn:
        (spec_json,) = conn.execute("SELECT value FROM meta WHERE key = 'spec'").fetchone()
    here = LocalMerger(tmp_path / "here")
    shutil.copy(run.worker_dir / "models" / "master-000000.safetensors", here.models_dir)
    order = [d["site"] for d in info["deltas"]]
    written = here.merge(
        0, here.shapes(0), [deltas[s] for s in order], [d["tokens"] for d in info["deltas"]],
        RunSpec.from_dict(yaml.safe_load(spec_json)).outer, shared_moments=False, sites=order,
    )  # fmt: skip
    return written.digest


def test_a_round_moves_no_delta_or_model_byte_through_the_coordinator(
    worker_run: WorkerRun, weed: SeaweedFS, tiny_data: Path, tmp_path: Path
) -> None:
    """Two sites' deltas go up, the worker reads them back, merges them into generation 1
    and writes its global model to the store; the coordinator's process reads and writes
    no byte of the store, keeps no model on its disk, and the worker's generation is the
    one the coordinator's own merge makes from the same deltas, byte for byte."""
    live = worker_run.live
    reference = global_model(live, 0, tmp_path)
    deltas = submit_round(live, reference, tiny_data, tmp_path)
    info = wait_round_closed(live, 1)
    assert sorted(d["site"] for d in info["deltas"]) == SITES
    assert moved(live) == (0, 0)
    assert not list((live.state_dir / "models").glob("*.safetensors"))
    traffic = httpx.get(
        f"{worker_run.worker_url}/v1/traffic",
        headers={"Authorization": f"Bearer {live.secrets['admin']}"},
    ).json()
    delta_bytes = sum(path.stat().st_size for path in deltas.values())
    assert traffic["store_bytes_read"] >= 2 * delta_bytes  # the check, then the merge
    assert traffic["store_bytes_written"] > 0  # generations 0 and 1
    # what a site downloads is what the worker wrote, and what an in-process merge writes
    got = live.client("lumi").download_model(1, tmp_path / "g1.safetensors")
    assert digest_file(got) == live.client().status()["model"]["digest"]
    worker_model = worker_run.worker_dir / "models" / "global-000001.safetensors"
    assert got.read_bytes() == worker_model.read_bytes()
    assert merged_here(worker_run, info, deltas, tmp_path) == digest_file(got)
    # a later round still goes through the worker, from the master on its disk
    assert (worker_run.worker_dir / "models" / "master-000001.safetensors").exists()


def test_the_worker_refuses_bytes_that_do_not_hash_to_their_key(
    worker_run: WorkerRun, tmp_path: Path
) -> None:
    """The worker's read-back finds the mismatch: 422 ``digest_mismatch``, as in-process."""
    live = worker_run.live
    reference = global_model(live, 0, tmp_path)
    good = delta_file(tmp_path, reference, seed=0, name="good")
    bad = delta_file(tmp_path, reference, seed=1, name="bad")
    answer = upload_under(live.client("lumi"), digest_file(good), bad)
    assert answer.status_code == 422 and answer.json()["error"] == "digest_mismatch"
    assert "hashes to" in answer.json()["detail"]


def test_a_worker_that_is_down_is_a_503_and_nothing_is_lost(
    worker_run: WorkerRun, tiny_data: Path, tmp_path: Path
) -> None:
    """With the worker down, completing an upload is 503 ``worker_unavailable`` (the
    stored part stays); once it is back, the same upload completes and its delta is
    accepted."""
    live = worker_run.live
    lease = join_and_lease(live, "lumi", tiny_data)
    path = delta_file(tmp_path, global_model(live, 0, tmp_path), name="lumi")
    key = digest_file(path)
    site = live.client("lumi")
    plan = site.post(f"/v1/blobs/{key}/uploads", {"bytes": path.stat().st_size})
    (part,) = plan["parts"]
    assert httpx.put(part["url"], content=path.read_bytes()).status_code == 200
    worker_run.worker.kill()
    worker_run.worker.wait(timeout=10)
    complete = f"/v1/blobs/{key}/uploads/{plan['upload_id']}/complete"
    answer = site.http.post(complete, json={"bytes": path.stat().st_size}, timeout=120)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"] == "worker_unavailable", answer.text
    assert "merge worker" in answer.json()["detail"]
    worker_run.restart_worker()
    answer = site.http.post(complete, json={"bytes": path.stat().st_size}, timeout=120)
    assert answer.status_code == 200, answer.text
    reply = site.post("/v1/rounds/1/deltas", {**fields("lumi", lease), "blob": key})
    assert reply["accepted"]


def test_a_worker_killed_mid_merge_loses_nothing(
    worker_run: WorkerRun,
    tiny_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker SIGKILLed halfway through writing generation 1: the round stays open (the
    coordinator retries its close), and once the worker is back it merges the same deltas
    into the same generation the uninterrupted merge makes."""
    live = worker_run.live
    reference = global_model(live, 0, tmp_path)
    stop(worker_run.worker)
    monkeypatch.setenv("CROSSFED_CRASH_AT", "inside_generation_write")
    monkeypatch.setenv("CROSSFED_CRASH_ONCE", str(tmp_path / "crashed"))
    worker_run.restart_worker()
    monkeypatch.delenv("CROSSFED_CRASH_AT")
    deltas = submit_round(live, reference, tiny_data, tmp_path)
    assert worker_run.worker.wait(timeout=60) == -9  # it died at the crash point
    assert live.client().round_info(1)["status"] == "open"
    worker_run.restart_worker()  # the crash happened once: this one runs through
    info = wait_round_closed(live, 1, timeout_s=120)
    got = live.client("lumi").download_model(1, tmp_path / "g1.safetensors")
    assert merged_here(worker_run, info, deltas, tmp_path) == digest_file(got)
    assert not list((worker_run.worker_dir / "models").glob(".*.tmp"))  # retention's


def test_the_same_merge_asked_again_is_answered_from_the_first(
    worker_run: WorkerRun, weed: SeaweedFS, tmp_path: Path
) -> None:
    """A coordinator that asks for a merge again (it restarted, or timed out, while the
    worker merged) gets the first merge's result, even once the deltas are gone; a merge
    asked with anything different is merged anew."""
    live = worker_run.live
    path = delta_file(tmp_path, global_model(live, 0, tmp_path), name="lumi")
    name = f"{worker_run.root.name}/by-hand/delta.safetensors"
    store = bucket(weed)
    store.upload_file(str(path), weed.bucket, name)
    merger = RemoteMerger(worker_run.worker_url, live.secrets["admin"])
    shapes = merger.shapes(0)
    ask = dict(shared_moments=False, sites=["lumi"])
    first = merger.merge(0, shapes, [name], [32], OuterConfig(preset="average"), **ask)
    store.delete_object(Bucket=weed.bucket, Key=name)
    again = merger.merge(0, shapes, [name], [32], OuterConfig(preset="average"), **ask)
    assert again == first
    with pytest.raises(WorkerError) as other:  # other tokens: merged anew, and the delta is gone
        merger.merge(0, shapes, [name], [64], OuterConfig(preset="average"), **ask)
    assert (other.value.status, other.value.code) == (404, "not_found")
    assert name in str(other.value)
    merger.close()


def test_only_the_coordinator_may_call_the_worker(worker_run: WorkerRun) -> None:
    url = worker_run.worker_url
    assert httpx.get(f"{url}/v1/health").json()["role"] == "merge_worker"
    for token in (None, worker_run.live.secrets["sites"]["lumi"]):
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        answer = httpx.post(f"{url}/v1/retain", headers=headers, json={
            "oldest_master": 99, "oldest_global": 99, "keep_start": False,
        })  # fmt: skip
        assert answer.status_code == 401, answer.text
    assert (worker_run.worker_dir / "models" / "master-000000.safetensors").exists()


def test_a_coordinator_without_its_worker_says_so_at_start(
    worker_run: WorkerRun, tmp_path: Path
) -> None:
    """``serve`` with a worker that does not answer, or ``embedded`` on a VM, stops at start
    with a message naming the problem (exit 2), as a missing bucket does."""
    state = tmp_path / "other"
    state.mkdir()
    base = [sys.executable, "-m", "crossfed", "coordinator", "serve", "--state-dir", str(state),
            "--secrets", str(worker_run.secrets_path), "--blobs", str(worker_run.blobs),
            "--port", str(free_port("127.0.0.1"))]  # fmt: skip
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    proc = subprocess.run(
        [*base, "--merge-worker", dead], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert f"the merge worker at {dead} did not answer" in proc.stderr
    embedded = yaml.safe_load(worker_run.blobs.read_text())
    embedded["blobs"]["s3"]["merge_worker"] = "embedded"
    (state / "blobs.yaml").write_text(yaml.safe_dump(embedded))
    base[base.index(str(worker_run.blobs))] = str(state / "blobs.yaml")
    proc = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "merge_worker: embedded" in proc.stderr, proc.stderr


def test_a_run_that_began_without_a_worker_is_not_handed_to_one(
    worker_run: WorkerRun, tmp_path: Path
) -> None:
    """A worker that does not hold the run's master is named at start (exit 2), not found
    out by every merge failing."""
    stop(worker_run.live.process)
    empty, url = spawn_worker(
        tmp_path / "empty", worker_run.secrets_path, worker_run.blobs, "127.0.0.1"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "crossfed", "coordinator", "serve", "--state-dir",
             str(worker_run.live.state_dir), "--secrets", str(worker_run.secrets_path),
             "--blobs", str(worker_run.blobs), "--port", str(free_port("127.0.0.1")),
             "--merge-worker", url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        stop(empty)
    assert proc.returncode == 2, proc.stderr
    assert f"the merge worker at {url} does not hold this run's generation 0" in proc.stderr
