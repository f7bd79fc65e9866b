"""Security of the coordinator: what is public, TLS, secrets in logs, sites kept apart."""

from __future__ import annotations

import re
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from crossfed.client.http import CoordinatorClient, Refused
from crossfed.coordinator.app import Tokens, create_app
from crossfed.coordinator.embedded import ensure_secrets, free_port
from crossfed.coordinator.service import Coordinator
from crossfed.coordinator.status_page import session_value
from crossfed.testing.tls import self_signed
from crossfed.wire.digests import digest_file
from tests.conftest import REPO, SITES, LiveCoordinator, tiny_spec
from tests.unit.test_coordinator_http import delta_file, global_model, join_and_lease, submit

BIN = Path(sys.executable).parent


def app_routes(tmp_path: Path) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, taken from the app itself."""
    app = create_app(Coordinator(tmp_path / "routes"), Tokens("admin-token", {}))
    routes = []
    for route in app.routes:
        for method in sorted((getattr(route, "methods", None) or {"GET"}) - {"HEAD"}):
            routes.append((method, route.path))
    return routes


def concrete(path: str) -> str:
    path = path.replace("{key}", "0" * 64).replace("{site}", "lumi")
    return re.sub(r"\{[^}]+\}", "1", path)


def test_every_route_but_health_needs_a_token(run: LiveCoordinator, tmp_path: Path) -> None:
    routes = app_routes(tmp_path)
    paths = {path for _, path in routes}
    assert {"/v1/health", "/v1/status", "/openapi.json", "/v1/ui", "/v1/ui/state"} <= paths
    assert "/docs" not in paths and "/redoc" not in paths
    probes = [*routes, ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/v1/nope"), ("GET", "/")]
    for method, path in probes:
        for headers in ({}, {"Authorization": "Bearer not-a-token"}, {"Authorization": "x"}):
            response = httpx.request(
                method, run.url + concrete(path), headers=headers, json={}, timeout=30
            )
            if path == "/v1/health":
                assert response.status_code == 200
                continue
            assert response.status_code == 401, (method, path, headers, response.text[:200])
            assert "snellius" not in response.text and "digest" not in response.text


def test_openapi_needs_a_token_and_unknown_paths_stay_404(run: LiveCoordinator) -> None:
    site = {"Authorization": f"Bearer {run.secrets['sites']['lumi']}"}
    schema = httpx.get(f"{run.url}/openapi.json", headers=site).json()
    assert "/v1/leases" in schema["paths"]
    assert not any(p.startswith("/v1/ui") for p in schema["paths"])
    assert httpx.get(f"{run.url}/docs", headers=site).status_code == 404
    assert httpx.get(f"{run.url}/v1/nope", headers=site).status_code == 404


def test_tokens_in_the_query_string_do_not_open_the_api(run: LiveCoordinator) -> None:
    admin = run.secrets["admin"]
    assert httpx.get(f"{run.url}/v1/status", params={"token": admin}).status_code == 401
    # ... and the status page takes only the admin's, never a site's
    response = httpx.get(f"{run.url}/v1/ui", params={"token": run.secrets["sites"]["lumi"]})
    assert response.status_code == 401 and "set-cookie" not in response.headers
    assert httpx.get(f"{run.url}/v1/admin/http", headers=_bearer(run, "lumi")).status_code == 403


def _bearer(live: LiveCoordinator, who: str) -> dict[str, str]:
    token = live.secrets["admin"] if who == "admin" else live.secrets["sites"][who]
    return {"Authorization": f"Bearer {token}"}


# ------------------------------------------------------------------------------------ TLS


def test_tls_with_a_self_signed_certificate(
    tmp_path: Path, tiny_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "coordinator"
    state.mkdir()
    secrets = ensure_secrets(state / "secrets.yaml", SITES)
    cert, key = self_signed(tmp_path)
    port = free_port("127.0.0.1")
    cmd = [
        sys.executable,
        "-m",
        "crossfed",
        "coordinator",
        "serve",
        "--state-dir",
        str(state),
        "--secrets",
        str(state / "secrets.yaml"),
        "--port",
        str(port),
        "--ssl-certfile",
        str(cert),
        "--ssl-keyfile",
        str(key),
    ]
    log = open(state / "coordinator.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    trust = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (state / "coordinator.log").read_text()[-3000:]
            try:
                health = httpx.get(f"{url}/v1/health", verify=trust, timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "TLS coordinator did not start"
                time.sleep(0.2)
        assert health.json()["ok"] is True
        # an untrusted certificate is refused by a default client; plain HTTP gets no answer
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/v1/health", timeout=5)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=5)
        # a site trusts a private CA with SSL_CERT_FILE; the whole client works over TLS
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        admin = CoordinatorClient(url, secrets["admin"], retry_budget_s=5)
        assert admin.init_run(tiny_spec(tiny_data).to_dict())["created"] is True
        assert admin.status()["round"] == 1
        model = admin.download_model(0, tmp_path / "g0.safetensors")
        assert model.stat().st_size > 0
        # the status page's cookie is Secure under TLS
        login = httpx.get(
            f"{url}/v1/ui", params={"token": secrets["admin"]}, verify=trust, timeout=10
        )
        cookie = login.headers["set-cookie"].lower()
        assert login.status_code == 303
        assert "secure" in cookie and "httponly" in cookie and "samesite=strict" in cookie
        admin.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# ------------------------------------------------------------------------------ secrets
def secret_values(live: LiveCoordinator) -> list[str]:
    admin = live.secrets["admin"]
    return [admin, session_value(admin), *live.secrets["sites"].values()]


def assert_no_secrets(text: str, secrets: list[str], where: str) -> None:
    for secret in secrets:
        assert secret not in text, f"a token appears in {where}"


def cli_config(live: LiveCoordinator, tiny_data: Path, tmp: Path) -> Path:
    """A run config pointing at ``live`` with the tiny data set and the tiny spec."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["results"] = str(tmp / "results")
    config["sites_file"] = str(REPO / "config" / "sites.yaml")
    config["data"].update(dir=str(tiny_data), vocab_size=512, seq_len=32, block_size=8, seed=7)
    config["inner"].update(steps=4)
    config["coordinator"].update(url=live.url, secrets=str(live.state_dir / "secrets.yaml"))
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_tokens_never_appear_in_the_coordinator_or_cli_logs(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    secrets = secret_values(run)
    wrong = "wrong-token-" + "x" * 30
    # refused and accepted requests of every kind, with tokens in headers, query and form
    httpx.get(f"{run.url}/v1/status", headers={"Authorization": f"Bearer {wrong}"})
    httpx.get(f"{run.url}/v1/ui", params={"token": wrong})
    httpx.get(f"{run.url}/v1/ui", params={"token": run.secrets["admin"]})
    httpx.post(f"{run.url}/v1/ui/login", data={"token": run.secrets["admin"]})
    for site in SITES:
        with pytest.raises(Refused):
            run.client(site).lease(site, 99, 1, None, None)
    run.client().status()
    config = cli_config(run, tiny_data, tmp_path)
    for command in (["status"], ["ledger"]):
        log = tmp_path / f"{command[0]}.log"
        done = subprocess.run(
            [str(BIN / "crossfed"), "-v", "--log", str(log), *command, "--config", str(config)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "DEBUG" in log.read_text()  # verbose logging really was on
        assert_no_secrets(done.stdout + done.stderr + log.read_text(), secrets, command[0])
    coordinator_log = (run.state_dir / "coordinator.log").read_text()
    assert_no_secrets(coordinator_log, [*secrets, wrong], "the coordinator log")


@pytest.mark.slow
def test_a_site_job_logs_no_tokens(run: LiveCoordinator, tiny_data: Path, tmp_path: Path) -> None:
    config = cli_config(run, tiny_data, tmp_path)
    log = tmp_path / "site.log"
    cmd = [str(BIN / "crossfed"), "-v", "--log", str(log), "site", "run", "--config", str(config)]
    cmd += ["--site", "snellius", "--round", "1", "--out", str(tmp_path / "outcome.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "accepted" in done.stdout
    text = done.stdout + done.stderr + log.read_text()
    assert_no_secrets(text, secret_values(run), "the site job's output")
    assert_no_secrets(
        (run.state_dir / "coordinator.log").read_text(), secret_values(run), "coordinator log"
    )


# ----------------------------------------------------------------------- sites kept apart
def test_a_site_can_neither_read_nor_touch_another_sites_leases_or_deltas(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> None:
    g0 = global_model(run, 0, tmp_path)
    theirs = join_and_lease(run, "snellius", tiny_data)
    mine = join_and_lease(run, "lumi", tiny_data)
    lumi = run.client("lumi")
    # leases: a foreign lease can be neither heartbeaten, released nor committed
    for call in (
        lambda: lumi.heartbeat(theirs["lease_id"], "lumi", 1, None),
        lambda: lumi.heartbeat(theirs["lease_id"], "snellius", 1, None),
        lambda: lumi.release(theirs["lease_id"], "lumi"),
        lambda: lumi.release(theirs["lease_id"], "snellius"),
    ):
        with pytest.raises(Refused) as refused:
            call()
        assert refused.value.status in (403, 409)
    theft = delta_file(tmp_path, g0, seed=9, name="theft")
    with pytest.raises(Refused) as refused:
        submit(run, "lumi", theirs, theft)
    assert refused.value.status == 403 and refused.value.code == "not_owner"
    # reading: a site sees its own lease only; the admin sees both
    assert [x["lease_id"] for x in lumi.status()["active_leases"]] == [mine["lease_id"]]
    assert len(run.client().status()["active_leases"]) == 2
    held = {x["lease_id"]: x for x in run.client().status()["active_leases"]}
    assert held[theirs["lease_id"]]["consumed"] == 0  # the foreign heartbeat changed nothing
    # deltas: once snellius's delta is in, lumi can neither see, replace nor reuse it
    theirs_path = delta_file(tmp_path, g0, seed=1, name="theirs")
    assert submit(run, "snellius", theirs, theirs_path)["accepted"]
    blob = run.state_dir / "blobs"
    stored = {p.name: p.read_bytes() for p in blob.rglob("*") if p.is_file()}
    key = digest_file(theirs_path)
    assert lumi.round_info(1)["deltas"] == []
    assert [d["site"] for d in run.client().round_info(1)["deltas"]] == ["snellius"]
    overwrite = httpx.put(
        f"{run.url}/v1/blobs/{key}", headers=_bearer(run, "lumi"), content=b"not the delta"
    )
    assert overwrite.status_code == 409  # a complete blob is never rewritten
    assert overwrite.json()["error"] == "blob_exists"
    read = httpx.get(f"{run.url}/v1/blobs/{key}", headers=_bearer(run, "lumi"))
    assert read.status_code == 403
    own = httpx.get(f"{run.url}/v1/blobs/{key}", headers=_bearer(run, "snellius"))
    assert own.is_success and own.content == theirs_path.read_bytes()
    with pytest.raises(Refused) as refused:
        submit(run, "lumi", theirs, theft)
    assert refused.value.status in (403, 409)
    assert {p.name: p.read_bytes() for p in blob.rglob("*") if p.is_file()} == stored
    info = run.client().round_info(1)
    assert [(d["site"], d["tokens"]) for d in info["deltas"]] == [("snellius", 256)]
