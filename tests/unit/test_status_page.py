"""The live status page: its state, its sign-in, and what headless Chromium renders."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from crossfed.coordinator.status_page import COOKIE, page_state, session_value, state_json
from tests.conftest import REPO, LiveCoordinator
from tests.helpers.fake_coordinator import FakeCoordinator
from tests.unit.test_coordinator_http import (
    delta_file,
    global_model,
    join_and_lease,
    submit,
    wait_round_closed,
)

ARTIFACTS = REPO / "results" / "test-artifacts"


# ------------------------------------------------------------------------ pure parts
def fake_coordinator(run: bool = True) -> FakeCoordinator:
    """The four read-only views the page uses, with fixed answers."""
    lease = {"lease_id": 7, "site": "lumi", "round": 3, "consumed": 1, "n_blocks": 4}
    return FakeCoordinator(
        run=run,
        round_no=3,
        generation=2,
        leases=[{**lease, "expires_at": 1030.0}],
        sites=[
            {"site": "lumi", "ranks": 2, "rtt_ms": 70.0, "t_step_s": 0.5, "last_seen": 500.0},
            {"site": "old", "ranks": 1, "rtt_ms": None, "t_step_s": None, "last_seen": 900.0},
            {"site": "snellius", "ranks": 1, "rtt_ms": 3.0, "t_step_s": 0.2, "last_seen": 995.0},
        ],
        ledger=[{"site": "total", "rtt_ms": None}],
        history=[{"round": 1, "loss": float("nan"), "site_loss": {"lumi": 3.0}}],
    )


def test_page_state_marks_live_sites_and_lease_progress() -> None:
    state = page_state(fake_coordinator(), {"http_5xx": 0}, now=1000.0)
    sites = {s["site"]: s for s in state["sites"]}
    assert sites["lumi"]["live"]  # holds a lease although last heard of 500 s ago
    assert sites["snellius"]["live"] and not sites["old"]["live"]
    assert sites["lumi"]["leases"] == [
        {"lease_id": 7, "round": 3, "consumed": 1, "n_blocks": 4, "expires_in_s": 30.0}
    ]
    assert state["status"] == {"round": 3, "generation": 2}
    assert state["http"] == {"http_5xx": 0}
    assert json.loads(state_json(state))["history"][0]["loss"] is None  # NaN cannot be JSON


def test_page_state_without_a_run() -> None:
    state = page_state(fake_coordinator(run=False), now=5.0)
    assert state == {"run": False, "now": 5.0, "http": {}}


def test_state_json_cannot_close_its_script_element() -> None:
    text = state_json({"site": "</script><script>alert(1)</script>", "x": "a&b"})
    assert "</script" not in text and "<" not in text and "&" not in text
    assert json.loads(text)["site"] == "</script><script>alert(1)</script>"


def test_the_session_cookie_is_not_the_token() -> None:
    assert session_value("secret") == session_value("secret") != "secret"
    assert "secret" not in session_value("secret")
    assert session_value("secret") != session_value("other")


# --------------------------------------------------------------------------- live page
@pytest.fixture
def busy(run: LiveCoordinator, tiny_data: Path, tmp_path: Path) -> LiveCoordinator:
    """Round 1 merged from two sites; frontier holds a lease in round 2."""
    return merge_round_one_and_lease_round_two(run, tiny_data, tmp_path)


def merge_round_one_and_lease_round_two(
    run: LiveCoordinator, tiny_data: Path, tmp_path: Path
) -> LiveCoordinator:
    """snellius and lumi merge round 1 (3:1 tokens); frontier then holds a round-2 lease."""
    g0 = global_model(run, 0, tmp_path)
    a = join_and_lease(run, "snellius", tiny_data)
    b = join_and_lease(run, "lumi", tiny_data)
    submit(run, "snellius", a, delta_file(tmp_path, g0, seed=1, name="a"), tokens=240)
    submit(run, "lumi", b, delta_file(tmp_path, g0, seed=2, name="b"), tokens=80)
    wait_round_closed(run, 1)
    lease = join_and_lease(run, "frontier", tiny_data, round_no=2)
    run.client("frontier").heartbeat(lease["lease_id"], "frontier", 1, None)  # keeps 60 s TTL
    return run


def signed_in(live: LiveCoordinator) -> httpx.Client:
    client = httpx.Client(base_url=live.url)
    response = client.get("/v1/ui", params={"token": live.secrets["admin"]})
    assert response.status_code == 303 and response.headers["location"] == "/v1/ui"
    return client


def test_sign_in_sets_a_strict_httponly_cookie_that_opens_only_the_page(
    busy: LiveCoordinator,
) -> None:
    anonymous = httpx.get(f"{busy.url}/v1/ui")
    assert anonymous.status_code == 401 and 'name="token"' in anonymous.text
    assert "snellius" not in anonymous.text
    site = httpx.get(f"{busy.url}/v1/ui", params={"token": busy.secrets["sites"]["lumi"]})
    assert site.status_code == 401 and "set-cookie" not in site.headers
    assert httpx.get(f"{busy.url}/v1/ui/state").status_code == 401
    assert httpx.get(f"{busy.url}/v1/ui/status.js").status_code == 401

    client = httpx.Client(base_url=busy.url)
    login = client.post("/v1/ui/login", data={"token": busy.secrets["admin"]})
    assert login.status_code == 303
    cookie = login.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}={session_value(busy.secrets['admin'])};")
    assert re.search(r"(?i)httponly", cookie) and re.search(r"(?i)samesite=strict", cookie)
    assert "Path=/v1/ui" in cookie and "secure" not in cookie.lower()  # plain HTTP here

    page = client.get("/v1/ui")
    assert page.status_code == 200
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["cache-control"] == "no-store"
    assert client.get("/v1/ui/status.js").status_code == 200
    # the cookie opens the page's routes only: the API still wants a bearer token
    assert client.get("/v1/status").status_code == 401
    assert client.get("/v1/ledger").status_code == 401
    out = client.post("/v1/ui/logout")
    assert out.status_code == 303 and "Max-Age=0" in out.headers["set-cookie"]


def test_state_shows_round_sites_leases_ledger_and_losses(busy: LiveCoordinator) -> None:
    state = signed_in(busy).get("/v1/ui/state").json()
    assert state["run"] is True
    assert state["status"]["round"] == 2 and state["status"]["generation"] == 1
    sites = {s["site"]: s for s in state["sites"]}
    assert set(sites) == {"snellius", "lumi", "frontier"}
    assert all(s["live"] for s in sites.values()) and sites["lumi"]["rtt_ms"] == 1.0
    (lease,) = sites["frontier"]["leases"]
    assert lease["round"] == 2 and lease["consumed"] == 1 and lease["n_blocks"] == 2
    assert sites["snellius"]["leases"] == []
    ledger = {row["site"]: row for row in state["ledger"]}
    assert set(ledger) == {"snellius", "lumi", "frontier", "total"}
    assert ledger["total"]["blocks_committed"] == 4
    (round_1,) = state["history"]
    assert round_1["round"] == 1 and round_1["loss"] == pytest.approx(3.0)
    assert round_1["site_loss"] == {"snellius": 3.0, "lumi": 3.0}
    assert state["http"]["http_5xx"] == 0 and state["http"]["requests"] > 5


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("Chromium is not installed (scripts/install-system-deps.sh installs it)")
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    cmd = [
        exe,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-quic",
        f"--user-data-dir={profile}",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def test_headless_chromium_renders_the_page(busy: LiveCoordinator, tmp_path: Path) -> None:
    url = f"{busy.url}/v1/ui?token={busy.secrets['admin']}"
    dom = chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", url)
    html = dom.stdout
    assert '<span id="round" class="value">2</span>' in html, dom.stderr[-2000:]
    assert '<span id="generation" class="value">1</span>' in html
    assert '<span id="epoch" class="value">0</span>' in html and "counted from 0" in html
    assert '<span id="epochs-before" class="label">the first</span>' in html
    sites_table = html[html.index('<table id="sites">') : html.index('<table id="ledger">')]
    for site in ("snellius", "lumi", "frontier"):
        assert f'<tr data-site="{site}">' in sites_table
    assert "1/2" in sites_table  # frontier's lease progress
    ledger = html[html.index('<table id="ledger">') : html.index('<table id="rounds">')]
    assert len(re.findall(r'<tr data-site="', ledger)) == 4
    assert '<tr data-site="total" class="total">' in ledger
    assert re.search(r'<tr data-round="1">', html)
    assert "<polyline" in html and "round mean" in html
    assert busy.secrets["admin"] not in html  # the token stays out of the page

    shot = tmp_path / "status-page.png"
    done = chromium(
        tmp_path,
        f"--screenshot={shot}",
        "--window-size=1200,900",
        "--virtual-time-budget=5000",
        "--hide-scrollbars",
        url,
    )
    assert shot.exists() and shot.stat().st_size > 10_000, done.stderr[-2000:]
    try:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, ARTIFACTS / "status-page.png")
    except OSError:
        pass  # a read-only checkout keeps the screenshot in the pytest tmp dir only
