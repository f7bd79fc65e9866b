"""Claims a site cannot inflate, and clean 4xx on every route (a real coordinator process).

A delta's tokens weigh it in the average and its steps move the global step: both are
bounded by the blocks it commits. Every refusal has one body shape, keeps the connection,
and changes nothing; a site sees only its own blobs.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import httpx
import pytest

from crossfed.client.http import Refused
from crossfed.coordinator.embedded import wait_until_serving
from crossfed.darl.blockspace import BlockSpace
from crossfed.data.windows import read_meta
from crossfed.wire.digests import digest_file
from tests.conftest import LiveCoordinator, digest_of
from tests.unit.test_coordinator_http import delta_file, global_model, join_and_lease, submit
from tests.unit.test_fuzz import run_state

SEQ_LEN = 32  # tiny_data's windows
BLOCK = 8  # tiny_spec's block size


def lease_windows(data: Path, lease: dict, consumed: int) -> int:
    """Windows in the first ``consumed`` blocks of a lease (the last block may be short)."""
    space = BlockSpace(read_meta(data)["n_windows"], BLOCK, 7)
    return sum(len(space.block_windows(b)) for b in lease["blocks"][:consumed])


def bearer(live: LiveCoordinator, who: str) -> dict[str, str]:
    token = live.secrets["admin"] if who == "admin" else live.secrets["sites"][who]
    return {"Authorization": f"Bearer {token}"}


def stored_files(live: LiveCoordinator) -> list[str]:
    """Every file under the blob store, partial uploads included."""
    root = live.state_dir / "blobs"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def inline_params(who: str, lease: dict, **overrides) -> dict:
    fields = dict(
        site=who, lease_id=lease["lease_id"], generation=0, tokens=32, steps=1, consumed=1
    )
    return {**fields, **overrides}


def assert_error_shape(response: httpx.Response | dict, status: int, code: str) -> dict:
    body = response if isinstance(response, dict) else response.json()
    if not isinstance(response, dict):
        assert response.status_code == status, response.text
    assert isinstance(body["error"], str) and isinstance(body["detail"], str), body
    assert body["error"] == code, body
    assert not body["detail"].startswith(f"{code}:"), body  # the code word once
    return body


# --------------------------------------------------------------------------- claims
def test_inflated_tokens_or_steps_are_422_and_change_nothing(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    g0 = global_model(run, 0, tmp_path)
    lease = join_and_lease(run, "snellius", tiny_data, n_blocks=2)
    one = lease_windows(tiny_data, lease, 1)  # claims below commit one block of the two
    path = delta_file(tmp_path, g0)
    key = digest_file(path)
    before, files = run_state(run), stored_files(run)
    client = run.client("snellius")
    claims = [
        (10**15, 10**6, f"{one * SEQ_LEN} tokens"),  # the claim for one block
        (one * SEQ_LEN + 1, 1, f"{one * SEQ_LEN} tokens"),
        (one * SEQ_LEN, one + 1, f"{one} windows"),
    ]
    for tokens, steps, limit in claims:
        fields = dict(tokens=tokens, steps=steps, consumed=1)
        with pytest.raises(Refused) as refused:  # by reference: refused before any upload
            client.submit_delta(
                1, path, inline=False, site="snellius", lease_id=lease["lease_id"],
                generation=0, loss=3.0, **fields,
            )  # fmt: skip
        assert refused.value.status == 422 and refused.value.code == "implausible_claim"
        assert (
            limit in refused.value.detail and f"lease {lease['lease_id']}" in refused.value.detail
        )
        inline = httpx.post(
            f"{run.url}/v1/rounds/1/deltas/inline",
            headers={**bearer(run, "snellius"), "X-Content-Digest": key},
            params=inline_params("snellius", lease, **fields),
            content=path.read_bytes(),
        )
        assert limit in assert_error_shape(inline, 422, "implausible_claim")["detail"]
        assert run_state(run) == before and stored_files(run) == files  # nothing stored
    status = run.client().status()
    assert [x["lease_id"] for x in status["active_leases"]] == [lease["lease_id"]]
    assert status["blocks_committed_total"] == 0 and status["global_step"] == 0
    # the most the committed blocks hold is a plausible claim, and is accepted
    both = lease_windows(tiny_data, lease, 2)
    reply = client.submit_delta(
        1, path, inline=True, site="snellius", lease_id=lease["lease_id"], generation=0,
        tokens=both * SEQ_LEN, steps=both, consumed=2, loss=3.0,
    )  # fmt: skip
    assert reply["accepted"] and not reply["already"]
    deltas = run.client().round_info(1)["deltas"]
    assert [(d["tokens"], d["steps"]) for d in deltas] == [(both * SEQ_LEN, both)]


def test_a_site_runs_more_inner_steps_than_h_when_its_lease_holds_them(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """H = 4, but a lease rounded up to whole blocks (or paced up to 4x the request) holds
    more windows than H steps take, and the site trains them all: steps past H are real."""
    g0 = global_model(run, 0, tmp_path)
    lease = join_and_lease(run, "lumi", tiny_data, n_blocks=3)
    # both leases are held before either delta goes in: a round with no active lease left
    # closes once its join window has passed, which a busy machine can reach in between
    other = join_and_lease(run, "snellius", tiny_data, n_blocks=2)
    windows = lease_windows(tiny_data, lease, 3)
    assert windows > 4
    reply = submit(run, "lumi", lease, delta_file(tmp_path, g0), tokens=windows * SEQ_LEN)
    assert reply["accepted"]
    # ... and submit() claims 4 steps; a site with one window per step claims one per window
    steps = lease_windows(tiny_data, other, 2)
    answer = run.client("snellius").submit_delta(
        1, delta_file(tmp_path, g0, seed=5, name="b"), inline=False, site="snellius",
        lease_id=other["lease_id"], generation=0, tokens=steps * SEQ_LEN, steps=steps, consumed=2,
    )  # fmt: skip
    assert answer["accepted"] and steps > 4


def test_steps_are_bounded_by_the_ranks_the_site_leased_with(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    """A site of 4 ranks trains at least 4 windows a step: a delta claiming more steps than
    its windows / 4 is refused; the bound is the lease's, so a job that registers again
    with more ranks (a bigger shape) can still resend the delta its predecessor trained."""
    g0 = global_model(run, 0, tmp_path)
    client = run.client("lumi")
    client.register("lumi", digest_of(tiny_data), 4, 1.0)
    lease = client.lease("lumi", 1, 3, None, 1.0)["lease"]
    windows = lease_windows(tiny_data, lease, 3)
    most = -(-windows // 4)
    assert most < windows  # the bound is tighter than one window per step
    path = delta_file(tmp_path, g0)
    fields = dict(site="lumi", lease_id=lease["lease_id"], generation=0,
                  tokens=windows * SEQ_LEN, consumed=3, loss=3.0)  # fmt: skip
    before = run_state(run)
    with pytest.raises(Refused) as refused:
        client.submit_delta(1, path, inline=False, steps=most + 1, **fields)
    assert refused.value.code == "implausible_claim"
    assert f"{most} (every inner step" in refused.value.detail and "4 rank" in refused.value.detail
    assert run_state(run) == before
    client.register("lumi", digest_of(tiny_data), 8, 1.0)  # the next job: a bigger shape
    assert client.submit_delta(1, path, inline=False, steps=most, **fields)["accepted"]
    assert [d["steps"] for d in run.client().round_info(1)["deltas"]] == [most]


# ------------------------------------------------------------ query values, keep-alive
BAD_QUERIES = [
    ({"tokens": 0}, "tokens"),
    ({"tokens": -5}, "tokens"),
    ({"tokens": 2**64}, "tokens"),
    ({"steps": 0}, "steps"),
    ({"consumed": 0}, "consumed"),
    ({"loss": "nan"}, "loss"),
    ({"loss": "inf"}, "loss"),
    ({"compute_s": -1}, "compute_s"),
    ({"lease_id": -1}, "lease_id"),
    ({"generation": -1}, "generation"),
    ({"generation": 2**64}, "generation"),
    ({"site": ""}, "site"),
]


def test_out_of_range_inline_queries_are_422_before_the_body_is_stored_and_keep_alive(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    g0 = global_model(run, 0, tmp_path)
    lease = join_and_lease(run, "lumi", tiny_data)
    path = delta_file(tmp_path, g0)
    body = path.read_bytes()
    headers = {**bearer(run, "lumi"), "X-Content-Digest": digest_file(path)}
    before, files = run_state(run), stored_files(run)
    host, port = run.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.connect()
    sock = conn.sock
    try:
        for overrides, field in BAD_QUERIES:
            query = httpx.QueryParams(inline_params("lumi", lease, **overrides))
            conn.request("POST", f"/v1/rounds/1/deltas/inline?{query}", body, headers)
            answer = conn.getresponse()
            data = json.loads(answer.read())
            assert answer.status == 422, (overrides, data)
            assert field in assert_error_shape(data, 422, "invalid_request")["detail"]
            assert not answer.will_close, overrides
            # the same connection serves the next request
            conn.request("GET", "/v1/status", headers=bearer(run, "lumi"))
            status = conn.getresponse()
            assert status.status == 200 and json.loads(status.read())["round"] == 1
            assert conn.sock is sock, f"the connection was dropped after {overrides}"
    finally:
        conn.close()
    assert run_state(run) == before and stored_files(run) == files
    # the same request with valid values goes through
    reply = httpx.post(
        f"{run.url}/v1/rounds/1/deltas/inline",
        headers=headers,
        params=inline_params("lumi", lease),
        content=body,
    )
    assert reply.status_code == 200 and reply.json()["accepted"], reply.text


# ---------------------------------------------------------------- one error shape
def test_every_refusal_has_one_body_shape_and_bearer_is_case_insensitive(
    run: LiveCoordinator, tiny_data: Path
) -> None:
    site = bearer(run, "lumi")
    url = run.url
    assert_error_shape(httpx.get(f"{url}/v1/nope", headers=site), 404, "not_found")
    assert_error_shape(httpx.delete(f"{url}/v1/status", headers=site), 405, "method_not_allowed")
    assert_error_shape(httpx.get(f"{url}/v1/status"), 401, "unauthenticated")
    invalid = httpx.post(f"{url}/v1/leases", headers=site, json={"site": "lumi", "round": 1})
    assert "n_blocks" in assert_error_shape(invalid, 422, "invalid_request")["detail"]
    assert invalid.json()["errors"][0]["loc"] == ["body", "n_blocks"]
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:  # a declared length over the limit: refused before a byte of the body is sent
        conn.putrequest("POST", "/v1/leases")
        for name, value in {**site, "Content-Length": str(2 * 1024**2)}.items():
            conn.putheader(name, value)
        conn.endheaders()
        answer = conn.getresponse()
        assert answer.status == 413
        assert (
            "limit"
            in assert_error_shape(json.loads(answer.read()), 413, "body_too_large")["detail"]
        )
    finally:
        conn.close()
    # a chunked body has no length to refuse up front: it is cut off at the limit
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        chunks = iter([b"[" + b"1," * (1024**2), b"1]"])
        conn.request("POST", "/v1/leases", chunks, {**site, "Content-Type": "application/json"})
        answer = conn.getresponse()
        assert_error_shape({**json.loads(answer.read())}, 413, "body_too_large")
        assert answer.status == 413
    finally:
        conn.close()
    # lease book refusals name their code once
    join_and_lease(run, "lumi", tiny_data)
    theirs = join_and_lease(run, "snellius", tiny_data)
    for lease_id, code in ((10**6, "unknown_lease"), (theirs["lease_id"], "not_owner")):
        beat = httpx.post(
            f"{url}/v1/leases/{lease_id}/heartbeat",
            headers=site,
            json={"site": "lumi", "consumed": 0},
        )
        assert_error_shape(beat, 409, code)
    # RFC 7235: the scheme name is case-insensitive, on the gate and on every route
    token = run.secrets["sites"]["lumi"]
    mine = run.client("lumi").status()["active_leases"][0]
    for scheme in ("bearer", "BEARER", "BeArEr"):
        auth = {"Authorization": f"{scheme} {token}"}
        assert httpx.get(f"{url}/v1/status", headers=auth).status_code == 200
        assert httpx.get(f"{url}/v1/ledger", headers=auth).status_code == 200
        beat = httpx.post(
            f"{url}/v1/leases/{mine['lease_id']}/heartbeat",
            headers=auth,
            json={"site": "lumi", "consumed": 0},
        )
        assert beat.status_code == 200, beat.text
    assert httpx.get(f"{url}/v1/status", headers={"Authorization": token}).status_code == 401


# ------------------------------------------------------------------ blobs: who sees what
def test_blobs_are_private_to_their_uploader_and_a_key_names_one_content(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    g0 = global_model(run, 0, tmp_path)
    mine = join_and_lease(run, "lumi", tiny_data)
    theirs = join_and_lease(run, "snellius", tiny_data)
    path = delta_file(tmp_path, g0, seed=3)
    data = path.read_bytes()
    lumi, snellius = run.client("lumi"), run.client("snellius")
    key = lumi.upload_blob(path)  # uploaded, not submitted
    blob = f"{run.url}/v1/blobs/{key}"
    # the same bytes again: the finished upload's answer; other bytes: 409, nothing changes
    again = httpx.put(blob, headers=bearer(run, "lumi"), content=data)
    assert again.status_code == 201 and again.json()["complete"] is True
    for other in (b"not the delta", data[:-1], data + b"x", data[:-1] + bytes([data[-1] ^ 1])):
        conflict = httpx.put(blob, headers=bearer(run, "lumi"), content=other)
        assert_error_shape(conflict, 409, "blob_exists")
    assert httpx.get(blob, headers=bearer(run, "lumi")).content == data
    # snellius: neither the bytes nor the state, no part of it, no use of it as its delta
    assert_error_shape(httpx.get(blob, headers=bearer(run, "snellius")), 403, "forbidden")
    assert_error_shape(
        httpx.get(f"{blob}/state", headers=bearer(run, "snellius")), 403, "forbidden"
    )
    probe = httpx.put(
        blob, headers=bearer(run, "snellius"), params={"offset": 10, "total": len(data)},
        content=data[10:20],
    )  # fmt: skip
    assert_error_shape(probe, 403, "forbidden")
    prefix = httpx.put(
        blob, headers=bearer(run, "snellius"), params={"offset": 0, "total": len(data)},
        content=data[:10],
    )  # fmt: skip
    assert_error_shape(prefix, 409, "blob_exists")  # only all of it compares equal
    overwrite = httpx.put(blob, headers=bearer(run, "snellius"), content=b"x" * len(data))
    assert_error_shape(overwrite, 409, "blob_exists")
    before = run_state(run)
    with pytest.raises(Refused) as refused:
        snellius.post(
            "/v1/rounds/1/deltas",
            {"site": "snellius", "lease_id": theirs["lease_id"], "generation": 0,
             "tokens": 32, "steps": 1, "consumed": 1, "blob": key},
        )  # fmt: skip
    assert refused.value.status == 404 and refused.value.code == "unknown_blob"
    assert run_state(run) == before
    # the admin sees everything
    assert httpx.get(blob, headers=bearer(run, "admin")).content == data
    assert httpx.get(f"{blob}/state", headers=bearer(run, "admin")).json()["complete"]
    # a partial upload is private too, also across a restart of the coordinator
    part = delta_file(tmp_path, g0, seed=4, name="part").read_bytes()
    part_key = digest_file(tmp_path / "part.safetensors")
    half = httpx.put(
        f"{run.url}/v1/blobs/{part_key}", headers=bearer(run, "lumi"),
        params={"offset": 0, "total": len(part)}, content=part[:1000],
    )  # fmt: skip
    assert half.status_code == 201 and half.json()["offset"] == 1000
    run.kill()
    run.restart()
    wait_until_serving(run.process, run.state_dir, "127.0.0.1", run.port, 240)
    assert lumi.blob_state(part_key)["offset"] == 1000
    for method, extra in (("GET", {}), ("PUT", {"content": part})):
        url = f"{run.url}/v1/blobs/{part_key}" + ("/state" if method == "GET" else "")
        answer = httpx.request(method, url, headers=bearer(run, "snellius"), **extra)
        assert_error_shape(answer, 403, "forbidden")
    assert lumi.blob_state(part_key)["offset"] == 1000  # snellius's PUT did not restart it
    # lumi's own delta goes through; shared views stay readable by both sites
    assert submit(run, "lumi", mine, path)["accepted"]
    for client in (lumi, snellius):
        assert client.round_info(1)["round_no"] == 1
        assert {row["site"] for row in client.ledger()} >= {"lumi", "snellius"}
        assert client.status()["round"] == 1
        assert client.download_model(0, tmp_path / f"g0-{id(client)}.safetensors").exists()
    assert [d["site"] for d in snellius.round_info(1)["deltas"]] == []
    assert [d["site"] for d in lumi.round_info(1)["deltas"]] == ["lumi"]
