"""Soak: a real run under a thousand injected faults, audited by an independent checker.

A real coordinator process (``coordinator serve --keep-deltas``) and three real site
processes (``bench/chaos.py``'s worker: ``SiteRunner`` training torchtitan's tiny Qwen3, with
overlapped rounds) run to generation ``rounds`` while the soak injects, on a seeded schedule:

* site SIGKILLs of five kinds: mid-phase (at a random moment), mid-upload (a delta's part is
  on its way up), between its delta and its commit (the parts are up, the submission never
  leaves), after its commit (the coordinator accepted it, the answer never arrives) and
  during an overlapped early lease (just after a lease of the next round was granted);
  each site is killed every few rounds and restarted a few seconds later;
* coordinator SIGKILLs, at a random moment and mid-merge (armed with ``CROSSFED_CRASH_AT``:
  half of the next generation's tensors written, or all of them but not committed), each
  followed by a restart on the same port and state;
* a full disk: the coordinator's state directory lives on a tmpfs of its own (root only;
  skipped and reported otherwise), filled to its last byte for a few seconds;
* on each site's own TCP proxy in front of the coordinator (``SoakProxy``): connections
  refused, replies dropped after the coordinator did the work, connections reset
  mid-request, requests stalled, requests slowed to a trickle, requests replayed late on a
  new connection (so they arrive after later ones: reordered), and a delta's submission held
  past its lease's TTL while the site's heartbeats are refused (the lease expires while its
  commit is in flight).

Afterwards ``bench/chaos.py``'s audit (the coordinator's own lease book replayed against the
sites' journals) and ``bench/soak_check.py`` (an independent checker sharing no code with the
coordinator: the ledger replayed and the final master rebuilt from generation 0 and every
accepted delta) judge the run. The last line printed is one JSON object:

``faults_injected``, ``faults``  (total and by kind: every kind above that hit a request)
``blocks_lost``, ``blocks_duplicated``, ``blocks_misattributed``  (0: exactly once)
``http_5xx_unexpected``  (0: 5xx answers other than 507 ``storage_full``), ``http_507``
``checker_ok``, ``replay_max_error``  (the independent checker; target <= 1e-6)
``goodput``, ``fault_free_goodput``  (accepted compute seconds over the sites' wall seconds,
    under faults and in a fault-free run of the same config; target >= 0.88)
``recovery_s``  (per kind: median and max seconds from the fault to the hit site's next
    accepted delta, any site's for coordinator and disk faults)

Run: ``python bench/soak.py`` (``--preset long-phases``: 24 rounds of 300 inner steps, phases
of about 30 s, about 1,600 faults; about 31 minutes with the fault-free run),
``--preset short-phases`` (60 rounds of 100 steps, phases of about 10 s, about 2,000 faults:
the same faults per round, a restart's fixed seconds weighing three times as much against a
phase) or ``--preset ci`` (14 rounds of 8 steps, 100-200 faults in about 3 minutes, no
fault-free run: the test suite's).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import queue
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import median
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import chaos  # noqa: E402
from chaos import HOST, SITES, ChaosConfig, kill  # noqa: E402

from crossfed.coordinator.embedded import ensure_secrets, free_port  # noqa: E402

#: site kills, in the order each site meets them
SITE_KILLS = ("mid_phase", "mid_upload", "before_commit", "after_commit", "early_lease")
#: coordinator faults, alternately; the mid-merge ones arm a crash point for the next merge
COORDINATOR_KILLS = ("anytime", "inside_generation_write", "anytime", "after_generation_write")
REQUEST = re.compile(rb"^(GET|POST|PUT|DELETE|HEAD) (\S+) HTTP/1\.1\r\n")
#: a delta's submission: by reference (or parts), or with the delta inside (inline)
COMMIT = re.compile(r"^/v1/rounds/\d+/deltas(/inline)?$")
MiB = 1 << 20


@dataclass(frozen=True)
class SoakConfig:
    """One soak: the run's shape and the fault schedule's knobs."""

    rounds: int = 24
    seed: int = 0
    documents: int = 64  # an epoch every round or few: many epochs in a run
    inner_steps: int = 300  # H: with step_s a phase of about 30 s, compute most of a round
    overlap: bool = True
    # as the workflow's sites run (config/config.yaml): a mid-phase checkpoint every 10 steps
    # and leases of at least 10 s
    checkpoint_every: int = 10
    min_ttl_s: float = 10.0
    # each step lasts at least this long times the site's slowdown: the sites keep the pace
    # their own GPUs would, not the pace of three processes sharing this machine's cores
    # (faster whenever a fault idles one of them); 0 keeps the machine's own pace
    step_s: float = 0.1
    site_kill_every: int = 5  # rounds between two kills of one site
    coordinator_every: int = 6  # rounds between two coordinator faults
    disk_full_every: int = 7  # rounds between two full-disk spells
    disk_full_s: tuple[float, float] = (2.0, 5.0)
    refuse_p: float = 0.15  # per new connection
    drop_reply_p: float = 0.08
    lifetime_s: tuple[float, float] = (0.5, 3.0)  # every connection is reset after this
    stall_p: float = 0.05  # per request
    stall_s: tuple[float, float] = (1.0, 4.0)
    slow_p: float = 0.05
    slow_bytes_per_s: int = 256 << 10
    replay_p: float = 0.06
    replay_delay_s: tuple[float, float] = (0.2, 3.0)
    commit_hold_p: float = 0.08
    commit_hold_s: float = 13.0  # past the lease's shortest TTL (min_ttl_s)
    restart_s: tuple[float, float] = (1.0, 3.0)
    timeout_s: float = 3600.0
    faults: bool = True
    embedding_rows: str | None = None  # outer.embedding_rows (None: a new run's default)

    def worker_config(self) -> ChaosConfig:
        """What the site processes and the run spec need (``bench/chaos.py``'s shape)."""
        return ChaosConfig(
            rounds=self.rounds,
            seed=self.seed,
            documents=self.documents,
            inner_steps=self.inner_steps,
            overlap=self.overlap,
            timeout_s=self.timeout_s,
            min_ttl_s=self.min_ttl_s,
            checkpoint_every=self.checkpoint_every,
            step_s=self.step_s,
            embedding_rows=self.embedding_rows,
        )


PRESETS = {
    # phases of about 30 s, the default: a restart's fixed seconds (the requeue's 1-3 s,
    # Python importing torch and torchtitan) weigh against a phase nearer to how they do
    # against a real site's phases of minutes
    "long-phases": SoakConfig(),
    # the same faults per round with phases a third as long (about 10 s), 60 rounds to keep
    # it about as long: a stress preset, where the restarts' seconds weigh three times as much
    "short-phases": SoakConfig(rounds=60, inner_steps=100),
    "ci": SoakConfig(
        rounds=14,
        documents=8,
        inner_steps=8,
        checkpoint_every=4,
        min_ttl_s=6.0,
        commit_hold_s=9.0,
        step_s=0.0,
        site_kill_every=3,
        coordinator_every=3,
        disk_full_every=4,
        stall_s=(0.5, 2.0),
        timeout_s=270.0,
        # the rows weighted by the sites' counts: the checker replays that path in every CI
        embedding_rows="counts",
    ),
}


# ---------------------------------------------------------------------------- the proxy
@dataclass
class _Link:
    """One proxied connection, as its two pumps share it."""

    opened: float
    outstanding: bool = False  # a request went up and its reply has not started
    drop_reply: bool = False
    kill_on_reply: bool = False
    slow: bool = False
    recording: bytearray | None = None  # a request kept to be replayed


class SoakProxy:
    """One site's TCP proxy to the coordinator: misbehaves per connection and per request.

    It reads request heads as they pass (``METHOD PATH HTTP/1.1``) to aim the faults that
    need to know what a request is (a delta part, a submission, a heartbeat, an early lease)
    and to fire the site kills the soak arms (:meth:`arm`): the kill itself is the driver's,
    told through ``triggers``.
    """

    def __init__(
        self,
        site: str,
        upstream_port: int,
        config: SoakConfig,
        seed: int,
        triggers: queue.Queue,
    ) -> None:
        self.site, self.upstream_port, self.config = site, upstream_port, config
        self.rng = random.Random(seed)
        self.triggers = triggers
        self.faults: list[tuple[str, float]] = []  # (kind, time) of each fault that hit
        self.connections = 0
        self.open_round = 1  # the driver keeps it current (an early lease asks for more)
        self.armed: str | None = None
        self.blackout_until = 0.0
        self.port = free_port(HOST)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=f"soak-{site}", daemon=True)
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(10)

    def stop(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def arm(self, kind: str | None) -> None:
        """Fire the site kill ``kind`` at the next request it fits (None: disarm)."""
        self.armed = kind

    def _fault(self, kind: str) -> None:
        self.faults.append((kind, time.time()))

    def _trigger(self, kind: str, delay_s: float = 0.0) -> None:
        self.armed = None
        self.triggers.put((self.site, kind, delay_s))

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(asyncio.start_server(self._handle, HOST, self.port))
        self._ready.set()
        self._loop.run_forever()
        # stopped: the connections' pumps and any replay still waiting end here, not when
        # the interpreter collects them ("Task was destroyed but it is pending!")
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        c = self.config
        self.connections += 1
        roll = self.rng.random() if c.faults else 1.0
        if roll < c.refuse_p:
            self._fault("connection_refused")
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(HOST, self.upstream_port)
        except OSError:  # the coordinator is down (a fault of its own): the site retries
            writer.transport.abort()
            return
        link = _Link(opened=time.monotonic(), drop_reply=roll < c.refuse_p + c.drop_reply_p)
        up = asyncio.ensure_future(self._pump_up(reader, up_writer, link))
        down = asyncio.ensure_future(self._pump_down(up_reader, writer, link))
        lifetime = self.rng.uniform(*c.lifetime_s) if c.faults else None
        done, _ = await asyncio.wait({up, down}, timeout=lifetime, return_when="FIRST_COMPLETED")
        if not done and link.outstanding:
            self._fault("connection_reset_mid_request")
        for task in (up, down):
            task.cancel()
        for w in (writer, up_writer):
            w.transport.abort()

    async def _pump_up(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link
    ) -> None:
        try:
            while data := await reader.read(65536):
                head = REQUEST.match(data)
                if head is not None and not await self._on_request(head, data, link):
                    return  # the request never reaches the coordinator
                link.outstanding = True
                if link.recording is not None and len(link.recording) < MiB:
                    link.recording += data
                await self._forward(data, writer, link)
        except OSError:  # either side reset: the connection is over
            return

    async def _forward(self, data: bytes, writer: asyncio.StreamWriter, link: _Link) -> None:
        if not link.slow:
            writer.write(data)
            await writer.drain()
            return
        piece = 16 << 10
        for at in range(0, len(data), piece):
            writer.write(data[at : at + piece])
            await writer.drain()
            await asyncio.sleep(piece / self.config.slow_bytes_per_s)

    async def _on_request(self, head: re.Match, data: bytes, link: _Link) -> bool:
        """Aim faults at one request; False: it is not forwarded (the connection ends)."""
        c = self.config
        if not c.faults:
            return True
        method, path = head.group(1), head.group(2).decode("latin-1").split("?")[0]
        commit = COMMIT.match(path) if method == b"POST" else None
        is_upload = (method == b"PUT" and path.startswith("/v1/blobs/")) or bool(
            commit and commit.group(1)
        )  # a delta part, or a delta inside its submission (inline)
        if path.endswith("/heartbeat") and time.monotonic() < self.blackout_until:
            return False  # the site is cut off while its commit is held
        if self.armed == "mid_upload" and is_upload:
            self._trigger("mid_upload")
            return True  # this first piece goes up; the kill follows
        if self.armed == "before_commit" and commit:
            self._trigger("before_commit")
            return False
        if self.armed == "after_commit" and commit:
            link.drop_reply = link.kill_on_reply = True
            self.armed = None
        if self.armed == "early_lease" and method == b"POST" and path == "/v1/leases":
            asked = re.search(rb'"round":\s*(\d+)', data)
            if asked is not None and int(asked.group(1)) > self.open_round:
                self._trigger("early_lease", self.rng.uniform(0.5, 2.0))
        rng = self.rng
        if commit and rng.random() < c.commit_hold_p:
            self._fault("commit_held_past_ttl")
            self.blackout_until = time.monotonic() + c.commit_hold_s
            await asyncio.sleep(c.commit_hold_s)
        elif rng.random() < c.stall_p:
            self._fault("request_stalled")
            await asyncio.sleep(rng.uniform(*c.stall_s))
        if rng.random() < c.slow_p:
            self._fault("request_slowed")
            link.slow = True
        if rng.random() < c.replay_p:
            self._fault("request_replayed")
            link.recording = bytearray()
        return True

    async def _pump_down(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link
    ) -> None:
        try:
            while data := await reader.read(65536):
                if link.drop_reply:
                    if link.kill_on_reply:
                        self._trigger("after_commit")
                    else:
                        self._fault("reply_dropped")
                    return  # the coordinator did the work; its answer never arrives
                link.outstanding = False
                if link.recording is not None:
                    asyncio.ensure_future(self._replay(bytes(link.recording)))
                    link.recording = None
                writer.write(data)
                await writer.drain()
        except OSError:
            return

    async def _replay(self, request: bytes) -> None:
        """Send a request again, later, on a connection of its own; its answer is dropped."""
        await asyncio.sleep(self.rng.uniform(*self.config.replay_delay_s))
        try:
            reader, writer = await asyncio.open_connection(HOST, self.upstream_port)
        except OSError:
            return
        try:
            writer.write(request)
            await writer.drain()
            await asyncio.wait_for(reader.read(65536), 10.0)
        except (OSError, TimeoutError):
            pass
        finally:
            writer.transport.abort()


# ---------------------------------------------------------------------------- the disk
class SmallDisk:
    """The coordinator's state directory on a tmpfs of its own, to fill on demand."""

    def __init__(self, path: Path, size: str = "2g") -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.mounted = False
        if os.geteuid() == 0:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                capture_output=True,
            )
            self.mounted = done.returncode == 0

    def fill(self) -> Path:
        """Write zeros until the kernel refuses a single byte more."""
        filler = self.path / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            for size in (64 * MiB, MiB, 4096, 1):
                chunk = bytes(size)
                while True:
                    try:
                        os.write(fd, chunk)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
        finally:
            os.close(fd)
        return filler

    def unmount(self) -> None:
        """Unmount the tmpfs, its files kept in a directory of the same name."""
        if not self.mounted:
            return
        kept = shutil.copytree(self.path, self.path.with_name(self.path.name + ".kept"))
        subprocess.run(["umount", "-l", str(self.path)], check=True)
        self.path.rmdir()
        kept.rename(self.path)
        self.mounted = False


# ---------------------------------------------------------------------------- the driver
@dataclass
class Soak:
    """The processes of one soak and what it did to them."""

    config: SoakConfig
    root: Path
    data: Path
    disk: SmallDisk
    port: int
    proxies: dict[str, SoakProxy]
    coordinator: subprocess.Popen | None = None
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    faults: list[tuple[str, str | None, float]] = field(default_factory=list)
    restarts: dict[str, float] = field(default_factory=dict)  # site -> when to start it
    arming: dict[str, tuple[str, float]] = field(default_factory=dict)  # site -> kind, until
    kills: dict[str, tuple[str, float]] = field(default_factory=dict)  # site -> kind, when
    crashes: int = 0
    armed_point: str | None = None
    marker: int = 0
    #: the sites' kills and restarts (``keep_sites``, a thread of their own) and the
    #: driver's faults share the process table: a site due back comes back on time while
    #: the driver restarts the coordinator or fills its disk
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def state(self) -> Path:
        return self.disk.path

    def start_coordinator(self, point: str | None = None) -> None:
        """Start it (again); ``point``: a crash point it SIGKILLs itself at, once."""
        env = {}
        if point is not None:
            self.marker += 1
            once = self.root / f"crash-once-{self.marker}"
            env = {"CROSSFED_CRASH_AT": point, "CROSSFED_CRASH_ONCE": str(once)}
        self.armed_point = point
        args = ("--keep-deltas",)
        try:
            self.coordinator = chaos.spawn_coordinator(self.state, self.port, args=args, env=env)
        except RuntimeError:  # it merged while starting and died at the armed point
            if point is None:
                raise
            self.note(f"coordinator_sigkill_{point}")
            self.start_coordinator(None)

    def start_worker(self, site: str) -> None:
        worker = self.config.worker_config()
        url = self.proxies[site].url
        self.workers[site] = chaos.spawn_worker(site, url, self.root, self.data, worker)

    def note(self, kind: str, site: str | None = None) -> None:
        self.faults.append((kind, site, time.time()))

    def status(self) -> dict[str, Any] | None:
        from crossfed.client.http import CoordinatorClient, Refused, Unreachable

        token = json.loads((self.root / "admin.json").read_text())["admin"]
        client = CoordinatorClient(f"http://{HOST}:{self.port}", token, retry_budget_s=2)
        try:
            return client.status()
        except (Unreachable, Refused, OSError):
            return None
        finally:
            client.close()

    # -- faults
    def kill_site(self, site: str, kind: str, rng: random.Random) -> None:
        proc = self.workers.get(site)
        if proc is None or proc.poll() is not None:
            return
        kill(proc)
        self.note(f"site_sigkill_{kind}", site)
        self.restarts[site] = time.monotonic() + rng.uniform(*self.config.restart_s)

    def site_fault(self, site: str, kind: str, rng: random.Random) -> None:
        with self.lock:
            if site in self.restarts or site in self.arming or site in self.kills:
                return  # down already, or a kill is armed
            if kind == "mid_phase":
                self.kill_site(site, kind, rng)
                return
            self.proxies[site].arm(kind)
            self.arming[site] = (kind, time.monotonic() + 45.0)

    def coordinator_fault(self, kind: str, rng: random.Random) -> None:
        assert self.coordinator is not None
        kill(self.coordinator)
        self.note("coordinator_sigkill")
        time.sleep(rng.uniform(0.3, 1.5))
        # a mid-merge kill: the restarted coordinator kills itself in its next merge
        self.start_coordinator(None if kind == "anytime" else kind)

    def disk_fault(self, rng: random.Random) -> None:
        if not self.disk.mounted:
            return
        filler = self.disk.fill()
        self.note("disk_full")
        time.sleep(rng.uniform(*self.config.disk_full_s))
        filler.unlink()

    # -- upkeep
    def keep_sites(self, triggers: queue.Queue, rng: random.Random, stop: threading.Event) -> None:
        """The sites' thread: kill what the proxies triggered, restart what is due, revive
        the dead, every few tens of milliseconds until ``stop``."""
        while not stop.wait(0.05):
            with self.lock:
                self.upkeep_sites(triggers, rng)

    def upkeep_sites(self, triggers: queue.Queue, rng: random.Random) -> None:
        now = time.monotonic()
        while True:
            try:
                site, kind, delay_s = triggers.get_nowait()
            except queue.Empty:
                break
            self.arming.pop(site, None)
            self.kills[site] = (kind, now + delay_s)
        for site, (kind, when) in list(self.kills.items()):
            if now >= when:
                del self.kills[site]
                self.kill_site(site, kind, rng)
        for site, (_kind, until) in list(self.arming.items()):
            if now > until:  # the request it waits for did not come: kill it anyway
                self.proxies[site].arm(None)
                del self.arming[site]
                self.kill_site(site, "mid_phase", rng)
        for site, when in list(self.restarts.items()):
            if now >= when:
                del self.restarts[site]
                self.start_worker(site)
        for site, proc in self.workers.items():
            if site not in self.restarts and proc.poll() not in (None, 0):
                self.crashes += 1  # died on its own: a bug, not a fault
                self.start_worker(site)

    def upkeep_coordinator(self) -> None:
        """Start the coordinator again if it killed itself at its armed crash point."""
        assert self.coordinator is not None
        if self.coordinator.poll() is not None:  # by its own hand, at the armed point
            if self.armed_point is not None:
                self.note(f"coordinator_sigkill_{self.armed_point}")
            else:
                self.crashes += 1
            self.start_coordinator(None)


def fault_plan(config: SoakConfig, rng: random.Random) -> list[tuple[int, str, str | None]]:
    """(round, fault, site) in round order: site kills, coordinator kills, full disks."""
    if not config.faults:
        return []
    plan: list[tuple[int, str, str | None]] = []
    for i, site in enumerate(sorted(SITES)):
        offset = 1 + i % config.site_kill_every
        for j, r in enumerate(range(offset, config.rounds, config.site_kill_every)):
            plan.append((r, SITE_KILLS[(i + j) % len(SITE_KILLS)], site))
    for j, r in enumerate(range(2, config.rounds, config.coordinator_every)):
        plan.append((r, COORDINATOR_KILLS[j % len(COORDINATOR_KILLS)], None))
    for r in range(3, config.rounds, config.disk_full_every):
        plan.append((r, "disk_full", None))
    rng.shuffle(plan)
    return sorted(plan, key=lambda item: item[0])


def run_soak(root: Path, config: SoakConfig, data: Path) -> dict[str, Any]:
    """One run from a fresh coordinator to generation ``config.rounds``; its figures."""
    from crossfed.client.http import CoordinatorClient

    root.mkdir(parents=True, exist_ok=True)
    disk = SmallDisk(root / "coordinator")
    secrets = ensure_secrets(disk.path / "secrets.yaml", list(SITES))
    (root / "admin.json").write_text(json.dumps({"admin": secrets["admin"]}))
    (root / "tokens").mkdir(exist_ok=True)
    for site, token in secrets["sites"].items():
        (root / "tokens" / site).write_text(token)
    port = free_port(HOST)
    triggers: queue.Queue = queue.Queue()
    proxies = {
        site: SoakProxy(site, port, config, config.seed * 101 + i, triggers)
        for i, site in enumerate(sorted(SITES))
    }
    soak = Soak(config, root, data, disk, port, proxies)
    rng = random.Random(config.seed + 1)
    plan = fault_plan(config, rng)
    model = root / f"global-{config.rounds:06d}.safetensors"
    finished = False
    stop, sites_thread = threading.Event(), None
    try:
        soak.start_coordinator()
        for proxy in proxies.values():
            proxy.start()
        admin = CoordinatorClient(f"http://{HOST}:{port}", secrets["admin"], retry_budget_s=30)
        admin.init_run(chaos.run_spec(data, config.worker_config()).to_dict())
        admin.close()
        started = time.monotonic()
        began_at = time.time()
        for site in SITES:
            soak.start_worker(site)
        sites_thread = threading.Thread(
            target=soak.keep_sites, args=(triggers, random.Random(config.seed + 2), stop),
            name="soak-sites", daemon=True,
        )  # fmt: skip
        sites_thread.start()
        generation = 0
        while True:
            if time.monotonic() - started > config.timeout_s:
                raise RuntimeError(f"soak timed out at generation {generation}")
            soak.upkeep_coordinator()
            status = soak.status()
            if status is not None:
                generation = status["generation"]
                if generation >= config.rounds:
                    break
                for proxy in proxies.values():
                    proxy.open_round = int(status["round"])
                if plan and status["round"] >= plan[0][0]:
                    _, kind, site = plan.pop(0)
                    time.sleep(rng.uniform(0.0, 1.0))  # somewhere inside the round
                    if site is not None:
                        soak.site_fault(site, kind, rng)
                    elif kind == "disk_full":
                        soak.disk_fault(rng)
                    else:
                        soak.coordinator_fault(kind, rng)
            time.sleep(0.1)
        wall_s = time.monotonic() - started
        admin = CoordinatorClient(f"http://{HOST}:{port}", secrets["admin"], retry_budget_s=30)
        admin.download_model(config.rounds, model)
        admin.close()
        finished = True
    finally:
        stop.set()
        if sites_thread is not None:
            sites_thread.join()
        for proc in soak.workers.values():
            kill(proc)
        if soak.coordinator is not None:
            kill(soak.coordinator, signal.SIGTERM)
        for proxy in proxies.values():
            proxy.stop()
        if not finished:  # a failed soak leaves no tmpfs mounted behind it
            disk.unmount()
    try:
        return {**judge(soak, began_at, wall_s, model), "run_dir": str(root)}
    finally:
        disk.unmount()


# ---------------------------------------------------------------------------- judging
def judge(soak: Soak, began_at: float, wall_s: float, model: Path) -> dict[str, Any]:
    """Exactly-once (two audits), 5xx, goodput and recovery figures of a finished soak."""
    from soak_check import check

    state = soak.state
    faults = list(soak.faults)
    for site, proxy in soak.proxies.items():
        faults += [(kind, site, t) for kind, t in proxy.faults]
    audit = chaos.audit(state, soak.root)
    independent = check(state)
    conn = sqlite3.connect(f"file:{state / 'state.sqlite'}?mode=ro", uri=True)
    try:
        deltas = conn.execute("SELECT site, compute_s, accepted_at FROM deltas").fetchall()
    finally:
        conn.close()
    compute_s = sum(c or 0.0 for _, c, _ in deltas)
    statuses = http_5xx(state / "coordinator.log")
    return {
        **{k: audit[k] for k in AUDITED},
        "faults": dict(Counter(kind for kind, _, _ in faults)),
        "faults_injected": len(faults),
        "http_507": statuses.get(507, 0),
        "http_5xx_unexpected": sum(n for status, n in statuses.items() if status != 507),
        "checker_ok": independent["ok"],
        "checker_problems": independent["problems"][:10],
        "replay_max_error": independent["replay_max_error"],
        "goodput": round(compute_s / (len(SITES) * wall_s), 4),
        "recovery_s": recovery(faults, deltas),
        "worker_crashes": soak.crashes,
        "disk_faults": "on a tmpfs" if soak.disk.mounted else "skipped: mounting needs root",
        "wall_s": round(wall_s, 1),
        "began_at": began_at,
        "model": str(model),
    }


AUDITED = (
    "blocks_lost",
    "blocks_duplicated",
    "blocks_misattributed",
    "blocks_committed",
    "epochs_completed",
    "deltas_accepted",
    "ledger_blocks_granted",
    "ledger_blocks_reclaimed",
    "site_outcomes",
    "early_leases",
)


def http_5xx(log: Path) -> Counter[int]:
    """5xx answers the coordinator logged (every life of it), by status. A status is three
    digits: a life killed mid-line leaves "status=507" with the next life's first line
    (its timestamp's digits) right behind it."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return Counter(int(m) for m in re.findall(r"http_5xx status=(\d{3})", text))


def recovery(
    faults: list[tuple[str, str | None, float]], deltas: list[tuple[str, float, float]]
) -> dict[str, dict[str, float]]:
    """Per kind, seconds from each fault to the next accepted delta of the site it hit (of
    any site for a coordinator or disk fault): median and max over the faults recovered."""
    by_kind: dict[str, list[float]] = {}
    for kind, site, t in faults:
        after = [at for s, _, at in deltas if at > t and (site is None or s == site)]
        if after:
            by_kind.setdefault(kind, []).append(min(after) - t)
    return {
        kind: {"median": round(median(v), 2), "max": round(max(v), 2), "n": len(v)}
        for kind, v in sorted(by_kind.items())
    }


# ---------------------------------------------------------------------------- entry
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="long-phases")
    parser.add_argument("--rounds", type=int, default=0, help="override the preset's rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="default: results/bench/soak")
    parser.add_argument("--no-reference", action="store_true", help="skip the fault-free run")
    args = parser.parse_args(argv)
    config = replace(PRESETS[args.preset], seed=args.seed)
    if args.rounds:
        config = replace(config, rounds=args.rounds)
    root = Path(args.workdir) if args.workdir else BENCH.parent / "results" / "bench" / "soak"
    root.mkdir(parents=True, exist_ok=True)
    data = chaos.prepare_data(root, config.worker_config())
    stamp = int(time.time())
    soak = run_soak(root / f"soak-{stamp}", config, data)
    result: dict[str, Any] = {
        "preset": args.preset,
        "rounds": config.rounds,
        "sites": len(SITES),
        "seed": config.seed,
        **{k: v for k, v in soak.items() if k != "began_at"},
        "final_val_perplexity": round(chaos.val_perplexity(Path(soak["model"]), data), 3),
    }
    if not args.no_reference and args.preset != "ci":
        calm = run_soak(root / f"calm-{stamp}", replace(config, faults=False), data)
        result.update(
            fault_free_goodput=calm["goodput"],
            fault_free_wall_s=calm["wall_s"],
            fault_free_final_val_perplexity=round(
                chaos.val_perplexity(Path(calm["model"]), data), 3
            ),
        )
    result["config"] = asdict(config)
    result["run_dir"] = soak["run_dir"]  # the coordinator's state, the sites' logs and journals
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
