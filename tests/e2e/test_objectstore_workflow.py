"""The local workflow end to end with ``blobs.backend: s3``: three sites train two rounds
against the embedded coordinator, every delta and global model going through a real
SeaweedFS (presigned URLs), none through the coordinator's disk; with ``merge_worker:
embedded``, none through the coordinator's process either (a merge worker beside it reads
and writes them)."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest
import yaml

from tests.helpers.seaweedfs import ACCESS_KEY, REGION, SECRET_KEY, SeaweedFS
from tests.helpers.workflow import check_ledger, finish, snakemake, workdir

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("merge_worker", [None, "embedded"])
def test_the_local_workflow_keeps_its_blobs_in_the_object_store(
    tmp_path: Path, merge_worker: str | None
) -> None:
    with SeaweedFS(tmp_path / "weed") as weed:
        (tmp_path / "run").mkdir()
        cwd = workdir(tmp_path / "run", rounds=2)
        config_path = cwd / "config" / "config.yaml"
        config = yaml.safe_load(config_path.read_text())
        config["blobs"] = weed.blobs_config(prefix="e2e/")
        if merge_worker is not None:
            config["blobs"]["s3"]["merge_worker"] = merge_worker
        config_path.write_text(yaml.safe_dump(config))
        proc = snakemake(cwd, env=weed.env())
        finish(proc, timeout_s=1200)

        results = cwd / "results"
        check_ledger(results)
        for round_no in (1, 2):
            assert (results / "rounds" / str(round_no) / "eval.json").exists()
        s3 = boto3.client(
            "s3",
            endpoint_url=weed.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )
        listing = s3.list_objects_v2(Bucket=weed.bucket, Prefix="e2e/")
        names = {item["Key"] for item in listing.get("Contents", [])}
        assert "e2e/models/global-000002.safetensors" in names, names
        # the coordinator's own blob store never held a delta
        blobs = results / "coordinator" / "blobs"
        assert not [p for p in blobs.rglob("*") if p.is_file()]
        log = (results / "coordinator" / "coordinator.log").read_text()
        assert "Traceback" not in log, log[-4000:]
        models = results / "coordinator" / "models"
        worker = results / "coordinator" / "worker"
        if merge_worker is None:
            assert (models / "master-000002.safetensors").exists()
            assert not worker.exists()
        else:  # the worker holds the run's state; the coordinator no model byte
            assert not list(models.glob("*.safetensors"))
            assert (worker / "models" / "master-000002.safetensors").exists()
            worker_log = (worker / "worker.log").read_text()
            assert "Traceback" not in worker_log, worker_log[-4000:]
            # the workflow stopped its worker with its coordinator
            assert not [
                pid for pid in Path("/proc").iterdir() if pid.name.isdigit()
                and str(worker) in _cmdline(pid)
            ]  # fmt: skip


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
