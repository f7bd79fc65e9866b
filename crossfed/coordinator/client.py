"""HTTP client for the coordinator: short requests, retries with backoff, streamed weights."""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from crossfed.transport import CHUNK, fsync_dir, sha256_file

RETRY_STATUS = {502, 503, 504}


class Refused(Exception):
    """The coordinator refused a request (4xx); ``code`` is its stable error word."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


class Unreachable(Exception):
    """The coordinator did not answer within the retry budget."""


class CoordinatorClient:
    """One site's (or the admin's) view of the coordinator."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        retry_budget_s: float = 120.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.url = url.rstrip("/")
        self.retry_budget_s = retry_budget_s
        self.sleep = sleep
        self.http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
        )

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        deadline = time.monotonic() + self.retry_budget_s
        delay = 0.2
        factory = kwargs.pop("content_factory", None)
        while True:
            if factory is not None:
                kwargs["content"] = factory()
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                error: Exception = exc
            else:
                if response.status_code < 400:
                    return response
                if response.status_code not in RETRY_STATUS:
                    raise _refusal(response)
                error = _refusal(response)
            if time.monotonic() + delay > deadline:
                raise Unreachable(f"{method} {self.url}{path}: {error}") from error
            self.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)

    def get(self, path: str, **kwargs: Any) -> Any:
        return self._request("GET", path, **kwargs).json()

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Any:
        return self._request("POST", path, json=body, **kwargs).json()

    # --- protocol
    def health(self) -> dict[str, Any]:
        return self.get("/v1/health")

    def rtt_ms(self, samples: int = 3) -> float:
        """Median round trip of the health check, in milliseconds."""
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            self.health()
            times.append((time.perf_counter() - t0) * 1000.0)
        return sorted(times)[len(times) // 2]

    def init_run(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self.post("/v1/run", spec)

    def status(self) -> dict[str, Any]:
        return self.get("/v1/status")

    def ledger(self) -> list[dict[str, Any]]:
        return self.get("/v1/ledger")

    def register(self, site: str, digest: str, ranks: int, rtt_ms: float | None) -> dict[str, Any]:
        return self.post(
            f"/v1/sites/{site}/register", {"digest": digest, "ranks": ranks, "rtt_ms": rtt_ms}
        )

    def lease(
        self, site: str, round_no: int, n_blocks: int, t_step_s: float | None, rtt_ms: float | None
    ) -> dict[str, Any]:
        body = {
            "site": site,
            "round": round_no,
            "n_blocks": n_blocks,
            "t_step_s": t_step_s,
            "rtt_ms": rtt_ms,
        }
        return self.post("/v1/leases", body)

    def heartbeat(
        self, lease_id: int, site: str, consumed: int, t_step_s: float | None
    ) -> dict[str, Any]:
        return self.post(
            f"/v1/leases/{lease_id}/heartbeat",
            {"site": site, "consumed": consumed, "t_step_s": t_step_s},
        )

    def release(self, lease_id: int, site: str) -> dict[str, Any]:
        return self.post(f"/v1/leases/{lease_id}/release", {"site": site})

    def round_info(self, round_no: int) -> dict[str, Any]:
        return self.get(f"/v1/rounds/{round_no}")

    def download_model(self, generation: int, dest: Path) -> Path:
        """Stream generation ``generation`` to ``dest`` (atomic), checking its SHA-256."""
        if dest.exists():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.retry_budget_s
        while True:
            try:
                return self._download_once(generation, dest)
            except (httpx.TransportError, IntegrityError) as exc:
                if time.monotonic() > deadline:
                    raise Unreachable(f"download of generation {generation} failed: {exc}") from exc
                self.sleep(1.0)

    def _download_once(self, generation: int, dest: Path) -> Path:
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        digest = hashlib.sha256()
        with self.http.stream("GET", f"/v1/models/{generation}") as response:
            if response.status_code >= 400:
                response.read()
                raise _refusal(response)
            expected = response.headers.get("X-Content-SHA256", "")
            with open(tmp, "wb") as handle:
                for chunk in response.iter_bytes(CHUNK):
                    digest.update(chunk)
                    handle.write(chunk)
                handle.flush()
                os.fsync(handle.fileno())
        if expected and digest.hexdigest() != expected:
            tmp.unlink(missing_ok=True)
            raise IntegrityError(f"generation {generation}: body does not match its SHA-256")
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
        return dest

    def upload_blob(self, path: Path) -> str:
        """PUT a file into the blob store (streamed); idempotent, retried on failure."""
        key = sha256_file(path)
        self._request(
            "PUT",
            f"/v1/blobs/{key}",
            content_factory=lambda: _file_chunks(path),
            headers={"Content-Length": str(path.stat().st_size)},
        )
        return key

    def submit_delta(
        self, round_no: int, path: Path, *, inline: bool, **fields: Any
    ) -> dict[str, Any]:
        """Send a delta file either inside the round message (inline) or as a blob reference."""
        if inline:
            key = sha256_file(path)
            return self._request(
                "POST",
                f"/v1/rounds/{round_no}/deltas/inline",
                params={k: v for k, v in fields.items() if v is not None},
                content_factory=lambda: _file_chunks(path),
                headers={"X-Content-SHA256": key, "Content-Length": str(path.stat().st_size)},
            ).json()
        key = self.upload_blob(path)
        return self.post(f"/v1/rounds/{round_no}/deltas", {**fields, "blob": key})


class IntegrityError(Exception):
    """Downloaded bytes did not match the advertised digest."""


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            yield chunk


def _refusal(response: httpx.Response) -> Refused:
    try:
        body = response.json()
        return Refused(
            response.status_code, str(body.get("error", "error")), str(body.get("detail", body))
        )
    except ValueError:
        return Refused(response.status_code, "error", response.text[:500])
