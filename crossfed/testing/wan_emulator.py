"""An emulator of long-distance links, for tests and benchmarks: not a network, a relay.

Each emulated link is a TCP relay on loopback in front of a real server. Every connection
through it sees what a long link does to one TCP stream:

* a one-way delay of RTT/2 in each direction;
* a window: at most ``window_bytes`` of a direction are in flight (read from the sender and
  not yet acknowledged, an acknowledgement arriving RTT/2 after the bytes were delivered),
  so one connection moves at most window / RTT, as one stream over a real long link with
  Linux's default 6 MiB receive window does (about 145 Mbit/s at 347 ms);
* an aggregate rate cap per direction, shared by all the link's connections (the site's
  uplink), as a pacing token bucket;
* optionally a lifetime: a connection older than ``lifetime_s`` is reset, as the load
  balancer in front of OLCF's forward proxy reaps long-lived connections (squid's own
  ``client_lifetime`` leaves ``CONNECT`` tunnels alone).

This machine's ``tc`` has no ``netem``; the relay keeps its own clock. :data:`PAPER_LINKS`
holds the paper's round-trip times (Table 3). Run one emulator process for a set of links
(``python -m crossfed.testing.wan_emulator --link frontier,rtt_ms=347,target=127.0.0.1:8000``);
it prints one JSON line naming each link's listening port, and relays until terminated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from crossfed.testing import stop_process

#: Linux's default largest TCP receive window (net.ipv4.tcp_rmem's maximum, 6 MiB)
DEFAULT_WINDOW = 6 << 20
#: bytes moved per read
READ_BYTES = 1 << 20
#: the paper's sites and their round-trip times to the coordinator (Table 3), in ms
PAPER_LINKS = {"snellius": 3.0, "lumi": 70.0, "frontier": 347.0}


@dataclass(frozen=True)
class Link:
    """One emulated link: where it listens, where it leads, and what it does to bytes."""

    name: str
    target_host: str
    target_port: int
    rtt_ms: float
    window_bytes: int = DEFAULT_WINDOW
    rate_mbit: float | None = None  # aggregate per direction; None: no cap
    listen_port: int = 0
    lifetime_s: float | None = None  # connections are reset at this age; None: never

    def __post_init__(self) -> None:
        if self.rtt_ms < 0:
            raise ValueError(f"link {self.name}: rtt_ms must be >= 0, got {self.rtt_ms}")
        if self.window_bytes < 1:
            raise ValueError(f"link {self.name}: window_bytes must be >= 1")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"link {self.name}: rate_mbit must be > 0 (or absent)")
        if self.lifetime_s is not None and self.lifetime_s <= 0:
            raise ValueError(f"link {self.name}: lifetime_s must be > 0 (or absent)")

    @property
    def stream_cap_bytes_s(self) -> float:
        """The most one connection can move per second: window / RTT."""
        return float("inf") if self.rtt_ms == 0 else self.window_bytes / (self.rtt_ms / 1000)


def parse_link(text: str) -> Link:
    """``name,target=HOST:PORT,rtt_ms=R[,window=BYTES][,rate_mbit=M][,listen=PORT]
    [,lifetime_s=S]``."""
    name, *pairs = text.split(",")
    fields: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"link {text!r}: {pair!r} is not key=value")
        fields[key.strip()] = value.strip()
    known = {"target", "rtt_ms", "window", "rate_mbit", "listen", "lifetime_s"}
    if unknown := set(fields) - known:
        raise ValueError(
            f"link {text!r}: unknown setting(s) {sorted(unknown)}; use {sorted(known)}"
        )
    if "target" not in fields:
        raise ValueError(f"link {text!r}: target=HOST:PORT is required")
    host, _, port = fields["target"].rpartition(":")
    rtt = fields.get("rtt_ms", str(PAPER_LINKS.get(name, "")))
    if not rtt:
        raise ValueError(f"link {text!r}: rtt_ms is required for a link not in {PAPER_LINKS}")
    return Link(
        name=name,
        target_host=host or "127.0.0.1",
        target_port=int(port),
        rtt_ms=float(rtt),
        window_bytes=int(fields.get("window", DEFAULT_WINDOW)),
        rate_mbit=float(fields["rate_mbit"]) if "rate_mbit" in fields else None,
        listen_port=int(fields.get("listen", 0)),
        lifetime_s=float(fields["lifetime_s"]) if "lifetime_s" in fields else None,
    )


class Pacer:
    """An aggregate rate cap: bytes leave no faster than ``rate`` bytes per second."""

    def __init__(self, rate_bytes_s: float | None) -> None:
        self.rate = rate_bytes_s
        self.next_free = 0.0

    async def take(self, n: int) -> None:
        if self.rate is None:
            return
        loop = asyncio.get_running_loop()
        start = max(loop.time(), self.next_free)
        self.next_free = start + n / self.rate
        delay = self.next_free - loop.time()  # the bytes' own transmission time included
        if delay > 0:
            await asyncio.sleep(delay)


class _Direction:
    """One direction of one connection: delay, window and the link's pacer."""

    def __init__(self, link: Link, pacer: Pacer) -> None:
        self.one_way = link.rtt_ms / 2000
        self.window = link.window_bytes
        self.pacer = pacer
        self.in_flight = 0
        self.credit = asyncio.Event()
        self.queue: deque[tuple[float, bytes]] = deque()
        self.ready = asyncio.Event()
        self.closed = False

    def _ack(self, n: int) -> None:
        self.in_flight -= n
        self.credit.set()

    async def read_side(self, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                while self.in_flight >= self.window:
                    self.credit.clear()
                    await self.credit.wait()
                data = await reader.read(min(READ_BYTES, self.window - self.in_flight))
                if not data:
                    break
                self.in_flight += len(data)
                self.queue.append((loop.time() + self.one_way, data))
                self.ready.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.closed = True
            self.ready.set()

    async def write_side(self, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self.queue:
                    if self.closed:
                        break
                    self.ready.clear()
                    await self.ready.wait()
                    continue
                due, data = self.queue.popleft()
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                await self.pacer.take(len(data))
                writer.write(data)
                await writer.drain()
                loop.call_later(self.one_way, self._ack, len(data))
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass


class Emulator:
    """The relays of a set of links, on one event loop."""

    def __init__(self, links: list[Link]) -> None:
        self.links = links
        self.servers: list[asyncio.Server] = []
        self.ports: dict[str, int] = {}
        self.connections = 0
        self.reaped = 0
        self.relays: set[asyncio.Task[None]] = set()

    async def start(self) -> dict[str, int]:
        for link in self.links:
            up = Pacer(None if link.rate_mbit is None else link.rate_mbit * 1e6 / 8)
            down = Pacer(up.rate)
            server = await asyncio.start_server(
                lambda r, w, link=link, up=up, down=down: self._relay(link, up, down, r, w),
                "127.0.0.1",
                link.listen_port,
            )
            self.servers.append(server)
            self.ports[link.name] = server.sockets[0].getsockname()[1]
        return self.ports

    async def _relay(self, *args: Any) -> None:
        """One connection, relayed until either side ends it, the link reaps it or the
        emulator stops (a relay must not end cancelled: Python 3.11's stream server then
        reports the cancellation as an unhandled error)."""
        try:
            await self._relay_connection(*args)
        except asyncio.CancelledError:
            pass

    async def _relay_connection(
        self,
        link: Link,
        up: Pacer,
        down: Pacer,
        client_reader: asyncio.StreamReader,
        client_writer: asyncio.StreamWriter,
    ) -> None:
        self.connections += 1
        relay = asyncio.current_task()
        assert relay is not None
        self.relays.add(relay)
        relay.add_done_callback(self.relays.discard)
        try:
            server_reader, server_writer = await asyncio.open_connection(
                link.target_host, link.target_port
            )
        except OSError:
            client_writer.close()
            return
        await asyncio.sleep(link.rtt_ms / 1000)  # the handshake's round trip
        outbound, inbound = _Direction(link, up), _Direction(link, down)
        tasks = [
            asyncio.create_task(outbound.read_side(client_reader)),
            asyncio.create_task(outbound.write_side(server_writer)),
            asyncio.create_task(inbound.read_side(server_reader)),
            asyncio.create_task(inbound.write_side(client_writer)),
        ]
        reaped = False
        try:
            _, pending = await asyncio.wait(tasks, timeout=link.lifetime_s)
            if pending:
                reaped = True
                self.reaped += 1
        except asyncio.CancelledError:
            pass  # the emulator is stopping: drop the connection
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for writer in (client_writer, server_writer):
                if reaped:
                    writer.transport.abort()  # a reset, as a reaping load balancer sends
                else:
                    writer.close()

    async def close(self) -> None:
        for server in self.servers:
            server.close()
        relays = list(self.relays)
        for relay in relays:
            relay.cancel()
        await asyncio.gather(*relays, return_exceptions=True)
        for server in self.servers:
            await server.wait_closed()


async def _serve(links: list[Link]) -> None:
    emulator = Emulator(links)
    ports = await emulator.start()
    print(json.dumps({"ports": ports}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await emulator.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m crossfed.testing.wan_emulator", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--link",
        action="append",
        required=True,
        help="name,target=HOST:PORT[,rtt_ms=R][,window=BYTES][,rate_mbit=M][,listen=PORT]"
        "[,lifetime_s=S]; "
        f"rtt_ms defaults to the paper's for {', '.join(PAPER_LINKS)}",
    )
    parser.add_argument("--rate-mbit", type=float, help="aggregate cap of every link without one")
    args = parser.parse_args(argv)
    try:
        links = [parse_link(text) for text in args.link]
    except ValueError as exc:
        parser.error(str(exc))
    if args.rate_mbit is not None:
        links = [
            link if link.rate_mbit is not None else replace(link, rate_mbit=args.rate_mbit)
            for link in links
        ]
    asyncio.run(_serve(links))
    return 0


if __name__ == "__main__":
    sys.exit(main())


class EmulatorProcess:
    """The emulator in a process of its own (so its pacing does not share a GIL with the
    traffic it carries): ``with EmulatorProcess(links) as ports: ...``."""

    def __init__(self, links: list[Link]) -> None:
        self.links = links
        self.proc: subprocess.Popen[str] | None = None
        self.ports: dict[str, int] = {}

    def __enter__(self) -> dict[str, int]:
        cmd = [sys.executable, "-m", "crossfed.testing.wan_emulator"]
        for link in self.links:
            text = f"{link.name},target={link.target_host}:{link.target_port}"
            text += f",rtt_ms={link.rtt_ms},window={link.window_bytes},listen={link.listen_port}"
            if link.rate_mbit is not None:
                text += f",rate_mbit={link.rate_mbit}"
            if link.lifetime_s is not None:
                text += f",lifetime_s={link.lifetime_s}"
            cmd += ["--link", text]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=10)
            raise RuntimeError(f"the WAN emulator exited with {self.proc.returncode}")
        self.ports = json.loads(line)["ports"]
        return self.ports

    def __exit__(self, *_: object) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout_s=10)
