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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from crossfed.backoff import Backoff
from crossfed.client.reach import ENDPOINT, EndpointError
from crossfed.fileio import write_atomic

if TYPE_CHECKING:
    from crossfed.config import RunConfig

#: the run's ``blobs`` section, for an embedded coordinator that keeps them elsewhere
BLOBS = "blobs.yaml"


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


def spawn_coordinator(
    state_dir: Path,
    secrets_path: Path,
    host: str,
    port: int,
    timeout_s: float = 60.0,
    max_request_s: float | None = None,
    ledger_checkpoint_every: int | None = None,
    blobs: Path | None = None,
) -> subprocess.Popen:
    """Start ``crossfed coordinator serve`` in its own session and wait until it answers."""
    proc = launch_coordinator(
        state_dir, secrets_path, host, port, max_request_s, ledger_checkpoint_every, blobs
    )
    wait_until_serving(proc, state_dir, host, port, timeout_s)
    return proc


def launch_coordinator(
    state_dir: Path,
    secrets_path: Path,
    host: str,
    port: int,
    max_request_s: float | None = None,
    ledger_checkpoint_every: int | None = None,
    blobs: Path | None = None,
) -> subprocess.Popen:
    """Start ``crossfed coordinator serve`` in its own session; do not wait for it.
    ``blobs``: a YAML file with the run's ``blobs`` section (``--blobs``)."""
    cmd = [sys.executable, "-m", "crossfed", "coordinator", "serve"]
    cmd += ["--state-dir", str(state_dir), "--secrets", str(secrets_path)]
    cmd += ["--host", host, "--port", str(port)]
    if max_request_s is not None:
        cmd += ["--max-request-s", str(max_request_s)]
    if ledger_checkpoint_every is not None:
        cmd += ["--ledger-checkpoint-every", str(ledger_checkpoint_every)]
    if blobs is not None:
        cmd += ["--blobs", str(blobs)]
    with open(state_dir / "coordinator.log", "ab") as log:
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def wait_until_serving(
    proc: subprocess.Popen,
    state_dir: Path,
    host: str,
    port: int,
    timeout_s: float,
    scheme: str = "http",
    verify: ssl.SSLContext | bool = True,
) -> None:
    """Poll ``/v1/health`` until ``proc`` itself answers; kill it if it never does.

    An answer from another process (one that took ``port`` while ``proc`` was starting, e.g. a
    coordinator of a test running at the same time) is not taken for ``proc``'s: ``proc``
    then fails to bind and exits, which raises ``EndpointError``. With ``scheme="https"``
    the certificate must be trusted (``SSL_CERT_FILE``, or the context ``verify``).
    """
    log_path = state_dir / "coordinator.log"
    url = f"{scheme}://{host}:{port}"
    backoff = Backoff(0.2, 0.2, budget_s=timeout_s)
    while True:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise EndpointError(f"coordinator exited with {proc.returncode}; {log_path}:\n{tail}")
        try:
            answer = httpx.get(f"{url}/v1/health", timeout=2, verify=verify)
            if answer.status_code == 200 and answer.json().get("pid") == proc.pid:
                return
        except (httpx.TransportError, ValueError):
            pass
        if not backoff.wait():
            break
    proc.kill()
    raise EndpointError(f"coordinator did not answer on {url} within {timeout_s}s; see {log_path}")


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
    if config.blobs.backend != "file":
        blobs = state_dir / BLOBS
        write_atomic(blobs, yaml.safe_dump({"blobs": config.blobs.as_dict()}), mode=0o600)
    proc = spawn_coordinator(
        state_dir, secrets_path, host, port, timeout_s, max_request_s, blobs=blobs
    )
    url = f"http://{host}:{port}"
    (state_dir / ENDPOINT).write_text(json.dumps({"url": url, "pid": proc.pid}))
    return url


def stop_embedded(config: RunConfig, timeout_s: float = 20.0) -> bool:
    """Stop the embedded coordinator (SIGTERM, then SIGKILL); True if one was running."""
    endpoint = Path(config.coordinator.state_dir) / ENDPOINT
    if not endpoint.exists():
        return False
    pid = json.loads(endpoint.read_text()).get("pid")
    endpoint.unlink(missing_ok=True)
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
