"""The WAN emulator: a relay that delays, windows and caps what crosses it, byte for byte.

Its timing is checked only from below (an emulated link may be slower on a busy machine,
never faster than its RTT, window and rate allow)."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from crossfed.testing.wan_emulator import (
    DEFAULT_WINDOW,
    PAPER_LINKS,
    EmulatorProcess,
    Link,
    main,
    parse_link,
)

MiB = 1 << 20


class EchoDigest:
    """A TCP server that reads N bytes (8-byte length first) and answers their SHA-256."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket) -> None:
        with conn:
            head = b""
            while len(head) < 8:
                head += conn.recv(8 - len(head))
            left = int.from_bytes(head, "big")
            hasher = hashlib.sha256()
            while left:
                data = conn.recv(min(left, MiB))
                if not data:
                    return
                hasher.update(data)
                left -= len(data)
            conn.sendall(hasher.digest())


@pytest.fixture
def echo() -> Iterator[EchoDigest]:
    server = EchoDigest()
    yield server
    server.server.close()


def send(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(len(data).to_bytes(8, "big") + data)
        answer = b""
        while len(answer) < 32:
            piece = conn.recv(32)
            if not piece:
                break
            answer += piece
        return answer


def test_links_parse_with_the_papers_round_trips_and_clear_errors() -> None:
    frontier = parse_link("frontier,target=127.0.0.1:8000")
    assert frontier.rtt_ms == PAPER_LINKS["frontier"] == 347.0
    assert frontier.window_bytes == DEFAULT_WINDOW and frontier.rate_mbit is None
    assert frontier.stream_cap_bytes_s == pytest.approx(DEFAULT_WINDOW / 0.347)
    link = parse_link("x,target=h:1,rtt_ms=5,window=1000,rate_mbit=100,listen=9")
    assert (link.target_host, link.target_port, link.listen_port) == ("h", 1, 9)
    assert (link.rtt_ms, link.window_bytes, link.rate_mbit) == (5.0, 1000, 100.0)
    for text, message in [
        ("x,target=h:1", "rtt_ms is required"),
        ("lumi,rtt_ms=3", "target=HOST:PORT is required"),
        ("lumi,target=h:1,delay=3", "unknown setting"),
        ("lumi,target=h:1,rtt", "not key=value"),
        ("lumi,target=h:1,rtt_ms=-1", "rtt_ms must be >= 0"),
        ("lumi,target=h:1,rate_mbit=0", "rate_mbit must be > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_link(text)
    with pytest.raises(SystemExit):
        main(["--link", "lumi,rtt_ms=3"])


def test_bytes_cross_whole_and_no_sooner_than_the_round_trip(echo: EchoDigest) -> None:
    data = os.urandom(3 * MiB + 5)
    with EmulatorProcess([Link("lumi", "127.0.0.1", echo.port, rtt_ms=120)]) as ports:
        t0 = time.perf_counter()
        answer = send(ports["lumi"], data)
        elapsed = time.perf_counter() - t0
    assert answer == hashlib.sha256(data).digest()
    assert elapsed >= 2 * 0.120  # the connection's handshake, then the bytes and the answer


def test_one_connection_is_bound_by_window_over_rtt(echo: EchoDigest) -> None:
    window, rtt = 256 * 1024, 0.1
    data = os.urandom(2 * MiB)
    link = Link("far", "127.0.0.1", echo.port, rtt_ms=rtt * 1000, window_bytes=window)
    with EmulatorProcess([link]) as ports:
        t0 = time.perf_counter()
        assert send(ports["far"], data) == hashlib.sha256(data).digest()
        elapsed = time.perf_counter() - t0
    windows = len(data) / window  # each window needs a round trip before the next is sent
    assert elapsed >= (windows - 1) * rtt


def test_the_links_rate_cap_is_shared_by_its_connections(echo: EchoDigest) -> None:
    rate_mbit, size, streams = 40.0, 2 * MiB, 4
    link = Link("capped", "127.0.0.1", echo.port, rtt_ms=1, rate_mbit=rate_mbit)
    datas = [os.urandom(size) for _ in range(streams)]
    answers: list[bytes] = [b""] * streams
    with EmulatorProcess([link]) as ports:

        def one(i: int) -> None:
            answers[i] = send(ports["capped"], datas[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        t0 = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - t0
    assert answers == [hashlib.sha256(d).digest() for d in datas]
    assert elapsed >= 0.95 * streams * (size + 8) / (rate_mbit * 1e6 / 8)
