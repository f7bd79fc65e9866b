"""A Frontier-like site's transfers through a real forward proxy, across an emulated long link.

The path a Frontier compute node's bytes take: the site -> an emulated link that stands for
the long haul and the load balancer in front of OLCF's proxy together (347 ms, a 1 MiB
window, so about 3 MB/s per connection, and every connection reset at two seconds: squid
itself does not cut its CONNECT tunnels) -> Debian's squid, a real forward proxy -> the
coordinator's real app serving HTTPS with a self-signed certificate. The window sits before
the proxy so that a cut connection has at most a window of bytes on their way. A 12 MiB
blob needs several connections either way: every transfer is cut, resumes where it
stopped, and arrives whole, stored once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from crossfed.client.http import CoordinatorClient
from crossfed.testing.squid import Squid, squid_binary
from crossfed.testing.tls import self_signed
from crossfed.testing.wan_emulator import EmulatorProcess, Link
from tests.helpers.live_app import SITE_TOKENS, Server

MiB = 1 << 20
LIFETIME_S = 2.0  # the load balancer's reaping age
SIZE = 12 * MiB  # at 1 MiB / 347 ms, about four seconds on one connection

pytestmark = pytest.mark.skipif(
    squid_binary() is None and not os.environ.get("CI"),
    reason="squid is not installed (scripts/install-system-deps.sh installs it)",
)


class FrontierPath:
    """The whole path, started: ``url`` is the coordinator as the site names it."""

    def __init__(self, server: Server, squid: Squid, link_port: int) -> None:
        self.server, self.squid = server, squid
        self.proxy = f"http://127.0.0.1:{link_port}"  # squid, at the far end of the link
        self.url = f"https://localhost:{server.port}"

    def client(self, streams: int) -> CoordinatorClient:
        return CoordinatorClient(
            self.url,
            SITE_TOKENS["frontier"],
            streams=streams,
            stream_min_bytes=MiB,
            retry_budget_s=60,
        )


@pytest.fixture
def frontier_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FrontierPath]:
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    with Server(tmp_path / "state", max_request_s=60.0, tls=(cert, key)) as server:
        squid = Squid()
        with squid:
            link = Link(
                "frontier",
                "127.0.0.1",
                squid.port,
                rtt_ms=347,
                window_bytes=MiB,
                lifetime_s=LIFETIME_S,
            )
            with EmulatorProcess([link]) as ports:
                path = FrontierPath(server, squid, ports["frontier"])
                # the site's environment, as connectivity.https_proxy sets it (no no_proxy)
                monkeypatch.setenv("HTTPS_PROXY", path.proxy)
                monkeypatch.delenv("NO_PROXY", raising=False)
                monkeypatch.delenv("no_proxy", raising=False)
                yield path


def requests_of(client: CoordinatorClient) -> list[httpx.Request]:
    log: list[httpx.Request] = []
    for http in [client.http, *client._stream_clients(client.streams)]:
        http.event_hooks["request"] = [log.append]
    return log


@pytest.mark.parametrize("streams", [1, 4])
def test_cut_transfers_through_squid_resume_and_store_once(
    frontier_path: FrontierPath, tmp_path: Path, streams: int
) -> None:
    data = os.urandom(SIZE)
    (tmp_path / "delta.bin").write_bytes(data)
    client = frontier_path.client(streams)
    log = requests_of(client)
    key = client.upload_blob(tmp_path / "delta.bin")
    puts = [r for r in log if r.method == "PUT"]
    store = frontier_path.server.coordinator.blobs
    assert store.keys() == [key] and store.path(key).read_bytes() == data  # once, whole
    assert list(store.staging.iterdir()) == []
    if streams == 1:  # cut at least once, resumed after the bytes that arrived
        assert len(puts) >= 2 and any(int(r.url.params["offset"]) > 0 for r in puts)
    log.clear()
    out = client.download_blob(key, tmp_path / "back" / "delta.bin")
    assert out.read_bytes() == data
    assert [p.name for p in out.parent.iterdir()] == ["delta.bin"]
    starts = [int(r.headers["range"].split("=")[1].split("-")[0]) for r in log]
    if streams == 1:
        assert len(starts) >= 2 and starts == sorted(starts) and starts[0] == 0
    # every byte went through squid: it logs each tunnel once it closes
    client.close()
    deadline = time.monotonic() + 30
    while not frontier_path.squid.tunnels():
        assert time.monotonic() < deadline, "squid logged no CONNECT tunnel"
        time.sleep(0.2)
