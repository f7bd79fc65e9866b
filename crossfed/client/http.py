"""HTTP client for the coordinator: short requests, retries with backoff, streamed weights.

Weights move in parts: an upload is a series of PUTs of at most ``part_bytes`` each and a
download a series of ``Range`` GETs, so no request outlives a proxy's patience; a part cut
short (time limit, dropped connection, restarted coordinator) resumes from the bytes that
arrived. Every file is checked against its digest (``blake3:`` or ``sha256:``) end to end.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpcore
import httpx

from crossfed.backoff import Backoff
from crossfed.client.transfer import (
    MISMATCH_RETRIES,
    RETRY_STATUS,
    SPAN_ALIGN,
    IntegrityError,
    Progress,
    Refused,
    Unreachable,
    fetch_spans,
    split_spans,
    write_all,
)
from crossfed.fileio import create_temp_beside, replace_durably
from crossfed.wire.digests import (
    PART_BYTES,
    DigestError,
    Hasher,
    canonical_digest,
    digest_file,
    iter_chunks,
    new_hasher,
    parse_digest,
)
from crossfed.wire.libc import start_writeback

if TYPE_CHECKING:
    from crossfed.client.presigned import ObjectTransfers

log = logging.getLogger("crossfed.client")
T = TypeVar("T")
#: bytes per socket read of a response body. httpcore reads 64 KiB at a time; at that size
#: the per-read Python work (h11 events, one bytes object each) is a quarter of a blob
#: download's CPU. 1 MiB reads took bench/transport.py's download (1.19 GB, /dev/shm) from
#: 0.49 to 0.79 GB/s
RESPONSE_READ_BYTES = 1 << 20


def read_responses_in_large_pieces(size: int = RESPONSE_READ_BYTES) -> None:
    """Have httpcore's HTTP/1.1 connections (plain, TLS or through a proxy) read ``size``
    bytes per socket read (never fewer than httpcore's own default)."""
    current = getattr(httpcore.HTTP11Connection, "READ_NUM_BYTES", None)
    if current is not None and current < size:
        httpcore.HTTP11Connection.READ_NUM_BYTES = size


read_responses_in_large_pieces()

#: a request's first retry delay; a try held at least this long before its connection was cut
#: (the server was there: a long poll behind a proxy that ends connections) is retried after
#: it again, not after a delay grown by earlier misses
HELD_TRY_S = 0.2
#: a lease's heartbeat thread gives each beat this many seconds, its retries included, and
#: beats again an interval later: one connection a failing network holds (a NAT that dropped
#: it silently) must not outlast the lease's TTL, as the client's whole timeout could
BEAT_TRY_S = 3.0
#: ... or this many of the site's recent round trips, where that is longer: a beat on a fresh
#: connection through a forward proxy over TLS takes about four (the tunnel, the handshake,
#: the request), which a slow link stretches past ``BEAT_TRY_S``
BEAT_TRY_RTTS = 5.0
#: a JSON request answered 408 (its body came too slowly) never reached its handler: resend it
JSON_RETRY_STATUS = RETRY_STATUS | {408}
#: refusals of one part that a resync (asking the coordinator where to resume) fixes
RESYNC_STATUS = {408, 409}
#: an inline delta refused for these goes as a blob instead
INLINE_FALLBACK_STATUS = {408, 413}
#: downloaded bytes handed to the writer thread at once
SINK_BATCH = 8 << 20
#: the fewest bytes worth a connection of their own (smaller blobs use fewer streams)
STREAM_MIN_BYTES = 16 << 20
#: seconds an idle connection is kept for the next request (the coordinator keeps its end
#: 75 s): a site's connections idle for a phase between transfers, and across a long link
#: opening one again costs round trips
KEEPALIVE_S = 60.0
#: the longest one status request waits for a round to close (a long poll)
STATUS_WAIT_S = 20.0
#: how many of the latest short requests' round trips a site's RTT is taken from, and for
#: how long one counts: a site that heartbeats measures its RTT without asking more
RTT_SAMPLES = 8
RTT_FRESH_S = 120.0


def beat_try_s(rtt_ms: float | None) -> float:
    """The seconds one heartbeat may take, retries included: ``BEAT_TRY_S``, or
    ``BEAT_TRY_RTTS`` round trips of ``rtt_ms`` where that is longer."""
    return max(BEAT_TRY_S, BEAT_TRY_RTTS * (rtt_ms or 0.0) / 1000.0)


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
        part_bytes: int = PART_BYTES,
        streams: int = 1,
        stream_min_bytes: int = STREAM_MIN_BYTES,
        blobs: str | None = "file",
    ) -> None:
        """``blobs``: where the coordinator keeps blobs, as the run config says (``file`` or
        ``s3``; None: ask it). A coordinator that says otherwise is followed."""
        if part_bytes < 1:
            raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        self.url = url.rstrip("/")
        self.timeout_s, self.retry_budget_s = timeout_s, retry_budget_s
        self.sleep = sleep
        self.part_bytes = part_bytes
        self.streams, self.stream_min_bytes = streams, max(1, stream_min_bytes)
        self._new_http = lambda: httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
        )
        self.http = self._new_http()
        self._stream_http: list[httpx.Client] = []  # one connection per parallel stream
        #: presigned URLs go to the object store without the coordinator's token
        self._store_http = httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
        )
        self._backend = blobs
        #: (when, milliseconds) of the latest short requests answered (health, register,
        #: lease, heartbeat, release): requests the coordinator answers at once
        self._round_trips: deque[tuple[float, float]] = deque(maxlen=RTT_SAMPLES)

    def close(self) -> None:
        self.http.close()
        self._store_http.close()
        for http in self._stream_http:
            http.close()

    def streams_for(self, size: int) -> int:
        """How many connections a blob of ``size`` bytes moves over: ``streams``, fewer when
        each would carry less than ``stream_min_bytes`` or than one ``SPAN_ALIGN``."""
        return max(1, min(self.streams, size // self.stream_min_bytes, -(-size // SPAN_ALIGN)))

    def _stream_clients(self, n: int) -> list[httpx.Client]:
        while len(self._stream_http) < n:
            self._stream_http.append(self._new_http())
        return self._stream_http[:n]

    def _request(
        self,
        method: str,
        path: str,
        *,
        retry_status: set[int] = RETRY_STATUS,
        http: httpx.Client | None = None,
        budget_s: float | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """``budget_s``: this request's retry budget (None: the client's)."""
        budget = self.retry_budget_s if budget_s is None else budget_s
        backoff = Backoff(HELD_TRY_S, 5.0, jitter=True, budget_s=budget, sleep=self.sleep)
        factory = kwargs.pop("content_factory", None)
        while True:
            if factory is not None:
                kwargs["content"] = factory()
            began = time.monotonic()
            try:
                response = (http or self.http).request(method, path, **kwargs)
            except httpx.TransportError as exc:
                error: Exception = exc
            else:
                if response.status_code < 400:
                    return response
                if response.status_code not in retry_status:
                    raise _refusal(response)
                error = _refusal(response)
            if isinstance(error, httpx.TransportError) and time.monotonic() - began >= HELD_TRY_S:
                # the connection was held, then cut (a long poll behind a proxy that ends
                # connections): the server is there and the try spaced itself; try again soon
                backoff.relax()
            if not backoff.wait():
                raise Unreachable(f"{method} {self.url}{path}: {error}") from error

    def get(self, path: str, *, round_trip: bool = False, **kwargs: Any) -> Any:
        """A JSON GET; ``round_trip``: a short request whose time counts as an RTT sample."""
        response = self._request("GET", path, retry_status=JSON_RETRY_STATUS, **kwargs)
        if round_trip:
            self._note_round_trip(response)
        return response.json()

    def post(self, path: str, body: Any = None, *, round_trip: bool = False, **kwargs: Any) -> Any:
        """A JSON POST; ``round_trip`` as for :meth:`get`."""
        response = self._request("POST", path, json=body, retry_status=JSON_RETRY_STATUS, **kwargs)
        if round_trip:
            self._note_round_trip(response)
        return response.json()

    def _note_round_trip(self, response: httpx.Response) -> None:
        self._round_trips.append((time.monotonic(), response.elapsed.total_seconds() * 1000.0))

    # --- protocol
    def health(self) -> dict[str, Any]:
        return self.get("/v1/health", round_trip=True)

    @property
    def backend(self) -> str:
        """Where the coordinator keeps blobs: ``file`` (bytes go through it) or ``s3``
        (bytes go to an object store through presigned URLs)."""
        if self._backend is None:
            self._backend = str(self.health().get("blobs", "file"))
        return self._backend

    def _either(self, on_file: Callable[[], T], on_s3: Callable[[], T]) -> T:
        """``on_file`` or ``on_s3`` by :attr:`backend`; a file transfer the coordinator
        refuses because its blobs live in an object store goes there instead."""
        if self.backend == "s3":
            return on_s3()
        try:
            return on_file()
        except Refused as exc:
            if exc.code != "wrong_backend":
                raise
            log.warning("the coordinator keeps blobs in an object store; sending them there")
            self._backend = "s3"
            return on_s3()

    def recent_rtt_ms(self) -> float | None:
        """The median of the latest short requests' round trips in the last ``RTT_FRESH_S``
        seconds, in milliseconds; None when there are none (asks nothing)."""
        recent = self._fresh_round_trips()
        return statistics.median(recent) if recent else None

    def _fresh_round_trips(self) -> list[float]:
        now = time.monotonic()
        return [ms for when, ms in self._round_trips if now - when <= RTT_FRESH_S]

    def rtt_ms(self, samples: int = 3) -> float:
        """The site's round trip to the coordinator, in milliseconds: the median of the
        latest short requests when at least ``samples`` were answered in the last
        ``RTT_FRESH_S`` seconds (a site that heartbeats asks nothing more), else of
        ``samples`` health checks (whose answers name the blob backend too, so a site that
        measures its RTT asks no more for that)."""
        recent = self._fresh_round_trips()
        if len(recent) >= samples:
            return statistics.median(recent)
        for _ in range(samples):
            answer = self.health()
            if self._backend is None and "blobs" in answer:
                self._backend = str(answer["blobs"])
        return statistics.median(ms for _, ms in list(self._round_trips)[-samples:])

    def init_run(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self.post("/v1/run", spec)

    def status(self, after_round: int | None = None, wait_s: float = 0.0) -> dict[str, Any]:
        """The run's state; with ``after_round``, once the open round is past it or
        ``wait_s`` seconds have passed (a long poll)."""
        if after_round is None:
            return self.get("/v1/status")
        params = {"after_round": after_round, "wait_s": wait_s}
        timeout = httpx.Timeout(self.timeout_s + wait_s, connect=min(10.0, self.timeout_s))
        return self.get("/v1/status", params=params, timeout=timeout)

    def ledger(self) -> list[dict[str, Any]]:
        return self.get("/v1/ledger")

    def register(
        self, site: str, digest: str, ranks: int, rtt_ms: float | None, round_no: int | None = None
    ) -> dict[str, Any]:
        body = {"digest": digest, "ranks": ranks, "rtt_ms": rtt_ms, "round": round_no}
        return self.post(f"/v1/sites/{site}/register", body, round_trip=True)

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
        return self.post("/v1/leases", body, round_trip=True)

    def heartbeat(
        self,
        lease_id: int,
        site: str,
        consumed: int,
        t_step_s: float | None,
        echo: int | None = None,
        echo_held_s: float | None = None,
        bounded: bool = False,
    ) -> dict[str, Any]:
        """Refresh a lease; ``echo``/``echo_held_s`` return the previous reply's nonce and how
        long it was held, so the coordinator can measure the round trip. ``bounded``: this
        beat may take ``beat_try_s`` of the recent round trips, retries included (else the
        client's timeout and budget), for a caller that beats again soon."""
        body = {"site": site, "consumed": consumed, "t_step_s": t_step_s}
        if echo is not None:
            body |= {"echo": echo, "echo_held_s": echo_held_s}
        options: dict[str, Any] = {}
        if bounded:
            try_s = beat_try_s(self.recent_rtt_ms())
            options = {"timeout": httpx.Timeout(try_s, connect=min(10.0, try_s)), "budget_s": try_s}
        return self.post(f"/v1/leases/{lease_id}/heartbeat", body, round_trip=True, **options)

    def adopt(
        self, lease_id: int, site: str, consumed: int, rtt_ms: float | None = None
    ) -> dict[str, Any]:
        """Take over ``site``'s live lease ``lease_id`` (a dead job's) at progress ``consumed``."""
        body = {"site": site, "consumed": consumed, "t_step_s": None, "rtt_ms": rtt_ms}
        return self.post(f"/v1/leases/{lease_id}/adopt", body, round_trip=True)

    def release(self, lease_id: int, site: str) -> dict[str, Any]:
        return self.post(f"/v1/leases/{lease_id}/release", {"site": site}, round_trip=True)

    def round_info(self, round_no: int) -> dict[str, Any]:
        return self.get(f"/v1/rounds/{round_no}")

    # --- weights
    def download_model(
        self, generation: int, dest: Path, known: dict[str, Any] | None = None
    ) -> Path:
        """Fetch generation ``generation`` to ``dest`` (atomic, digest-checked, in ranges).

        ``known``: the status's ``model`` (its ``generation``, ``bytes`` and ``digest``);
        when it is this generation's, parallel streams start without asking for them."""
        url, what = f"/v1/models/{generation}", f"generation {generation}"
        return self._either(
            lambda: self._download_model(url, dest, what, generation, known),
            lambda: self._objects().download(f"{url}/url", dest, what),
        )

    def _download_model(
        self, url: str, dest: Path, what: str, generation: int, known: dict[str, Any] | None
    ) -> Path:
        if known and known.get("generation") == generation and known.get("digest"):
            return self._download(url, dest, what, sized=(int(known["bytes"]), known["digest"]))
        return self._download(url, dest, what)

    def download_blob(self, key: str, dest: Path) -> Path:
        """Fetch blob ``key`` to ``dest``; its bytes must hash to ``key``."""
        key = _key(key)
        return self._either(
            lambda: self._download(f"/v1/blobs/{key}", dest, f"blob {key}", expected=key),
            lambda: self._objects().download(f"/v1/blobs/{key}/url", dest, f"blob {key}", key),
        )

    def blob_state(self, key: str, http: httpx.Client | None = None) -> dict[str, Any]:
        """Whether blob ``key`` is complete and the ``offset`` its upload resumes at."""
        path = f"/v1/blobs/{_key(key)}/state"
        return self._request("GET", path, retry_status=JSON_RETRY_STATUS, http=http).json()

    def upload_blob(self, path: Path, key: str | None = None, *, fresh: bool = False) -> str:
        """PUT a file into the blob store in parts; resumable, idempotent, retried.

        ``key`` is the file's digest if already known (the writer computed it); otherwise
        it is computed here (BLAKE3). A file large enough for several streams goes as that
        many byte ranges, each its own blob uploaded over its own connection (and resumed
        on its own), which the coordinator then joins into ``key`` (checking the digest).
        ``fresh``: the file was just written, so nothing of it can be stored yet; its
        upload starts without asking (a part stored after all is answered and resumed).
        """
        key = _key(key) if key is not None else digest_file(path)
        return self._either(
            lambda: self._upload_file(path, key, fresh),
            lambda: self._objects().upload(path, key),
        )

    def _upload_file(self, path: Path, key: str, fresh: bool) -> str:
        """:meth:`upload_blob` through the coordinator's own blob store."""
        size = path.stat().st_size
        n = self.streams_for(size)
        if n == 1:
            return self._upload_range(self.http, path, key, 0, size, fresh=fresh)
        if not fresh and self.blob_state(key)["complete"]:
            return key
        compose = f"/v1/blobs/{key}/compose"
        self._send_in_parts(path, key, n, fresh, lambda parts: self.post(compose, {"parts": parts}))
        return key

    def _send_in_parts(
        self, path: Path, key: str, n: int, fresh: bool, join: Callable[[list[str]], T]
    ) -> T:
        """Upload ``path`` as ``n`` byte ranges over as many connections, each its own blob,
        then ``join`` their keys into ``key`` (a join that finds a part pruned sends the
        parts again; one whose bytes do not hash to ``key`` is an IntegrityError)."""
        algo = parse_digest(key)[0]
        spans = split_spans(path.stat().st_size, n)  # n spans: streams_for never asks for more
        clients = self._stream_clients(n)

        def send(i: int, first: bool) -> str:
            start, end = spans[i]
            part = digest_file(path, algo, start, end)
            return self._upload_range(clients[i], path, part, start, end, fresh=fresh and first)

        for attempt in range(MISMATCH_RETRIES + 1):
            with ThreadPoolExecutor(n, thread_name_prefix="crossfed-upload") as pool:
                parts = list(pool.map(send, range(n), [attempt == 0] * n))
            try:
                return join(parts)
            except Refused as exc:
                # a part pruned before the join is sent again; other refusals are final
                if exc.code != "unknown_blob" or attempt == MISMATCH_RETRIES:
                    if exc.code == "digest_mismatch":
                        raise IntegrityError(
                            f"{path}: its {n} parts do not join to {key}; is the file "
                            "changing while it is sent?"
                        ) from exc
                    raise
                log.warning("joining %s: %s; sending its parts again", path.name, exc)
        raise AssertionError("unreachable")

    def _upload_range(
        self, http: httpx.Client, path: Path, key: str, start: int, end: int, *, fresh: bool
    ) -> str:
        """Upload bytes ``[start, end)`` of ``path`` as blob ``key`` over ``http`` (``fresh``:
        from offset 0 without asking where to start)."""
        size = end - start
        mismatches = 0
        state = {"complete": False, "offset": 0} if fresh else self.blob_state(key, http)
        progress = Progress(self.retry_budget_s)
        while not state["complete"]:
            offset = int(state["offset"])
            stop = min(size, offset + self.part_bytes)
            if offset > size:
                offset, stop = 0, min(size, self.part_bytes)
            try:
                response = http.put(
                    f"/v1/blobs/{key}",
                    params={"offset": offset, "total": size},
                    content=iter_chunks(path, start + offset, start + stop),
                    headers={"Content-Length": str(stop - offset)},
                )
            except httpx.TransportError as exc:
                error: Exception = exc
            else:
                if response.status_code < 400:
                    state = response.json()
                    progress.advanced()
                    continue
                error = _refusal(response)
                if response.status_code == 422 and error.code == "digest_mismatch":
                    mismatches += 1
                    if mismatches > MISMATCH_RETRIES:
                        raise IntegrityError(
                            f"{path}: the coordinator hashed it differently {mismatches} times "
                            f"(key {key}); is the file changing while it is sent?"
                        ) from error
                elif (
                    response.status_code not in RESYNC_STATUS | RETRY_STATUS
                    or error.code == "wrong_backend"
                ):
                    raise error
                if response.status_code in RESYNC_STATUS:
                    state = self.blob_state(key, http)
                    if int(state["offset"]) > offset:  # cut short after some bytes: go on
                        progress.advanced()
                        continue
            progress.wait(self.sleep, f"upload of {path.name}", error)
            state = self.blob_state(key, http)
        return key

    def submit_delta(
        self,
        round_no: int,
        path: Path,
        *,
        inline: bool,
        key: str | None = None,
        fresh: bool = False,
        **fields: Any,
    ) -> dict[str, Any]:
        """Send a delta inside the round message (inline) or as a blob reference.

        Unless ``fresh`` (written just now, never sent), the submission by reference is
        tried first: resending a delta the coordinator already holds (a restarted job)
        costs one short request, no bytes. Inline bodies refused as too slow or too large
        go as a blob instead (the upload resumes where the inline body stopped). A delta
        large enough for several streams goes as byte ranges that the submission joins.
        """
        key = _key(key) if key is not None else digest_file(path)
        body = {**fields, "blob": key}
        deltas = f"/v1/rounds/{round_no}/deltas"
        if not fresh:
            try:
                return self.post(deltas, body)
            except Refused as exc:
                if exc.code != "unknown_blob":
                    raise

        def to_store() -> dict[str, Any]:  # to the object store, then by reference
            self._objects().upload(path, key)
            return self.post(deltas, body)

        return self._either(
            lambda: self._submit_file(round_no, path, inline, key, fresh, body, fields), to_store
        )

    def _submit_file(
        self,
        round_no: int,
        path: Path,
        inline: bool,
        key: str,
        fresh: bool,
        body: dict[str, Any],
        fields: dict[str, Any],
    ) -> dict[str, Any]:
        """:meth:`submit_delta`'s bytes through the coordinator (inline, parts or a blob)."""
        deltas = f"/v1/rounds/{round_no}/deltas"
        n = self.streams_for(path.stat().st_size)
        if n > 1:  # parts over n connections, joined by the submission itself
            return self._send_in_parts(
                path, key, n, fresh, lambda parts: self.post(deltas, {**body, "parts": parts})
            )
        if inline:
            try:
                return self._request(
                    "POST",
                    f"/v1/rounds/{round_no}/deltas/inline",
                    params={k: v for k, v in fields.items() if v is not None},
                    content_factory=lambda: iter_chunks(path),
                    headers={"X-Content-Digest": key, "Content-Length": str(path.stat().st_size)},
                ).json()
            except Refused as exc:
                if exc.status not in INLINE_FALLBACK_STATUS:
                    raise
                log.warning("inline delta refused (%s); sending it as a blob", exc)
        self.upload_blob(path, key, fresh=fresh and not inline)
        return self.post(deltas, body)

    def _objects(self) -> ObjectTransfers:
        from crossfed.client.presigned import ObjectTransfers

        return ObjectTransfers(self, self._store_http)

    def _download(
        self,
        url: str,
        dest: Path,
        what: str,
        expected: str | None = None,
        sized: tuple[int, str] | None = None,
    ) -> Path:
        """GET ``url`` in ranges of ``part_bytes`` into ``dest``, hashing as bytes arrive
        (over several connections when ``streams`` > 1 and the file is large enough;
        ``sized``: its size and digest, known already, else asked for with one byte)."""
        if dest.exists():
            return dest
        if self.streams > 1:
            size, digest = sized or self._probe(url, what, expected)
            if self.streams_for(size) > 1:
                return self._download_parallel(url, dest, what, size, _key(digest))
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = create_temp_beside(dest, suffix=".part", mode=0o644)
        progress = Progress(self.retry_budget_s)
        sink = _Sink(fd)
        try:
            size, digest = None, expected
            while size is None or sink.received < size:
                offset = sink.received
                stop = offset + self.part_bytes - 1
                try:
                    with self.http.stream(
                        "GET", url, headers={"Range": f"bytes={offset}-{stop}"}
                    ) as response:
                        if response.status_code >= 400:
                            response.read()
                            raise _refusal(response)
                        sent = canonical_digest(response.headers.get("X-Content-Digest", ""))
                        if expected is not None and sent != expected:
                            raise IntegrityError(f"{what}: the server names it {sent}")
                        if digest is None:
                            digest = sent
                        if sent != digest or response.status_code == 200 or sink.hasher is None:
                            # first bytes, a changed file, or the whole file resent: start over
                            sink.reset(parse_digest(sent)[0])
                            digest = sent
                        size = int(response.headers.get("X-Content-Size", "0")) or _range_total(
                            response
                        )
                        for chunk in response.iter_raw():
                            sink.feed(chunk)
                    progress.advanced()
                except (httpx.TransportError, DigestError) as exc:
                    if isinstance(exc, DigestError):
                        raise IntegrityError(f"{what}: bad digest header: {exc}") from exc
                    progress.wait(self.sleep, f"download of {what}", exc)
                except Refused as exc:
                    if exc.status not in RETRY_STATUS:
                        raise
                    progress.wait(self.sleep, f"download of {what}", exc)
            sink.drain()
            assert sink.hasher is not None and digest is not None
            if f"{parse_digest(digest)[0]}:{sink.hasher.hexdigest()}" != digest:
                raise IntegrityError(f"{what}: the bytes received do not match {digest}")
            os.fsync(sink.fd)
        except BaseException:
            sink.close()
            tmp.unlink(missing_ok=True)
            raise
        sink.close()
        replace_durably(tmp, dest)
        return dest

    def _probe(self, url: str, what: str, expected: str | None) -> tuple[int, str]:
        """The size and digest of the file at ``url`` (from a one-byte range)."""
        response = self._request("GET", url, headers={"Range": "bytes=0-0"})
        try:
            digest = canonical_digest(response.headers.get("X-Content-Digest", ""))
        except DigestError as exc:
            raise IntegrityError(f"{what}: bad digest header: {exc}") from exc
        if expected is not None and digest != expected:
            raise IntegrityError(f"{what}: the server names it {digest}")
        size = int(response.headers.get("X-Content-Size", "0")) or _range_total(response)
        return size, digest

    def _download_parallel(self, url: str, dest: Path, what: str, size: int, digest: str) -> Path:
        """GET ``url`` as ``streams`` byte spans over as many connections, each written in
        place as it arrives and resumed on its own; the whole is digest-checked at the end."""
        n = len(split_spans(size, self.streams_for(size)))
        clients = self._stream_clients(n)

        def fetch(i: int, fd: int, span: tuple[int, int]) -> None:
            self._fetch_span(clients[i], url, fd, span, what, digest)

        return fetch_spans(dest, size, digest, n, fetch, what)

    def _fetch_span(
        self, http: httpx.Client, url: str, fd: int, span: tuple[int, int], what: str, digest: str
    ) -> None:
        """Bytes ``[start, end)`` of ``url`` into ``fd`` at their offsets, in ranges of
        ``part_bytes``; a range cut short resumes from the bytes written."""
        position, end = span
        progress = Progress(self.retry_budget_s)
        while position < end:
            stop = min(end, position + self.part_bytes) - 1
            try:
                with http.stream("GET", url, headers={"Range": f"bytes={position}-{stop}"}) as r:
                    if r.status_code >= 400:
                        r.read()
                        raise _refusal(r)
                    if r.headers.get("X-Content-Digest") != digest or r.status_code != 206:
                        raise IntegrityError(f"{what} changed while it was fetched")
                    for chunk in r.iter_raw():
                        chunk = chunk[: stop + 1 - position]
                        write_all(fd, chunk, position)
                        position += len(chunk)
                progress.advanced()
            except httpx.TransportError as exc:
                progress.wait(self.sleep, f"download of {what}", exc)
            except Refused as exc:
                if exc.status not in RETRY_STATUS:
                    raise
                progress.wait(self.sleep, f"download of {what}", exc)


class _Sink:
    """Received bytes -> file and hasher, in order, on one worker thread (overlapping the
    network reads); at most two batches are buffered."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="crossfed-sink")
        self.pending: Future[None] | None = None
        self.batch: list[bytes] = []
        self.batched = 0
        self.received = 0  # bytes fed (all of them reach the file once drained)
        self.written = 0
        self.hasher: Hasher | None = None

    def reset(self, algo: str) -> None:
        self.drain()
        os.ftruncate(self.fd, 0)
        self.received = self.written = 0
        self.hasher = new_hasher(algo)

    def feed(self, chunk: bytes) -> None:
        self.batch.append(chunk)
        self.batched += len(chunk)
        self.received += len(chunk)
        if self.batched >= SINK_BATCH:
            self._submit()

    def _submit(self) -> None:
        if self.pending is not None:
            self.pending.result()
        self.pending = self.pool.submit(self._absorb, self.batch)
        self.batch, self.batched = [], 0

    def _absorb(self, pieces: list[bytes]) -> None:
        assert self.hasher is not None
        for piece in pieces:
            write_all(self.fd, piece, self.written)
            self.hasher.update(piece)
            self.written += len(piece)
        start_writeback(self.fd)

    def drain(self) -> None:
        if self.batch:
            self._submit()
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        try:
            if self.pending is not None:
                self.pending.result()
        finally:
            self.pool.shutdown()
            os.close(self.fd)


def _key(key: str) -> str:
    try:
        return canonical_digest(key)
    except DigestError as exc:
        raise IntegrityError(f"bad blob key: {exc}") from exc


def _range_total(response: httpx.Response) -> int:
    """Total size from ``Content-Range: bytes a-b/total`` (or the body length for a 200)."""
    content_range = response.headers.get("Content-Range", "")
    if "/" in content_range:
        return int(content_range.rsplit("/", 1)[1])
    return int(response.headers.get("Content-Length", "0"))


def _refusal(response: httpx.Response) -> Refused:
    try:
        body = response.json()
        return Refused(
            response.status_code, str(body.get("error", "error")), str(body.get("detail", body))
        )
    except ValueError:
        return Refused(response.status_code, "error", response.text[:500])
