"""Shared fixtures: a small real dataset and a real coordinator process on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import settings

from crossfed import moments, rowcounts
from crossfed.client.http import CoordinatorClient
from crossfed.client.reach import EndpointError
from crossfed.coordinator.embedded import (
    ServeCommand,
    ensure_secrets,
    free_port,
    wait_until_serving,
)
from crossfed.coordinator.runspec import LeasePolicy, RoundPolicy, RunSpec
from crossfed.coordinator.service import Coordinator
from crossfed.darl.blockspace import BlockSpace
from crossfed.data.prepare import prepare
from crossfed.data.windows import read_meta
from crossfed.site.control import EARLY_ASK_THREAD, HEARTBEAT_THREAD
from crossfed.wire.codecs import save_delta
from tests.helpers.coordinator_forks import ForkedProcess, ForkServer

# Hypothesis's per-example deadline (200 ms) is a timing assertion: on a loaded machine an
# example that does file or socket work runs past it and the property "fails" for no fault
# of the code. The suite asserts behaviour, not speed (timings live in bench/).
settings.register_profile("crossfed", deadline=None)
settings.load_profile("crossfed")

REPO = Path(__file__).resolve().parent.parent
SITES = ["snellius", "lumi", "frontier"]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded corpus, tokenised with a small vocabulary into short windows."""
    out = tmp_path_factory.mktemp("data")
    prepare(out, vocab_size=512, seq_len=32, val_fraction=0.05, shards=2, log=lambda *_: None)
    return out


def tiny_spec(data_dir: Path, **overrides) -> RunSpec:
    meta = read_meta(data_dir)
    fields = dict(
        n_windows=meta["n_windows"],
        block_size=8,
        data_seed=7,
        flavour="tiny",
        vocab_size=meta["vocab_size"],
        seq_len=meta["seq_len"],
        model_seed=0,
        inner_steps=4,
        sites={name: 1 for name in SITES},
        rounds=RoundPolicy(join_window_s=0.5, deadline_s=600),
        # leases as asked: the tests that pin a first lease's size; the probe has its own
        leases=LeasePolicy(min_ttl_s=2.0, initial_ttl_s=60.0, probe_share=1.0),
        second_moment=moments.DEFAULT_MODE,
        embedding_rows=rowcounts.DEFAULT_MODE,
    )
    fields.update(overrides)
    return RunSpec(**fields)


@dataclass
class LiveCoordinator:
    """A coordinator started as a real process, with its tokens and state directory."""

    url: str
    state_dir: Path
    secrets: dict
    process: subprocess.Popen | ForkedProcess
    port: int

    def client(self, who: str = "admin", **kwargs) -> CoordinatorClient:
        token = self.secrets["admin"] if who == "admin" else self.secrets["sites"][who]
        kwargs.setdefault("retry_budget_s", 10.0)
        return CoordinatorClient(self.url, token, **kwargs)

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def restart(self) -> None:
        self.process = start_process(self.state_dir, self.port)


#: test coordinators checkpoint their DARL lease book this often (production: 10,000 events),
#: so every kill-and-restart test also replays from a checkpoint plus the events after it
LEDGER_CHECKPOINT_EVERY = 5


#: the coordinators of the ``coordinator`` fixtures, forked from one process per test process
#: that has imported crossfed already (tests/helpers/coordinator_forks.py)
FORKS = ForkServer()


def pytest_sessionfinish() -> None:
    FORKS.close()


def launch_process(state_dir: Path, port: int) -> ForkedProcess:
    """``crossfed coordinator serve`` over ``state_dir`` on ``port``, forked; not waited for."""
    command = ServeCommand(
        state_dir,
        state_dir / "secrets.yaml",
        "127.0.0.1",
        port,
        ledger_checkpoint_every=LEDGER_CHECKPOINT_EVERY,
    )
    return FORKS.launch(command.argv(), command.log_path)


def start_process(state_dir: Path, port: int) -> ForkedProcess:
    """``launch_process``, waited for until it serves."""
    proc = launch_process(state_dir, port)
    wait_until_serving(proc, state_dir, "127.0.0.1", port, 240)
    return proc


class SpareCoordinators:
    """Fresh coordinator processes, each started while the test before its own runs.

    A coordinator spends seconds importing torch and the web stack before it serves; taking
    one that was launched a test earlier overlaps that with the earlier test's work. The spare
    starts at a low priority, so tests with tight timings (2 s lease TTLs) keep their CPU, and
    gets the normal priority back when a test takes it.
    """

    def __init__(self, root: Path) -> None:
        self.root, self.count = root, 0
        self.spare: LiveCoordinator | None = None

    def _launch(self) -> LiveCoordinator:
        self.count += 1
        state_dir = self.root / f"coordinator-{self.count}"
        state_dir.mkdir()
        secrets = ensure_secrets(state_dir / "secrets.yaml", SITES)
        port = free_port("127.0.0.1")
        proc = launch_process(state_dir, port)
        return LiveCoordinator(f"http://127.0.0.1:{port}", state_dir, secrets, proc, port)

    def take(self) -> LiveCoordinator:
        live = self.spare if self.spare is not None else self._launch()
        self.spare = None
        try:  # its own process group (a new session): every thread of it
            os.setpriority(os.PRIO_PGRP, live.process.pid, 0)
        except OSError:  # not allowed to raise it back: use a coordinator started now
            stop(live.process)
            live = self._launch()
        try:
            wait_until_serving(live.process, live.state_dir, "127.0.0.1", live.port, 240)
        except EndpointError:  # e.g. its port was taken meanwhile: start one now
            live = self._launch()
            wait_until_serving(live.process, live.state_dir, "127.0.0.1", live.port, 240)
        self.spare = self._launch()
        try:
            os.setpriority(os.PRIO_PGRP, self.spare.process.pid, 10)
        except OSError:
            pass
        return live

    def close(self) -> None:
        if self.spare is not None:
            stop(self.spare.process)


#: threads a site's Control starts: a lease's heartbeat and the next round's early lease
SITE_THREADS = (HEARTBEAT_THREAD, EARLY_ASK_THREAD)
#: a stopped heartbeat ends within its beat's try (3 s on loopback); a thread alive this long
#: after its test was never stopped
SITE_THREAD_GRACE_S = 10.0


@pytest.fixture(autouse=True)
def _no_site_thread_outlives_its_test() -> Iterator[None]:
    """After each test, no heartbeat or early-lease thread it started is still running: one
    left behind beats a lease its site no longer trains (and, its coordinator gone, logs into
    a later test's output)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + SITE_THREAD_GRACE_S
    started = [
        t for t in threading.enumerate() if t not in before and t.name.startswith(SITE_THREADS)
    ]
    for thread in started:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = sorted(t.name for t in started if t.is_alive())
    if alive:
        pytest.fail(f"site threads running {SITE_THREAD_GRACE_S:.0f} s after the test: {alive}")


@pytest.fixture(autouse=True)
def _reap_workflows() -> Iterator[None]:
    """After each test, nothing a workflow test started keeps running (a failed test's
    Snakemake, site jobs and coordinator would otherwise load every later test)."""
    yield
    workflow = sys.modules.get("tests.helpers.workflow")  # loaded by the tests that start one
    if workflow is not None:
        workflow.reap_workflows()


@contextmanager
def coordinator_keeping_every_model(
    state: Path,
    keep: tuple[str, ...] = ("--keep-models", "0"),
    certificate: tuple[Path, Path] | None = None,
) -> Iterator[LiveCoordinator]:
    """A standalone ``coordinator serve --keep-models 0`` in ``state`` (every global model
    kept, as a run that sites may join late is served; ``keep`` names other retention
    flags), stopped on leaving. With ``certificate`` (its PEM file and key) it serves
    HTTPS on localhost, as the README's coordinator VM does; the caller trusts it
    (``SSL_CERT_FILE``)."""
    state.mkdir(parents=True, exist_ok=True)
    secrets = ensure_secrets(state / "secrets.yaml", SITES)
    port = free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "crossfed", "coordinator", "serve", "--state-dir",
           str(state), "--secrets", str(state / "secrets.yaml"), "--host", "127.0.0.1",
           "--port", str(port), *keep]  # fmt: skip
    if certificate is not None:
        cmd += ["--ssl-certfile", str(certificate[0]), "--ssl-keyfile", str(certificate[1])]
    scheme, host = ("https", "localhost") if certificate else ("http", "127.0.0.1")
    with open(state / "coordinator.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_serving(proc, state, host, port, 240, scheme)
        yield LiveCoordinator(f"{scheme}://{host}:{port}", state, secrets, proc, port)
    finally:
        stop(proc)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="session")
def spare_coordinators(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpareCoordinators]:
    spares = SpareCoordinators(tmp_path_factory.mktemp("coordinators"))
    yield spares
    spares.close()


@pytest.fixture
def coordinator(spare_coordinators: SpareCoordinators) -> Iterator[LiveCoordinator]:
    """A fresh coordinator process (no run yet), its own state directory and tokens."""
    live = spare_coordinators.take()
    yield live
    stop(live.process)


@pytest.fixture
def run(coordinator: LiveCoordinator, tiny_data: Path) -> LiveCoordinator:
    """A coordinator serving a tiny run over ``tiny_data``."""
    coordinator.client().init_run(tiny_spec(tiny_data).to_dict())
    return coordinator


def digest_of(data_dir: Path, block_size: int = 8, seed: int = 7) -> str:
    return BlockSpace(read_meta(data_dir)["n_windows"], block_size, seed).digest()


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@dataclass
class StagedDelta:
    """An in-process coordinator whose round 1 has lumi's delta in its blob store."""

    coord: Coordinator
    now: list[float]  # the coordinator's clock: now[0] seconds
    master0: dict[str, torch.Tensor]  # generation 0
    held: dict  # lumi's lease
    path: Path  # the delta file
    key: str  # its blob key


def staged_delta(state_dir: Path, data: Path, *, seed: int, codec: str = "none") -> StagedDelta:
    """A coordinator (clock at 1000 s) over ``data``; lumi registered, holding a 2-block lease
    of round 1, its delta (generation 0 plus seeded noise) uploaded but not yet submitted."""
    now = [1000.0]
    coord = Coordinator(state_dir, clock=lambda: now[0])
    coord.init_run(tiny_spec(data))
    master0 = {k: v.clone() for k, v in coord.master.items()}
    coord.register("lumi", digest_of(data), 1, 1.0)
    held = coord.lease("lumi", 1, 2, None, 1.0)["lease"]
    gen = torch.Generator().manual_seed(seed)
    site = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in master0.items()}
    path = state_dir.parent / "delta.safetensors"
    key = save_delta(site, master0, path, codec=codec)
    asyncio.run(coord.blobs.write_stream(key, chunked(path.read_bytes()), 1 << 30))
    return StagedDelta(coord, now, master0, held, path, key)


async def chunked(data: bytes, size: int = 1 << 16) -> AsyncIterator[bytes]:
    """``data`` as an async body of ``size``-byte chunks."""
    for lo in range(0, len(data), size):
        yield data[lo : lo + size]


os.environ.setdefault("PYTHONUNBUFFERED", "1")
