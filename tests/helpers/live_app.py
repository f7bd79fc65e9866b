"""The coordinator's real app served by uvicorn on a thread of the test process (no run)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import uvicorn

from crossfed.client.http import CoordinatorClient
from crossfed.coordinator.app import KEEP_ALIVE_S, Tokens, create_app
from crossfed.coordinator.service import Coordinator

#: the sites' tokens of :class:`Server`
SITE_TOKENS = {"lumi": "lumi-token", "frontier": "frontier-token"}


class Server:
    """The coordinator app in this process (uvicorn on a thread), without a run."""

    def __init__(
        self, state_dir: Path, max_request_s: float, tls: tuple[Path, Path] | None = None
    ) -> None:
        self.coordinator = Coordinator(state_dir)
        app = create_app(
            self.coordinator,
            Tokens("admin-token", SITE_TOKENS),
            max_request_s=max_request_s,
        )
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=self.port,
                log_level="error",
                timeout_keep_alive=KEEP_ALIVE_S,
                ssl_certfile=None if tls is None else str(tls[0]),
                ssl_keyfile=None if tls is None else str(tls[1]),
            )
        )
        self.scheme = "http" if tls is None else "https"
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, site: str = "lumi", **kwargs) -> CoordinatorClient:
        kwargs.setdefault("retry_budget_s", 20.0)
        url = f"{self.scheme}://localhost:{self.port}"
        return CoordinatorClient(url, SITE_TOKENS[site], **kwargs)
