"""A real HTTP(S) forward proxy for tests and benchmarks: Debian's ``squid``, started here.

It stands where OLCF's proxy stands for Frontier's compute nodes: sites reach the
coordinator only through it (``connectivity.https_proxy``; HTTPS goes as a ``CONNECT``
tunnel). Squid's own ``client_lifetime`` does not cut a ``CONNECT`` tunnel (measured with
squid 5.7), so the load balancer that reaps long connections in front of OLCF's proxy is an
emulated link with a lifetime (:mod:`crossfed.testing.wan_emulator`) between site and squid.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from crossfed.backoff import Backoff
from crossfed.testing import stop_process

CONFIG = """\
http_port 127.0.0.1:{port}
acl CONNECT method CONNECT
http_access allow localhost
http_access deny all
cache deny all
read_timeout 2 minutes
shutdown_lifetime 0 seconds
pid_filename {dir}/squid.pid
access_log stdio:{dir}/access.log
cache_log {dir}/cache.log
cache_store_log none
coredump_dir {dir}
logfile_rotate 0
"""


def squid_binary() -> str | None:
    """Path of ``squid`` (``/usr/sbin`` is not on every user's PATH), or None."""
    return shutil.which("squid") or shutil.which("squid", path="/usr/sbin:/usr/local/sbin")


class Squid:
    """``with Squid() as proxy_url: ...``: squid on a free loopback port."""

    def __init__(self) -> None:
        # its own folder under /tmp: squid running as root drops to its own user, which
        # must reach its logs (a test's tmp_path sits under a folder only root may enter)
        # (and TMPDIR may point under one too)
        root = "/tmp" if os.geteuid() == 0 else None
        self.dir = Path(tempfile.mkdtemp(prefix="crossfed-squid-", dir=root))
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        binary = squid_binary()
        if binary is None:
            raise FileNotFoundError("squid is not installed (apt-get install squid)")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o777)  # squid drops to its own user for its logs
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        conf = self.dir / "squid.conf"
        conf.write_text(CONFIG.format(port=self.port, dir=self.dir))
        self.proc = subprocess.Popen(
            [binary, "-N", "-f", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / "stderr.log", "ab"),  # noqa: SIM115 (the process keeps it)
        )
        backoff = Backoff(0.1, 0.1, budget_s=30.0)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"squid exited: {self.log()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self.url
            except OSError:
                if not backoff.wait():
                    break
        self.__exit__()
        raise RuntimeError(f"squid did not listen on {self.port}: {self.log()[-2000:]}")

    def log(self) -> str:
        return "".join(
            (self.dir / name).read_text(errors="replace")
            for name in ("stderr.log", "cache.log")
            if (self.dir / name).exists()
        )

    def tunnels(self) -> list[str]:
        """The access log's CONNECT lines (one per tunnel squid closed)."""
        path = self.dir / "access.log"
        lines = path.read_text().splitlines() if path.exists() else []
        return [line for line in lines if " CONNECT " in line]

    def __exit__(self, *_: object) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)
