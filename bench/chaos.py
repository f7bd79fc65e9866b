"""Chaos campaign: a short real run under injected faults, checked for exactly-once training.

Three site processes (``SiteRunner`` training torchtitan's tiny Qwen3, a few inner steps per
round) talk to a real coordinator process through a TCP proxy written here with asyncio. The
campaign injects, on a seeded schedule:

* site departures and rejoins: a site process is SIGKILLed mid-round and restarted later;
* coordinator crashes: SIGKILL and a restart on the same port and state directory;
* proxy faults: connections refused at accept, requests forwarded but their replies dropped,
  connections delayed, and every connection killed after a few seconds of life.

Then the coordinator's SQLite state is audited offline (ledger replayed into a fresh lease
book) and compared with what each site journalled. The last line printed is one JSON object:

``faults_injected``
    coordinator SIGKILLs + site departures + proxy faults that hit a request (refused
    connections, dropped replies, delayed connections, connections killed mid-request).
    Idle pooled connections the proxy killed are reported apart (``proxy_reaped_idle``).
``blocks_lost``
    exactly-once violations of the "at least once" kind: blocks of a finished epoch that no
    accepted delta covers, blocks of the current epoch that are neither committed, pooled
    nor held by a live lease, and blocks whose commit a site was told about but which are
    missing from the coordinator's audit table. NOT the ledger's ``blocks_lost`` column.
``blocks_duplicated``
    blocks merged more than once within one epoch (from the accepted deltas and the replayed
    ledger, independent of the audit table's primary key), plus audit rows that disagree.
``blocks_misattributed``
    committed blocks that differ from the blocks the site was leased and trained.
``ledger_blocks_reclaimed``, ``ledger_blocks_granted``, ``reclaimed_fraction``
    the ledger's own ``blocks_lost`` column (blocks granted but returned to the pool
    uncommitted: TTL expiry, release, untrained tails), over blocks granted.
``http_5xx``
    5xx answers the coordinator logged (its ``StatusCounter`` logs each one), all restarts.
``final_val_perplexity``, ``fault_free_final_val_perplexity``
    held-out perplexity of generation ``rounds`` under chaos and in a fault-free run of the
    same config (same data, seeds, sites and proxy path).

``overlap``, ``early_leases``
    whether the sites ran overlapped rounds (``--overlap``): a site sends its delta in the
    background and trains an early lease of the next round meanwhile, so it may hold two
    leases (one per round) when it is killed. The audit counts per lease, not per site.
    ``early_leases``: leases the ledger granted before their round opened.

Run: ``python bench/chaos.py`` (about 10 rounds; minutes) or ``--short`` (the test suite's
version). ``--no-reference`` skips the fault-free run; ``--overlap`` runs the sites with
overlapped rounds (the fault-free reference too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from crossfed.client.http import CoordinatorClient, Refused, Unreachable  # noqa: E402
from crossfed.coordinator.embedded import (  # noqa: E402
    ServeCommand,
    ensure_secrets,
    free_port,
    wait_until_serving,
)
from crossfed.train.schedule import LRSchedule  # noqa: E402

if TYPE_CHECKING:  # torch: a site worker imports it after its keeper started
    from crossfed.coordinator.runspec import RunSpec

SITES = {"snellius": 1.0, "lumi": 1.3, "frontier": 1.6}  # site -> slowdown
HOST = "127.0.0.1"


@dataclass(frozen=True)
class ChaosConfig:
    """One campaign: the run's shape and the fault schedule's knobs."""

    rounds: int = 10
    seed: int = 0
    documents: int = 5  # of the embedded corpus: a few hundred windows, so epochs finish
    seq_len: int = 32
    vocab_size: int = 512
    block_size: int = 16
    inner_steps: int = 8
    micro_batch: int = 4
    coordinator_kills: int = 3
    site_kills: int = 4
    proxy_refuse_p: float = 0.08
    proxy_drop_reply_p: float = 0.06
    proxy_delay_p: float = 0.15
    proxy_delay_s: tuple[float, float] = (0.1, 0.8)
    proxy_lifetime_s: tuple[float, float] = (1.5, 5.0)
    timeout_s: float = 1200.0
    faults: bool = True
    overlap: bool = False  # overlapped rounds: two leases per site, the next one early
    min_ttl_s: float = 6.0  # the leases' shortest TTL
    checkpoint_every: int = 0  # inner steps between mid-phase checkpoints (0: none)
    step_s: float = 0.0  # each step lasts at least this long times the site's slowdown
    embedding_rows: str | None = None  # outer.embedding_rows (None: a new run's default)


SHORT = ChaosConfig(rounds=4, coordinator_kills=1, site_kills=2, timeout_s=600.0)


# ---------------------------------------------------------------------------- the proxy
@dataclass
class _Link:
    """One proxied connection's state, as the reaper sees it."""

    opened: float
    outstanding: bool = False  # client bytes went up since the last reply bytes came down


class ChaosProxy:
    """TCP proxy on loopback in front of the coordinator that misbehaves on purpose.

    Per new connection (seeded): refuse it, drop its first reply, or delay everything the
    client sends; and kill every connection after a random lifetime. With ``faults=False``
    it forwards faithfully (the fault-free run takes the same path).
    """

    def __init__(self, upstream_port: int, config: ChaosConfig, seed: int) -> None:
        self.upstream_port = upstream_port
        self.config = config
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.port = free_port(HOST)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="chaos-proxy", daemon=True)
        self._ready = threading.Event()
        self._server: asyncio.AbstractServer | None = None

    def start(self) -> int:
        self._thread.start()
        self._ready.wait(10)
        return self.port

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, HOST, self.port)
        )
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        c = self.config
        self.counts["connections"] += 1
        roll = self.rng.random() if c.faults else 1.0
        if roll < c.proxy_refuse_p:
            self.counts["refused"] += 1
            writer.transport.abort()
            return
        drop_reply = roll < c.proxy_refuse_p + c.proxy_drop_reply_p
        delay = 0.0
        if c.faults and self.rng.random() < c.proxy_delay_p:
            delay = self.rng.uniform(*c.proxy_delay_s)
            self.counts["delayed"] += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(HOST, self.upstream_port)
        except OSError:
            self.counts["upstream_down"] += 1
            writer.transport.abort()
            return
        link = _Link(opened=time.monotonic())
        up = asyncio.ensure_future(self._pump_up(reader, up_writer, link, delay))
        down = asyncio.ensure_future(self._pump_down(up_reader, writer, link, drop_reply))
        lifetime = self.rng.uniform(*c.proxy_lifetime_s) if c.faults else None
        done, _ = await asyncio.wait({up, down}, timeout=lifetime, return_when="FIRST_COMPLETED")
        if not done:
            self.counts["reaped_mid_request" if link.outstanding else "reaped_idle"] += 1
        for task in (up, down):
            task.cancel()
        for w in (writer, up_writer):
            w.transport.abort()

    async def _pump_up(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        delay: float,
    ) -> None:
        try:
            while data := await reader.read(65536):
                if delay:
                    await asyncio.sleep(delay)
                link.outstanding = True
                writer.write(data)
                await writer.drain()
        except OSError:  # either side reset: the connection is over
            return

    async def _pump_down(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        drop_reply: bool,
    ) -> None:
        try:
            while data := await reader.read(65536):
                if drop_reply:
                    self.counts["dropped_reply"] += 1
                    return  # the coordinator did the work; its answer never arrives
                link.outstanding = False
                writer.write(data)
                await writer.drain()
        except OSError:
            return


# ---------------------------------------------------------------------------- processes
def spawn_coordinator(
    state_dir: Path,
    port: int,
    timeout_s: float = 240.0,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """``crossfed coordinator serve`` (with ``args``, in ``env`` over ours) in its own
    session, appending to coordinator.log."""
    command = ServeCommand(state_dir, state_dir / "secrets.yaml", HOST, port)
    cmd = [sys.executable, "-m", "crossfed", *command.argv(), *args]
    with open(command.log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    wait_until_serving(proc, state_dir, HOST, port, timeout_s)
    return proc


def spawn_worker(
    site: str, url: str, work: Path, data: Path, config: ChaosConfig
) -> subprocess.Popen:
    """One site process: trains rounds back to back until generation ``rounds``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--site", site]
    cmd += ["--url", url, "--work", str(work), "--data", str(data)]
    cmd += ["--config", json.dumps(asdict(config))]
    with open(work / f"{site}.log", "ab") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )


def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---------------------------------------------------------------------------- the data
def prepare_data(root: Path, config: ChaosConfig) -> Path:
    """A small window store from the first documents of the embedded corpus."""
    from crossfed.data.corpus import write_embedded_corpus
    from crossfed.data.prepare import prepare

    data = root / "data"
    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    shards = write_embedded_corpus(corpus, shards=1, max_documents=config.documents)
    prepare(
        data,
        inputs=shards,
        vocab_size=config.vocab_size,
        seq_len=config.seq_len,
        val_fraction=0.1,
        shards=1,
        log=lambda *_: None,
    )
    return data


def run_spec(data: Path, config: ChaosConfig) -> RunSpec:
    from crossfed.coordinator.runspec import LeasePolicy, RoundPolicy, RunSpec
    from crossfed.data.windows import read_meta

    meta = read_meta(data)
    return RunSpec(
        n_windows=meta["n_windows"],
        block_size=config.block_size,
        data_seed=config.seed + 11,
        flavour="tiny",
        vocab_size=meta["vocab_size"],
        seq_len=meta["seq_len"],
        model_seed=config.seed,
        inner_steps=config.inner_steps,
        sites=dict.fromkeys(SITES, 1),
        schedule=LRSchedule(
            warmup_steps=config.inner_steps, total_steps=config.inner_steps * config.rounds
        ),
        rounds=RoundPolicy(join_window_s=2.0, deadline_s=60.0),
        leases=LeasePolicy(min_ttl_s=config.min_ttl_s, initial_ttl_s=30.0),
        embedding_rows=config.embedding_rows,
    )


# ---------------------------------------------------------------------------- site worker
class JournalClient(CoordinatorClient):
    """A site's client that journals every lease it gets and every delta acknowledged."""

    def __init__(self, *args: Any, journal: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.journal = journal

    def note(self, **record: Any) -> None:
        with open(self.journal, "a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def lease(self, site: str, round_no: int, n_blocks: int, *args: Any) -> dict[str, Any]:
        reply = super().lease(site, round_no, n_blocks, *args)
        if reply.get("lease"):
            lease = reply["lease"]
            self.note(
                event="lease",
                site=site,
                lease_id=lease["lease_id"],
                epoch=lease["epoch"],
                blocks=lease["blocks"],
                round=round_no,
            )
        return reply

    def submit_delta(self, round_no: int, path: Path, **kwargs: Any) -> dict[str, Any]:
        reply = super().submit_delta(round_no, path, **kwargs)
        if reply.get("accepted"):
            self.note(
                event="accepted",
                site=kwargs.get("site"),
                lease_id=kwargs.get("lease_id"),
                consumed=kwargs.get("consumed"),
                round=round_no,
                already=bool(reply.get("already")),
            )
        return reply


def worker(args: argparse.Namespace) -> int:
    """The ``worker`` subcommand: one site's process."""
    from crossfed.site.keepalive import REQUEST_S, keep_leases

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    work = Path(args.work)
    token = (work / "tokens" / args.site).read_text().strip()
    # as a site job does: a killed predecessor's leases beat on while this one imports torch
    keeper = keep_leases(
        work / "sites" / args.site,
        CoordinatorClient(args.url, token, timeout_s=REQUEST_S, retry_budget_s=REQUEST_S),
        args.site,
    )
    import torch

    from crossfed.site import SiteRunner, SiteSettings
    from crossfed.site.loop import ChainOutcome, ChainSettings, next_action
    from crossfed.site.records import RoundOutcome
    from crossfed.train.inner import InnerConfig
    from crossfed.train.overlap import OverlapConfig

    torch.set_num_threads(1)
    config = ChaosConfig(**json.loads(args.config))
    client = JournalClient(
        args.url, token, retry_budget_s=240.0, journal=work / f"journal-{args.site}.jsonl"
    )
    settings = SiteSettings(
        site=args.site,
        data_dir=Path(args.data),
        work_dir=work / "sites",
        block_size=config.block_size,
        data_seed=config.seed + 11,
        inner=InnerConfig(
            micro_batch=config.micro_batch,
            slowdown=SITES[args.site],
            min_step_s=config.step_s * SITES[args.site],
        ),
        heartbeat_s=0.5,
        checkpoint_every=config.checkpoint_every,
        lease_wait_s=20.0,
        overlap=OverlapConfig(enabled=config.overlap),
    )
    runner = SiteRunner(settings, client)
    runner.keeper = keeper
    runner.chained = True  # this loop trains the next round while a delta is sent
    # the rounds this process's part is in (accepted, or being sent in the background): as
    # in crossfed.site.loop.run_chain, a site with overlap trains the next round at once
    # while the open round's delta is in flight (the runner's, until that round's merged
    # model is here: a resend the coordinator had already is answered at once), never further
    chain = ChainSettings(through_round=config.rounds)
    decisions = ChainOutcome(args.site, "walltime")
    done: set[int] = set()

    def record(outcome: RoundOutcome) -> None:
        client.note(event="outcome", **{k: v for k, v in asdict(outcome).items() if k != "extra"})

    while True:
        for outcome in runner.settled():
            record(outcome)
        try:
            status = client.status()
        except (Unreachable, Refused) as exc:
            logging.warning("status: %s", exc)
            continue
        if status["generation"] >= config.rounds:
            break
        current = int(status["round"])
        ahead = runner.overlapped and runner.in_flight
        action, round_no = next_action(current, done, chain, decisions, (), time.time(), ahead)
        if action != "train":  # wait for the others and the merge
            time.sleep(0.5)
            continue
        try:
            outcome = runner.run_round(round_no)
        except (Unreachable, Refused) as exc:  # a real job would fail and be resubmitted
            client.note(event="error", site=args.site, round=round_no, error=str(exc))
            time.sleep(1.0)
            continue
        if outcome.status == "sending":
            done.add(round_no)
            continue
        record(outcome)
        if outcome.status in ("accepted", "missed"):
            # as run_chain: a round missed (closed, or already contributed to by this site
            # before a restart) is not asked for again
            done.add(outcome.round)
        if outcome.status != "accepted":
            time.sleep(0.5)
    try:
        for outcome in runner.finish():
            record(outcome)
    except (Unreachable, Refused) as exc:
        client.note(event="error", site=args.site, round=status["round"], error=str(exc))
    return 0


# ---------------------------------------------------------------------------- campaign
@dataclass
class Campaign:
    """Processes of one campaign and the faults it injected."""

    config: ChaosConfig
    root: Path
    data: Path
    state: Path
    port: int
    proxy: ChaosProxy
    coordinator: subprocess.Popen
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    injected: Counter = field(default_factory=Counter)
    crashes: int = 0

    @property
    def proxy_url(self) -> str:
        return f"http://{HOST}:{self.proxy.port}"

    def admin(self) -> CoordinatorClient:
        secrets = json.loads((self.root / "admin.json").read_text())
        return CoordinatorClient(f"http://{HOST}:{self.port}", secrets["admin"], retry_budget_s=5)

    def status(self) -> dict[str, Any] | None:
        client = self.admin()
        try:
            return client.status()
        except (Unreachable, Refused, httpx.HTTPError):
            return None
        finally:
            client.close()

    def start_worker(self, site: str) -> None:
        self.workers[site] = spawn_worker(site, self.proxy_url, self.root, self.data, self.config)


def run_campaign(root: Path, config: ChaosConfig, data: Path) -> dict[str, Any]:
    """One run from a fresh coordinator to generation ``config.rounds``; returns its figures."""
    root.mkdir(parents=True, exist_ok=True)
    state = root / "coordinator"
    state.mkdir(exist_ok=True)
    secrets = ensure_secrets(state / "secrets.yaml", list(SITES))
    (root / "admin.json").write_text(json.dumps({"admin": secrets["admin"]}))
    os.chmod(root / "admin.json", 0o600)
    (root / "tokens").mkdir(exist_ok=True)
    for site, token in secrets["sites"].items():
        (root / "tokens" / site).write_text(token)
        os.chmod(root / "tokens" / site, 0o600)
    port = free_port(HOST)
    coordinator = spawn_coordinator(state, port)
    proxy = ChaosProxy(port, config, seed=config.seed)
    proxy.start()
    camp = Campaign(config, root, data, state, port, proxy, coordinator)
    admin = camp.admin()
    admin.init_run(run_spec(data, config).to_dict())
    admin.close()
    rng = random.Random(config.seed + 1)
    plan = fault_plan(config, rng)
    started = time.monotonic()
    for site in SITES:
        camp.start_worker(site)
    generation = 0
    try:
        while True:
            if time.monotonic() - started > config.timeout_s:
                raise RuntimeError(f"campaign timed out at generation {generation}")
            status = camp.status()
            if status is not None:
                generation = status["generation"]
                if generation >= config.rounds:
                    break
                while plan and status["round"] >= plan[0][0]:
                    _, kind = plan.pop(0)
                    time.sleep(rng.uniform(0.0, 2.0))  # somewhere inside the round
                    inject(camp, kind, rng)
            for site, proc in list(camp.workers.items()):
                if proc.poll() not in (None, 0):  # died on its own: a bug, not a fault
                    camp.crashes += 1
                    camp.start_worker(site)
            time.sleep(0.3)
        wall_s = time.monotonic() - started
        model = root / f"global-{config.rounds:06d}.safetensors"
        admin = camp.admin()
        admin.download_model(config.rounds, model)
        admin.close()
    finally:
        for proc in camp.workers.values():
            kill(proc)
        kill(camp.coordinator, signal.SIGTERM)
        proxy.stop()
    figures = audit(state, root)
    figures.update(
        wall_s=round(wall_s, 1),
        worker_crashes=camp.crashes,
        http_5xx=count_5xx(state / "coordinator.log"),
        injected=dict(camp.injected),
        proxy=dict(proxy.counts),
        model=str(model),
    )
    return figures


def fault_plan(config: ChaosConfig, rng: random.Random) -> list[tuple[int, str]]:
    """(round, fault) pairs in round order: coordinator kills and site departures."""
    if not config.faults:
        return []
    rounds = range(1, config.rounds + 1)
    plan = [(rng.choice(rounds), "coordinator") for _ in range(config.coordinator_kills)]
    plan += [(rng.choice(rounds), "site") for _ in range(config.site_kills)]
    return sorted(plan)


def inject(camp: Campaign, kind: str, rng: random.Random) -> None:
    """SIGKILL the coordinator (restart on the same port) or a site (rejoins later)."""
    if kind == "coordinator":
        kill(camp.coordinator)
        camp.injected["coordinator_sigkill"] += 1
        time.sleep(rng.uniform(0.5, 2.0))
        camp.coordinator = spawn_coordinator(camp.state, camp.port)
        return
    site = rng.choice(sorted(SITES))
    kill(camp.workers[site])
    camp.injected["site_departures"] += 1
    time.sleep(rng.uniform(1.0, 4.0))
    camp.start_worker(site)
    camp.injected["site_rejoins"] += 1


def count_5xx(log: Path) -> int:
    text = log.read_text(errors="replace") if log.exists() else ""
    return sum(1 for line in text.splitlines() if " http_5xx " in f" {line} ")


# ---------------------------------------------------------------------------- the audit
def audit(state: Path, root: Path) -> dict[str, Any]:
    """Exactly-once figures from the coordinator's database and the sites' journals."""
    from crossfed.coordinator.runspec import RunSpec
    from crossfed.darl.blockspace import BlockSpace
    from crossfed.darl.leases import LeaseBook
    from crossfed.darl.ledger import COMMITTED_TABLE, LedgerStore

    conn = sqlite3.connect(f"file:{state / 'state.sqlite'}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        spec = RunSpec.from_dict(json.loads(meta["spec"]))
        space = BlockSpace(spec.n_windows, spec.block_size, spec.data_seed)
        book = LeaseBook(space.n_blocks)
        LedgerStore(conn).replay(book)
        deltas = [dict(r) for r in conn.execute("SELECT * FROM deltas")]
        audit_rows = conn.execute(
            f"SELECT epoch, block, lease_id FROM {COMMITTED_TABLE}"
        ).fetchall()
        opened = dict(conn.execute("SELECT round_no, opened_at FROM rounds").fetchall())
        grants = [json.loads(a) for (a,) in conn.execute(
            "SELECT args FROM darl_events WHERE op = 'grant'"
        )]  # fmt: skip
    finally:
        conn.close()
    merged: Counter[tuple[int, int]] = Counter()
    by_lease: dict[int, list[int]] = {}
    for delta in deltas:
        lease = book.lease(delta["lease_id"])
        blocks = space.permutation(lease.epoch)[lease.start : lease.start + delta["consumed"]]
        by_lease[delta["lease_id"]] = [int(b) for b in blocks]
        merged.update((lease.epoch, int(b)) for b in blocks)
    duplicated = sum(n - 1 for n in merged.values() if n > 1)
    audited = Counter((int(e), int(b)) for e, b, _ in audit_rows)
    duplicated += len(set(audited) ^ set(merged))  # audit table and deltas disagree
    lost = 0
    for epoch in range(book.epoch):  # finished epochs: every block merged
        lost += space.n_blocks - sum(1 for e, _ in merged if e == epoch)
    for epoch in book.open_epochs():  # the current epoch (and one leased ahead): a place each
        cover = np.zeros(space.n_blocks, dtype=np.int64)
        for start, end in book.committed_spans(epoch) + book.pool_spans(epoch):
            cover[start:end] += 1
        for lease in book.active_leases():
            if lease.epoch == epoch:
                cover[lease.start : lease.end] += 1
        lost += int((cover == 0).sum())
        duplicated += int((cover > 1).sum())
    journal = read_journals(root)
    leased = {r["lease_id"]: r for r in journal if r["event"] == "lease"}
    acked = {r["lease_id"]: r for r in journal if r["event"] == "accepted"}
    audit_by_lease = Counter(int(lease_id) for _, _, lease_id in audit_rows)
    misattributed = 0
    for lease_id, ack in acked.items():
        lost += max(0, ack["consumed"] - audit_by_lease.get(lease_id, 0))
        trained = leased.get(lease_id, {}).get("blocks", [])[: ack["consumed"]]
        if lease_id in by_lease and trained and trained != by_lease[lease_id]:
            misattributed += len(set(trained) ^ set(by_lease[lease_id]))
    stats = book.site_stats().values()
    granted = sum(s.blocks_granted for s in stats)
    reclaimed = sum(s.blocks_lost for s in stats)
    outcomes = Counter(r["status"] for r in journal if r["event"] == "outcome")
    # early leases (overlapped rounds): granted before their round opened
    early = sum(1 for g in grants if g["now"] < opened.get(g["round_no"], float("inf")))
    return {
        "blocks_lost": lost,
        "blocks_duplicated": duplicated,
        "blocks_misattributed": misattributed,
        "blocks_committed": book.committed_total,
        "n_blocks": space.n_blocks,
        "epochs_completed": book.epoch,
        "deltas_accepted": len(deltas),
        "tokens_merged": sum(d["tokens"] for d in deltas),
        "acknowledged_by_sites": len(acked),
        "ledger_blocks_granted": granted,
        "ledger_blocks_reclaimed": reclaimed,
        "reclaimed_fraction": round(reclaimed / granted, 4) if granted else 0.0,
        "site_outcomes": dict(outcomes),
        "site_errors": sum(1 for r in journal if r["event"] == "error"),
        "early_leases": early,
    }


def read_journals(root: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(root.glob("journal-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by SIGKILL
                    continue
    return records


def val_perplexity(model_path: Path, data: Path) -> float:
    import torch
    from safetensors.torch import load_file

    from crossfed.data.windows import WindowStore
    from crossfed.train.inner import evaluate
    from crossfed.train.model import build_model, load_parameters

    torch.manual_seed(0)
    val = WindowStore.open(data, "val")
    model = build_model("tiny", vocab_size=val.vocab_size)
    load_parameters(model, load_file(str(model_path)))
    with torch.no_grad():
        _, ppl = evaluate(model, val.windows, val.n_windows, batch=16, max_windows=256)
    return ppl


# ---------------------------------------------------------------------------- entry
def campaign(args: argparse.Namespace) -> int:
    config = SHORT if args.short else ChaosConfig()
    config = replace(
        config, seed=args.seed, rounds=args.rounds or config.rounds, overlap=args.overlap
    )
    root = Path(args.workdir) if args.workdir else REPO / "results" / "bench" / "chaos"
    root.mkdir(parents=True, exist_ok=True)
    data = prepare_data(root, config)
    chaos = run_campaign(root / f"chaos-{int(time.time())}", config, data)
    result: dict[str, Any] = {
        "rounds": config.rounds,
        "sites": len(SITES),
        "seed": config.seed,
        "overlap": config.overlap,
        "faults_injected": faults_injected(chaos),
        "faults": {**chaos["injected"], **_proxy_faults(chaos["proxy"])},
        "proxy_reaped_idle": chaos["proxy"].get("reaped_idle", 0),
        **{k: chaos[k] for k in _REPORTED},
        "final_val_perplexity": round(val_perplexity(Path(chaos["model"]), data), 3),
    }
    if not args.no_reference:
        calm = run_campaign(root / f"calm-{int(time.time())}", replace(config, faults=False), data)
        result.update(
            fault_free_final_val_perplexity=round(val_perplexity(Path(calm["model"]), data), 3),
            fault_free_wall_s=calm["wall_s"],
            fault_free={k: calm[k] for k in _REPORTED},
        )
        result["perplexity_ratio"] = round(
            result["final_val_perplexity"] / result["fault_free_final_val_perplexity"], 4
        )
    result["workdir"] = str(root)
    print(json.dumps(result))
    return 0


_REPORTED = (
    "blocks_lost",
    "blocks_duplicated",
    "blocks_misattributed",
    "reclaimed_fraction",
    "http_5xx",
    "ledger_blocks_reclaimed",
    "ledger_blocks_granted",
    "blocks_committed",
    "n_blocks",
    "epochs_completed",
    "deltas_accepted",
    "tokens_merged",
    "acknowledged_by_sites",
    "site_outcomes",
    "site_errors",
    "early_leases",
    "worker_crashes",
    "wall_s",
)


def _proxy_faults(counts: dict[str, int]) -> dict[str, int]:
    names = {
        "refused": "proxy_refused_connections",
        "dropped_reply": "proxy_dropped_replies",
        "delayed": "proxy_delayed_connections",
        "reaped_mid_request": "proxy_killed_mid_request",
    }
    return {new: counts.get(old, 0) for old, new in names.items()}


def faults_injected(figures: dict[str, Any]) -> int:
    injected = figures["injected"]
    return (
        injected.get("coordinator_sigkill", 0)
        + injected.get("site_departures", 0)
        + sum(_proxy_faults(figures["proxy"]).values())
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    work = sub.add_parser("worker", help="(internal) one site process")
    for name in ("--site", "--url", "--work", "--data", "--config"):
        work.add_argument(name, required=True)
    parser.add_argument("--short", action="store_true", help="the test suite's short campaign")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="default: results/bench/chaos")
    parser.add_argument("--no-reference", action="store_true", help="skip the fault-free run")
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="overlapped rounds: each site trains the next round's early lease while its "
        "delta is sent and merged (two leases per site)",
    )
    args = parser.parse_args(argv)
    if args.command == "worker":
        return worker(args)
    return campaign(args)


if __name__ == "__main__":
    raise SystemExit(main())
