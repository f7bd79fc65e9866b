"""Hostile input against a live coordinator: schema fuzzing and hand-made attacks.

Schemathesis generates requests from the coordinator's own OpenAPI document (fetched with a
token) and every answer must be below 500. The hand-made cases extend
``test_coordinator_http.py``: each must be a clear 4xx and leave the run's state as it was.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from safetensors.torch import save_file
from schemathesis.checks import not_a_server_error
from starlette.requests import ClientDisconnect

from crossfed.coordinator.client import Refused
from crossfed.coordinator.embedded import ensure_secrets, free_port
from crossfed.coordinator.guards import StatusCounter, StatusStats
from crossfed.coordinator.runspec import LeasePolicy
from tests.conftest import SITES, LiveCoordinator, start_process, tiny_spec
from tests.test_coordinator_http import (
    delta_file,
    global_model,
    join_and_lease,
    submit,
    wait_round_closed,
)

BIG = 10**30


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_data: Path) -> Iterator[LiveCoordinator]:
    """One coordinator for the module, serving a tiny run whose leases never time out here."""
    state_dir = tmp_path_factory.mktemp("fuzz") / "coordinator"
    state_dir.mkdir()
    secrets = ensure_secrets(state_dir / "secrets.yaml", SITES)
    port = free_port("127.0.0.1")
    coordinator = LiveCoordinator(
        f"http://127.0.0.1:{port}", state_dir, secrets, start_process(state_dir, port), port
    )
    spec = tiny_spec(tiny_data, leases=LeasePolicy(min_ttl_s=3600.0, initial_ttl_s=3600.0))
    coordinator.client().init_run(spec.to_dict())
    yield coordinator
    coordinator.process.terminate()
    try:
        coordinator.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        coordinator.process.kill()


@pytest.fixture(scope="module")
def held(live: LiveCoordinator, tiny_data: Path) -> dict:
    """snellius holds a lease of round 1 for the whole module."""
    return join_and_lease(live, "snellius", tiny_data)


def bearer(live: LiveCoordinator, who: str = "admin") -> dict[str, str]:
    token = live.secrets["admin"] if who == "admin" else live.secrets["sites"][who]
    return {"Authorization": f"Bearer {token}"}


def run_state(live: LiveCoordinator) -> dict:
    """What a refused request must not change: ledger, deltas, rounds, commits, meta, models."""
    db = live.state_dir / "state.sqlite"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        state = {
            table: conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()
            for table in ("darl_events", "darl_committed", "deltas", "rounds", "meta")
        }
        state["sites"] = conn.execute("SELECT site, ranks FROM sites ORDER BY 1").fetchall()
    state["models"] = sorted(p.name for p in (live.state_dir / "models").iterdir())
    state["files"] = sorted(
        str(p.relative_to(live.state_dir))
        for p in live.state_dir.rglob("*")
        if p.is_file() and "blobs" not in p.parts and not p.name.startswith("state.sqlite")
    )
    return state


def blob_files(live: LiveCoordinator) -> list[str]:
    """Stored blobs (partial uploads staged for resuming are not blobs)."""
    root = live.state_dir / "blobs"
    return sorted(p.name for p in root.rglob("*") if p.is_file() and ".uploads" not in p.parts)


# ----------------------------------------------------------------------- schema fuzzing
@pytest.mark.slow
def test_schema_fuzzing_never_gets_a_5xx(live: LiveCoordinator, held: dict) -> None:
    """Every operation of /openapi.json, fuzzed with the admin token (it reaches deepest)."""
    schema = schemathesis.openapi.from_url(
        f"{live.url}/openapi.json", headers=bearer(live), timeout=30
    )
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    failures: list[str] = []
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    for operation in operations:
        for mode in modes:

            @given(case=operation.as_strategy(mode))
            @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
            def fuzz(case) -> None:
                case.call_and_validate(
                    headers=bearer(live), checks=[not_a_server_error], timeout=30
                )

            try:
                fuzz()
            except Unsatisfiable:  # nothing to make invalid (an operation without inputs)
                continue
            except Exception as exc:  # collect: every operation and mode gets its turn
                failures.append(f"{mode} {operation.method.upper()} {operation.path}: {exc}")
    assert not failures, "\n\n".join(failures)
    counts = httpx.get(f"{live.url}/v1/admin/http", headers=bearer(live)).json()
    assert counts["requests"] > 10 * len(operations) * len(modes)
    assert counts["http_5xx"] == 0, counts["by_status"]
    assert "http_5xx" not in (live.state_dir / "coordinator.log").read_text()


# ------------------------------------------------------------------ malformed deltas
def _safetensors(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


MALFORMED = {
    "empty_file": b"",
    "short_prefix": b"\x05\x00\x00",
    "header_longer_than_file": _safetensors({"a": 1}, length=10**6),
    "header_length_2_to_63": _safetensors(b"{}", length=2**63),
    "header_not_json": _safetensors(b"\xff\xfe not json at all"),
    "header_not_an_object": _safetensors([1, 2, 3]),  # type: ignore[arg-type]
    "offsets_past_the_end": _safetensors(
        {"norm.weight": {"dtype": "BF16", "shape": [128], "data_offsets": [0, 256]}}, b"\0" * 16
    ),
    "offsets_disagree_with_shape": _safetensors(
        {"norm.weight": {"dtype": "BF16", "shape": [128], "data_offsets": [0, 8]}}, b"\0" * 8
    ),
    "unknown_dtype": _safetensors(
        {"norm.weight": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8
    ),
    "giant_shape": _safetensors(
        {"norm.weight": {"dtype": "BF16", "shape": [2**40, 2**40], "data_offsets": [0, 8]}},
        b"\0" * 8,
    ),
    "metadata_only": _safetensors({"__metadata__": {"format": "pt"}}),
}


def _full_delta(reference: dict[str, torch.Tensor], **changes: torch.Tensor) -> dict:
    delta = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in reference.items()}
    delta.update(changes)
    return delta


@pytest.mark.parametrize("case", [*MALFORMED, "inf", "minus_inf", "extra_tensor"])
@pytest.mark.parametrize("inline", [False, True], ids=["blob", "inline"])
def test_malformed_and_non_finite_deltas_are_4xx_and_change_nothing(
    live: LiveCoordinator, held: dict, tmp_path: Path, case: str, inline: bool
) -> None:
    path = tmp_path / f"{case}.safetensors"
    if case in MALFORMED:
        path.write_bytes(MALFORMED[case])
        expected = "missing tensor" if case == "metadata_only" else "safetensors"
    else:
        g0 = global_model(live, 0, tmp_path)
        bad = torch.zeros(g0["norm.weight"].shape, dtype=torch.bfloat16)
        if case == "extra_tensor":
            delta = _full_delta(g0, **{"evil.weight": bad})
            expected = "evil.weight"
        else:
            bad[3] = float("inf") if case == "inf" else float("-inf")
            delta = _full_delta(g0, **{"norm.weight": bad})
            expected = "norm.weight"
        save_file(delta, str(path))
    before = run_state(live)
    with pytest.raises(Refused) as refused:
        submit(live, "snellius", held, path, inline=inline)
    assert 400 <= refused.value.status < 500, refused.value
    assert expected in refused.value.detail
    assert run_state(live) == before


# ------------------------------------------------------------------------ blob keys
@pytest.mark.parametrize(
    "key",
    [
        "..",
        "..%2F..%2F..%2Fetc%2Fpasswd",
        "%2e%2e%2f%2e%2e%2fstate.sqlite",
        "..%5C..%5Cstate.sqlite",
        "A" * 64,
        "0" * 63,
        "0" * 65,
        "0" * 63 + "g",
        "0" * 62 + "%00a",
        "%2F" + "0" * 64,
    ],
)
def test_path_traversal_in_blob_keys_is_refused(
    live: LiveCoordinator, held: dict, key: str
) -> None:
    before, blobs = run_state(live), blob_files(live)
    response = httpx.put(
        f"{live.url}/v1/blobs/{key}", headers=bearer(live, "snellius"), content=b"x"
    )
    assert response.status_code in (400, 404, 405), response.text
    inline = httpx.post(
        f"{live.url}/v1/rounds/1/deltas/inline",
        headers={**bearer(live, "snellius"), "X-Content-SHA256": key},
        params={"site": "snellius", "lease_id": held["lease_id"], "generation": 0},
        content=b"x",
    )
    assert 400 <= inline.status_code < 500, inline.text
    assert run_state(live) == before and blob_files(live) == blobs


def test_a_traversing_blob_reference_in_a_delta_is_refused(
    live: LiveCoordinator, held: dict
) -> None:
    before = run_state(live)
    for blob in ("../" * 21 + "x", "/etc/passwd".ljust(64, "0"), "0" * 63 + "/"):
        with pytest.raises(Refused) as refused:
            live.client("snellius").post(
                "/v1/rounds/1/deltas",
                {
                    "site": "snellius",
                    "lease_id": held["lease_id"],
                    "generation": 0,
                    "tokens": 10,
                    "steps": 1,
                    "consumed": 1,
                    "blob": blob,
                },
            )
        assert refused.value.status == 400 and "blob key" in refused.value.detail
    assert run_state(live) == before


# --------------------------------------------------------------------- numbers
def _raw_json(text: str) -> dict:
    return {"content": text.encode(), "headers": {"Content-Type": "application/json"}}


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_json_numbers_are_422(
    live: LiveCoordinator, held: dict, tiny_data: Path, number: str
) -> None:
    lease = held["lease_id"]
    requests = [
        ("/v1/sites/snellius/register", f'{{"digest": "x", "ranks": 1, "rtt_ms": {number}}}'),
        ("/v1/leases", f'{{"site": "snellius", "round": 1, "n_blocks": 1, "rtt_ms": {number}}}'),
        ("/v1/leases", f'{{"site": "snellius", "round": 1, "n_blocks": 1, "t_step_s": {number}}}'),
        (
            f"/v1/leases/{lease}/heartbeat",
            f'{{"site": "snellius", "consumed": 0, "t_step_s": {number}}}',
        ),
        *[
            (
                "/v1/rounds/1/deltas",
                json.dumps(
                    {
                        "site": "snellius",
                        "lease_id": lease,
                        "generation": 0,
                        "tokens": 10,
                        "steps": 1,
                        "consumed": 1,
                        "blob": "0" * 64,
                        field: "@",
                    }
                ).replace('"@"', number),
            )
            for field in ("loss", "compute_s")
        ],
    ]
    before = run_state(live)
    for path, body in requests:
        response = httpx.post(
            live.url + path,
            headers={**bearer(live, "snellius"), **_raw_json(body)["headers"]},
            content=body.encode(),
        )
        assert response.status_code == 422, (path, body, response.text)
    for field in ("loss", "compute_s"):
        params = {
            "site": "snellius",
            "lease_id": lease,
            "generation": 0,
            "tokens": 10,
            "steps": 1,
            "consumed": 1,
            field: number.lower(),
        }
        response = httpx.post(
            f"{live.url}/v1/rounds/1/deltas/inline",
            headers={**bearer(live, "snellius"), "X-Content-SHA256": "0" * 64},
            params=params,
            content=b"",
        )
        assert 400 <= response.status_code < 500, (field, response.text)
    assert run_state(live) == before


def test_integers_beyond_64_bits_are_4xx(live: LiveCoordinator, held: dict) -> None:
    before = run_state(live)
    site = bearer(live, "snellius")
    delta = {
        "site": "snellius",
        "lease_id": held["lease_id"],
        "generation": 0,
        "tokens": 10,
        "steps": 1,
        "consumed": 1,
        "blob": "0" * 64,
    }
    answers = [
        httpx.get(f"{live.url}/v1/rounds/{BIG}", headers=site),
        httpx.get(f"{live.url}/v1/models/{BIG}", headers=site),
        httpx.post(
            f"{live.url}/v1/leases/{BIG}/heartbeat",
            headers=site,
            json={"site": "snellius", "consumed": 0},
        ),
        httpx.post(f"{live.url}/v1/leases/{BIG}/release", headers=site, json={"site": "snellius"}),
        httpx.post(
            f"{live.url}/v1/leases",
            headers=site,
            json={"site": "snellius", "round": BIG, "n_blocks": 1},
        ),
        httpx.post(
            f"{live.url}/v1/leases/{held['lease_id']}/heartbeat",
            headers=site,
            json={"site": "snellius", "consumed": BIG},
        ),
        *[
            httpx.post(f"{live.url}/v1/rounds/1/deltas", headers=site, json={**delta, key: BIG})
            for key in ("lease_id", "generation", "tokens", "steps", "consumed")
        ],
        httpx.post(
            f"{live.url}/v1/rounds/{BIG}/deltas/inline",
            headers={**site, "X-Content-SHA256": "0" * 64},
            params={**{k: v for k, v in delta.items() if k != "blob"}, "lease_id": BIG},
            content=b"",
        ),
    ]
    for answer in answers:
        assert 400 <= answer.status_code < 500, (answer.request.url, answer.text)
    assert run_state(live) == before


# ------------------------------------------------------------------ generations, rounds
def test_unknown_generations_and_rounds_are_404_or_409(live: LiveCoordinator, held: dict) -> None:
    before = run_state(live)
    site = bearer(live, "snellius")
    for generation in (1, 99, -1):
        response = httpx.get(f"{live.url}/v1/models/{generation}", headers=site)
        assert response.status_code == 404 and response.json()["error"] == "unknown_generation"
    assert httpx.get(f"{live.url}/v1/rounds/99", headers=site).status_code == 404
    for round_no in (2, 99):
        with pytest.raises(Refused) as refused:
            live.client("lumi").lease("lumi", round_no, 1, None, None)
        assert refused.value.status == 409 and refused.value.code == "round_not_open"
    assert run_state(live) == before


def test_a_delta_from_the_previous_generation_is_stale_after_a_merge(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """Round 1 merges without lumi; lumi's late delta (generation 0) is refused, nothing of it
    is committed, and its blocks go back to the pool."""
    g0 = global_model(run, 0, tmp_path)
    late = join_and_lease(run, "lumi", tiny_data)
    fast = join_and_lease(run, "snellius", tiny_data)
    submit(run, "snellius", fast, delta_file(tmp_path, g0, seed=1))
    run.client("lumi").release(late["lease_id"], "lumi")  # lets round 1 close at once
    wait_round_closed(run, 1)
    again = run.client("lumi").lease("lumi", 2, 2, None, None)["lease"]
    pool_before = run.client().status()["active_leases"]
    with pytest.raises(Refused) as refused:
        submit(run, "lumi", again, delta_file(tmp_path, g0, seed=2, name="late"), round_no=2)
    assert refused.value.status == 409 and refused.value.code == "stale_generation"
    status = run.client().status()
    assert status["generation"] == 1
    assert status["blocks_committed_total"] == fast["n_blocks"]
    assert [x["site"] for x in pool_before] == ["lumi"] and status["active_leases"] == []
    with pytest.raises(Refused) as refused:
        submit(run, "lumi", late, delta_file(tmp_path, g0, seed=3, name="older"))
    assert refused.value.status in (404, 409)
    assert run.client().round_info(1)["report"]["contributors"] == ["snellius"]


# ------------------------------------------------------------------------ body sizes
def _raw_request(url: str, head: str, body: bytes = b"", timeout_s: float = 20.0) -> str:
    """Send raw HTTP/1.1 bytes and return the status line and headers of the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    return received.decode("latin-1")


def _head(method: str, path: str, token: str | None, **headers: str) -> str:
    lines = [f"{method} {path} HTTP/1.1", "Host: coordinator"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return "\r\n".join(lines) + "\r\n"


def test_oversized_bodies_are_413_before_they_are_read(live: LiveCoordinator) -> None:
    before, blobs = run_state(live), blob_files(live)
    site = live.secrets["sites"]["snellius"]
    # headers only, a body that never comes: the answer cannot have waited for it
    for method, path, size in (
        ("POST", "/v1/leases", 10**9),
        ("POST", "/v1/run", 2 * 1024**2),
        ("PUT", f"/v1/blobs/{'0' * 64}", 10**13),
        ("POST", "/v1/rounds/1/deltas/inline?site=snellius", 10**13),
    ):
        head = _head(method, path, site, Content_Type="application/json", Content_Length=str(size))
        answer = _raw_request(live.url, head)
        assert answer.startswith("HTTP/1.1 413"), (path, answer[:200])
    # without a token the gate answers first: 401, still nothing read
    answer = _raw_request(
        live.url, _head("PUT", f"/v1/blobs/{'0' * 64}", None, Content_Length="9" * 12)
    )
    assert answer.startswith("HTTP/1.1 401")
    # a chunked JSON body is cut off once it passes the limit
    chunk = b"[" + b"1," * (1024**2) + b"1]"
    head = _head(
        "POST", "/v1/leases", site, Content_Type="application/json", Transfer_Encoding="chunked"
    )
    body = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n"
    assert _raw_request(live.url, head, body).startswith("HTTP/1.1 413")
    assert run_state(live) == before and blob_files(live) == blobs
    counts = httpx.get(f"{live.url}/v1/admin/http", headers=bearer(live)).json()
    assert counts["by_status"].get("413", 0) >= 5


def test_a_client_hanging_up_mid_body_is_499_not_a_server_error(
    live: LiveCoordinator, held: dict
) -> None:
    before = httpx.get(f"{live.url}/v1/admin/http", headers=bearer(live)).json()
    log = live.state_dir / "coordinator.log"
    logged = log.read_text().count("http_5xx")
    site = live.secrets["sites"]["snellius"]
    for path in (
        f"/v1/rounds/1/deltas/inline?site=snellius&lease_id={held['lease_id']}"
        "&generation=0&tokens=10&steps=1&consumed=1",
        f"/v1/blobs/{'1' * 64}?offset=0&total=100000",
        f"/v1/leases/{held['lease_id']}/heartbeat",
    ):
        method = "PUT" if "/blobs/" in path else "POST"
        head = _head(method, path, site, Content_Length="100000", X_Content_Digest="1" * 64)
        host, port = live.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            sock.sendall(head.encode() + b"\r\n" + b"x" * 1000)
            time.sleep(0.5)  # the route is reading the body when the client goes
    deadline = time.monotonic() + 20
    while True:
        after = httpx.get(f"{live.url}/v1/admin/http", headers=bearer(live)).json()
        closed = after["by_status"].get("499", 0) - before["by_status"].get("499", 0)
        if closed >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert closed >= 2, after["by_status"]
    assert after["http_5xx"] == before["http_5xx"]
    assert log.read_text().count("http_5xx") == logged


# ------------------------------------------------------------------ the guards alone
def _asgi_call(app, scope: dict) -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def test_status_counter_counts_hang_ups_apart_and_lets_errors_through(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stats = StatusStats()

    async def hang_up(scope, receive, send) -> None:
        raise ClientDisconnect()

    async def broken(scope, receive, send) -> None:
        raise RuntimeError("bug")

    scope = {"type": "http", "method": "POST", "path": "/v1/x", "query_string": b"token=s3"}
    assert _asgi_call(StatusCounter(hang_up, stats), scope) == []
    with pytest.raises(RuntimeError):
        _asgi_call(StatusCounter(broken, stats), scope)
    snapshot = stats.snapshot()
    assert snapshot["by_status"] == {"499": 1, "500": 1} and snapshot["http_5xx"] == 1
    assert "http_5xx status=500 POST /v1/x" in caplog.text and "s3" not in caplog.text


def test_bodies_that_are_not_utf8_or_not_json_are_4xx(live: LiveCoordinator, held: dict) -> None:
    before = run_state(live)
    site = {**bearer(live, "snellius"), "Content-Type": "application/json"}
    for path in (
        f"/v1/leases/{held['lease_id']}/heartbeat",
        "/v1/leases",
        "/v1/sites/snellius/register",
        "/v1/rounds/1/deltas",
        "/v1/run",
    ):
        for body in (b"\xf2\x80\xff", b'{"site": "\xff"}', b"[]", b"null", b"\x00" * 8):
            response = httpx.post(live.url + path, headers=site, content=body)
            assert 400 <= response.status_code < 500, (path, body, response.text[:200])
    assert run_state(live) == before
