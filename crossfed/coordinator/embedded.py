"""The embedded coordinator a workflow starts on loopback (started, waited for, stopped), and
the secrets file of per-site tokens. How a caller reaches a coordinator, embedded or remote,
is :mod:`crossfed.client.reach`."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import yaml

from crossfed.backoff import Backoff
from crossfed.client.reach import ENDPOINT, EndpointError
from crossfed.config.run import EMBEDDED_WORKER
from crossfed.fileio import write_atomic

if TYPE_CHECKING:
    from crossfed.config import RunConfig

#: the run's ``blobs`` section, for an embedded coordinator that keeps them elsewhere
BLOBS = "blobs.yaml"
#: where the merge worker beside an embedded coordinator keeps its state (``merge_worker:
#: embedded``), under the coordinator's state dir
WORKER_DIR = "worker"


def ensure_secrets(path: Path, sites: list[str]) -> dict[str, Any]:
    """Create (or extend) a secrets file with random tokens; mode 0600."""
    data: dict[str, Any] = yaml.safe_load(path.read_text()) if path.exists() else {}
    data = data or {}
    changed = False
    if "admin" not in data:
        data["admin"], changed = secrets.token_urlsafe(32), True
    data.setdefault("sites", {})
    for site in sites:
        if site not in data["sites"]:
            data["sites"][site], changed = secrets.token_urlsafe(32), True
    if changed:
        write_atomic(path, yaml.safe_dump(data), mode=0o600)
    return data


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class ServeCommand:
    """``crossfed coordinator serve`` over ``state_dir`` on ``host:port``, with its settings.
    ``blobs``: a YAML file with the run's ``blobs`` section (``--blobs``); ``merge_worker``:
    the URL of a merge worker (``--merge-worker``)."""

    state_dir: Path
    secrets: Path
    host: str
    port: int
    max_request_s: float | None = None
    ledger_checkpoint_every: int | None = None
    blobs: Path | None = None
    merge_worker: str | None = None

    @property
    def log_path(self) -> Path:
        """Where the coordinator's output goes."""
        return self.state_dir / "coordinator.log"

    def argv(self) -> list[str]:
        """The ``crossfed`` arguments that start it."""
        cmd = ["coordinator", "serve", "--state-dir", str(self.state_dir)]
        cmd += ["--secrets", str(self.secrets), "--host", self.host, "--port", str(self.port)]
        options = {
            "--max-request-s": self.max_request_s,
            "--ledger-checkpoint-every": self.ledger_checkpoint_every,
            "--blobs": self.blobs,
            "--merge-worker": self.merge_worker,
        }
        for flag, value in options.items():
            if value is not None:
                cmd += [flag, str(value)]
        return cmd

    def launch(self) -> subprocess.Popen:
        """Start it as ``python -m crossfed`` in its own session; do not wait for it."""
        return _launch([sys.executable, "-m", "crossfed", *self.argv()], self.log_path)


def spawn_coordinator(command: ServeCommand, timeout_s: float = 60.0) -> subprocess.Popen:
    """Start ``command`` in its own session and wait until it answers."""
    proc = command.launch()
    wait_until_serving(proc, command.state_dir, command.host, command.port, timeout_s)
    return proc


def spawn_worker(
    worker_dir: Path,
    secrets_path: Path,
    blobs: Path,
    host: str,
    timeout_s: float = 60.0,
    port: int | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start ``crossfed coordinator worker`` (state and log in ``worker_dir``) in its own
    session on ``port`` of ``host`` (default: a free one) and wait until it answers; the
    process and its URL."""
    worker_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "crossfed", "coordinator", "worker"]
    cmd += ["--state-dir", str(worker_dir), "--secrets", str(secrets_path)]
    cmd += ["--blobs", str(blobs), "--host", host, "--port", str(port)]
    proc = _launch(cmd, worker_dir / "worker.log")
    wait_until_serving(proc, worker_dir, host, port, timeout_s, role="worker")
    return proc, f"http://{host}:{port}"


def _launch(cmd: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


class ServerProcess(Protocol):
    """What :func:`wait_until_serving` uses of a started server (``subprocess.Popen`` has it)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...


def wait_until_serving(
    proc: ServerProcess,
    state_dir: Path,
    host: str,
    port: int,
    timeout_s: float,
    scheme: str = "http",
    verify: ssl.SSLContext | bool = True,
    role: str = "coordinator",
) -> None:
    """Poll ``/v1/health`` until ``proc`` itself answers; kill it if it never does.
    ``role``: what ``proc`` serves (its log is ``state_dir / f"{role}.log"``).

    An answer from another process (one that took ``port`` while ``proc`` was starting, e.g. a
    coordinator of a test running at the same time) is not taken for ``proc``'s: ``proc``
    then fails to bind and exits, which raises ``EndpointError``. With ``scheme="https"``
    the certificate must be trusted (``SSL_CERT_FILE``, or the context ``verify``).
    """
    log_path = state_dir / f"{role}.log"
    url = f"{scheme}://{host}:{port}"
    backoff = Backoff(0.2, 0.2, budget_s=timeout_s)
    while True:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise EndpointError(f"{role} exited with {proc.returncode}; {log_path}:\n{tail}")
        try:
            answer = httpx.get(f"{url}/v1/health", timeout=2, verify=verify)
            if answer.status_code == 200 and answer.json().get("pid") == proc.pid:
                return
        except (httpx.TransportError, ValueError):
            pass
        if not backoff.wait():
            break
    proc.kill()
    raise EndpointError(f"{role} did not answer on {url} within {timeout_s}s; see {log_path}")


def start_embedded(config: RunConfig, sites: list[str], timeout_s: float = 120.0) -> str:
    """Start the coordinator on loopback in the background (restarting a dead one); its URL."""
    coordinator = config.coordinator
    state_dir = Path(coordinator.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    stop_embedded(config)
    secrets_path = Path(coordinator.secrets)
    ensure_secrets(secrets_path, sites)
    host = coordinator.host
    port = coordinator.port or free_port(host)
    max_request_s = coordinator.max_request_s
    blobs = None
    worker: subprocess.Popen | None = None
    worker_url = None
    if config.blobs.backend != "file":
        blobs = state_dir / BLOBS
        write_atomic(blobs, yaml.safe_dump({"blobs": config.blobs.as_dict()}), mode=0o600)
        if config.blobs.s3.merge_worker == EMBEDDED_WORKER:
            worker, worker_url = spawn_worker(state_dir / WORKER_DIR, secrets_path, blobs, host)
    try:
        command = ServeCommand(
            state_dir, secrets_path, host, port, max_request_s, blobs=blobs, merge_worker=worker_url
        )
        proc = spawn_coordinator(command, timeout_s)
    except BaseException:
        if worker is not None:
            _stop(worker.pid, 20.0)
        raise
    url = f"http://{host}:{port}"
    endpoint = {"url": url, "pid": proc.pid}
    if worker is not None:
        endpoint["worker_pid"] = worker.pid
    (state_dir / ENDPOINT).write_text(json.dumps(endpoint))
    return url


def stop_embedded(config: RunConfig, timeout_s: float = 20.0) -> bool:
    """Stop the embedded coordinator (SIGTERM, then SIGKILL); True if one was running."""
    endpoint = Path(config.coordinator.state_dir) / ENDPOINT
    if not endpoint.exists():
        return False
    recorded = json.loads(endpoint.read_text())
    endpoint.unlink(missing_ok=True)
    stopped = _stop(recorded.get("pid"), timeout_s)
    _stop(recorded.get("worker_pid"), timeout_s)  # after the coordinator: it may be merging
    return stopped


def _stop(pid: int | None, timeout_s: float) -> bool:
    """SIGTERM ``pid``, then SIGKILL if it outlives ``timeout_s``; True if it was running."""
    if not pid or not _alive(pid):
        return False
    os.kill(pid, signal.SIGTERM)
    backoff = Backoff(0.1, 0.1, budget_s=timeout_s)
    while _alive(pid):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        if not backoff.wait():
            break
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    return True
