"""TCP proxies in front of a real server, for network faults a test aims.

``LostReply`` loses one reply on its way back: the request whose first line holds ``marker``
reaches the server (which acts on it), and its answer is dropped and the client's connection
closed, as a reply lost to a network fault is; everything else goes through untouched.
``CutConnections`` ends every connection a fixed time after it opens; ``StalledFirst`` holds
its first connections without a word."""

from __future__ import annotations

import socket
import threading
from types import TracebackType
from typing import Self


class _Proxy:
    """Listens on a free loopback port (:attr:`port`); each connection it accepts goes to
    :meth:`_connect`, which decides what becomes of it."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._connect(client)

    def _connect(self, client: socket.socket) -> None:
        raise NotImplementedError


class LostReply(_Proxy):
    """Forwards to ``upstream_port``, dropping the reply to the request marked ``marker``."""

    def __init__(self, upstream_port: int, marker: bytes) -> None:
        self.marker = marker
        self.lost = threading.Event()  # set once the reply has been dropped
        self._armed = True
        self._guard = threading.Lock()
        super().__init__(upstream_port)

    def _connect(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        drop = threading.Event()
        threading.Thread(target=self._requests, args=(client, upstream, drop), daemon=True).start()
        threading.Thread(target=self._replies, args=(upstream, client, drop), daemon=True).start()

    def _requests(
        self, client: socket.socket, upstream: socket.socket, drop: threading.Event
    ) -> None:
        """Client to server; marks the connection whose next reply is to be lost."""
        while data := _recv(client):
            with self._guard:
                if self._armed and self.marker in data.split(b"\r\n", 1)[0]:
                    self._armed = False
                    drop.set()
            upstream.sendall(data)
        _close(upstream)

    def _replies(
        self, upstream: socket.socket, client: socket.socket, drop: threading.Event
    ) -> None:
        """Server to client; the first reply after a marked request is swallowed, and the
        client's connection closed."""
        while data := _recv(upstream):
            if drop.is_set():
                _close(client)
                _close(upstream)
                self.lost.set()
                return
            client.sendall(data)
        _close(client)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16)
    except OSError:
        return b""


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class CutConnections(_Proxy):
    """A TCP proxy in front of a real server that ends every connection ``hold_s`` seconds
    after it opens, whatever is in flight (as a proxy or NAT that cuts long connections
    does); with ``hold_s`` 0 it closes each one at once, before anything is forwarded (a
    server that cannot be reached). Counts the connections it cut (:attr:`cuts`)."""

    def __init__(self, upstream_port: int, hold_s: float) -> None:
        self.hold_s = hold_s
        self.cuts = 0
        super().__init__(upstream_port)

    def _connect(self, client: socket.socket) -> None:
        self.cuts += 1
        if self.hold_s <= 0:
            _close(client)
            return
        upstream = _forward(client, self.upstream_port)
        timer = threading.Timer(self.hold_s, _close_both, args=(client, upstream))
        timer.daemon = True
        timer.start()


def _close_both(a: socket.socket, b: socket.socket) -> None:
    _close(a)
    _close(b)


def _forward(client: socket.socket, upstream_port: int) -> socket.socket:
    """Pump ``client``'s connection both ways to the server at ``upstream_port``; the
    server's side of it."""
    upstream = socket.create_connection(("127.0.0.1", upstream_port))
    for source, sink in ((client, upstream), (upstream, client)):
        threading.Thread(target=_pump, args=(source, sink), daemon=True).start()
    return upstream


def _pump(source: socket.socket, sink: socket.socket) -> None:
    while data := _recv(source):
        try:
            sink.sendall(data)
        except OSError:
            return


class StalledFirst(_Proxy):
    """Forwards to ``upstream_port``, except that its first ``count`` connections are held
    open and never forwarded nor answered (as a connection a NAT or a proxy dropped without
    a word). Counts the connections it held (:attr:`held`)."""

    def __init__(self, upstream_port: int, count: int = 1) -> None:
        self.count, self.held = count, 0
        self._stalled: list[socket.socket] = []  # kept open until the proxy closes
        super().__init__(upstream_port)

    def _connect(self, client: socket.socket) -> None:
        if self.held < self.count:
            self.held += 1
            self._stalled.append(client)
            return
        _forward(client, self.upstream_port)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        super().__exit__(kind, exc, tb)
        for sock in self._stalled:
            _close(sock)
