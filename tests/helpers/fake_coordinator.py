"""A fake coordinator (named as such): the few answers a test scripts, where a real process
would not show the case (a fault mid-upload, a round that closes after a set number of polls,
a page over fixed rows). Tests that need the coordinator itself start the real one
(tests/conftest.py); this stands in only for what it is given.

One object, three faces a test may use together or alone:

- the read-only views the status page reads (``status``, ``sites_view``, ``ledger_table``,
  ``round_history``), answering what the test gave it, or ``no_run`` without a run;
- a round that closes once a site has trained it (``pending``, set by the test's runner) and
  ``lag`` more ``status`` polls have passed, as chain jobs see it;
- the blob and delta routes in memory for ``httpx.MockTransport`` (``handler``), with
  scripted ``faults`` and every request recorded in ``calls``.
"""

from __future__ import annotations

import json
from typing import Any

import blake3
import httpx

from crossfed.coordinator.service import CoordinatorError


def blake(data: bytes) -> str:
    """The blob key the coordinator gives ``data`` (its BLAKE3 digest)."""
    return "blake3:" + blake3.blake3(data).hexdigest()


class FakeCoordinator:
    """A stand-in coordinator: scripted views, a round clock, and in-memory blob routes."""

    def __init__(
        self,
        *,
        run: bool = True,
        round_no: int = 1,
        generation: int = 0,
        lag: int = 2,
        leases: list[dict[str, Any]] | None = None,
        sites: list[dict[str, Any]] | None = None,
        ledger: list[dict[str, Any]] | None = None,
        history: list[dict[str, Any]] | None = None,
    ) -> None:
        self.run = run
        # the round clock: ``pending`` is the round a site has trained and not yet seen closed
        self.round, self.generation, self.lag, self.polls = round_no, generation, lag, 0
        self.pending: int | None = None
        self.leases, self.sites = list(leases or []), list(sites or [])
        self.ledger, self.history = list(ledger or []), list(history or [])
        # the blob and delta routes
        self.staged: dict[str, bytearray] = {}
        self.complete: dict[str, bytes] = {}
        self.deltas: dict[int, str] = {}
        self.calls: list[str] = []
        self.faults: list[str | None] = []  # consumed in order: "drop", "timeout", "inline_408"

    # ----------------------------------------------------------------- read-only views
    def status(self) -> dict[str, Any]:
        """The open round and generation, and the leases held; a trained round closes after
        ``lag`` polls (the next opens)."""
        if not self.run:
            raise CoordinatorError(409, "no_run", "no run initialised")
        if self.pending is not None:
            self.polls += 1
            if self.polls > self.lag:
                self.round, self.pending, self.polls = self.pending + 1, None, 0
                self.generation += 1
        return {"round": self.round, "generation": self.generation, "active_leases": self.leases}

    def sites_view(self) -> list[dict[str, Any]]:
        return self.sites

    def ledger_table(self) -> list[dict[str, Any]]:
        return self.ledger

    def round_history(self) -> list[dict[str, Any]]:
        return self.history

    # ----------------------------------------------------------------- blob and delta routes
    def handler(self, request: httpx.Request) -> httpx.Response:
        """One request to the blob and delta routes, as ``httpx.MockTransport`` calls it."""
        path, method = request.url.path, request.method
        self.calls.append(f"{method} {path}")
        fault = self.faults.pop(0) if self.faults else None
        if path.endswith("/state"):
            key = path.split("/")[3]
            if key in self.complete:
                size = len(self.complete[key])
                return httpx.Response(
                    200, json={"key": key, "complete": True, "offset": size, "bytes": size}
                )
            offset = len(self.staged.get(key, b""))
            return httpx.Response(
                200, json={"key": key, "complete": False, "offset": offset, "bytes": None}
            )
        if method == "PUT":
            key = path.split("/")[3]
            offset, total = int(request.url.params["offset"]), int(request.url.params["total"])
            data = request.read()
            staged = self.staged.setdefault(key, bytearray())
            if offset != len(staged):
                return httpx.Response(409, json={"error": "upload_offset", "offset": len(staged)})
            if fault == "drop":  # half the part arrives, then the connection breaks
                staged += data[: len(data) // 2]
                raise httpx.RemoteProtocolError("connection reset", request=request)
            if fault == "timeout":
                staged += data[: len(data) // 3]
                return httpx.Response(408, json={"error": "request_timeout", "detail": "slow"})
            staged += data
            if len(staged) == total:
                del self.staged[key]
                if blake(bytes(staged)) != key:
                    return httpx.Response(422, json={"error": "digest_mismatch", "detail": "x"})
                self.complete[key] = bytes(staged)
                return httpx.Response(201, json={"key": key, "complete": True, "offset": total})
            return httpx.Response(201, json={"key": key, "complete": False, "offset": len(staged)})
        if path.endswith("/deltas/inline"):
            data = request.read()
            if fault == "inline_408":
                return httpx.Response(408, json={"error": "request_timeout", "detail": "slow"})
            key = request.headers["x-content-digest"]
            self.complete[key] = data
            return self._accept(int(request.url.params["lease_id"]), key)
        if path.endswith("/deltas"):
            payload = json.loads(request.read())
            return self._accept(payload["lease_id"], payload["blob"])
        return httpx.Response(404, json={"error": "not_found", "detail": path})

    def _accept(self, lease_id: int, key: str) -> httpx.Response:
        if lease_id in self.deltas:
            return httpx.Response(200, json={"accepted": True, "already": True})
        if key not in self.complete:
            return httpx.Response(404, json={"error": "unknown_blob", "detail": key})
        self.deltas[lease_id] = key
        return httpx.Response(200, json={"accepted": True, "already": False})
