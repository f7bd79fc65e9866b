"""Benchmark: heartbeat latency while the coordinator merges a round, lock held or not.

A real coordinator process (``crossfed coordinator serve``) serves a run of a Qwen3
``--flavour`` (default 0.6B; generation 0 drawn by torchtitan, as ``POST /v1/run`` does).
Three sites send random-weight deltas of the model's shapes (``bench/merge.py``'s
``write_inputs``) so a round closes and the coordinator merges it, while a fourth site
heartbeats a live lease every ``--every-ms`` (50) and each latency is recorded. Round 1 is
merged the current way (the merge holds the lock only to start and to commit); then the
same coordinator is restarted on its state with ``CROSSFED_MERGE_HOLDS_LOCK=1`` (the old
way: the merge holds the lock that leases and heartbeats wait on, for this benchmark only)
and round 2 is merged. A heartbeat counts as "during the merge" when it overlaps the
merge's span (the round report's ``merge_s`` + ``checkpoint_s`` before its close), as
"idle" when it overlaps neither a merge nor a delta's upload or submission. The last line is one
JSON object: ``p50/p99/max_ms_idle``, ``..._during_merge``, ``..._during_merge_locked``,
``merge_s``, ``merge_s_locked``.

    .venv/bin/python bench/heartbeat_merge.py                 # 0.6B: about 25 GB of disk
    .venv/bin/python bench/heartbeat_merge.py --flavour tiny  # a quick run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge import FLAVOURS, VOCAB, write_inputs  # noqa: E402

from crossfed.client.http import CoordinatorClient  # noqa: E402
from crossfed.coordinator.embedded import (  # noqa: E402
    ServeCommand,
    ensure_secrets,
    free_port,
    spawn_coordinator,
)
from crossfed.coordinator.generations import read_shapes  # noqa: E402
from crossfed.coordinator.runspec import LeasePolicy, RoundPolicy, RunSpec  # noqa: E402
from crossfed.coordinator.service import MERGE_HOLDS_LOCK_ENV  # noqa: E402
from crossfed.darl.blockspace import BlockSpace  # noqa: E402

HOST = "127.0.0.1"
SENDERS = ["a", "b", "c"]
WATCHER = "watch"


class Beats(threading.Thread):
    """Heartbeats of one lease every ``every_s``: (start wall time, seconds) per reply."""

    def __init__(self, client: CoordinatorClient, lease_id: int, every_s: float) -> None:
        super().__init__(name="heartbeats", daemon=True)
        self.client, self.lease_id, self.every_s = client, lease_id, every_s
        self.samples: list[tuple[float, float]] = []
        self.errors = 0
        self.paused = threading.Event()
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            if self.paused.is_set():
                continue
            started, t0 = time.time(), time.perf_counter()
            try:
                self.client.heartbeat(self.lease_id, WATCHER, 0, None)
            except Exception as exc:  # noqa: BLE001 (counted and reported)
                self.errors += 1
                print(f"heartbeat failed: {exc}", flush=True)
                continue
            self.samples.append((started, time.perf_counter() - t0))


def spec_for(flavour: str, join_s: float) -> RunSpec:
    """A run of ``flavour`` over 1,000 one-window blocks; a round closes ``join_s`` after
    its first lease, the watcher's lease still out (the deadline, 1 s, has passed)."""
    return RunSpec(
        n_windows=1000,
        block_size=1,
        data_seed=7,
        flavour=flavour,
        vocab_size=VOCAB if flavour in FLAVOURS else 512,  # Qwen3's, or a small one
        seq_len=32,
        model_seed=0,
        inner_steps=4,
        sites={site: 1 for site in [*SENDERS, WATCHER]},
        rounds=RoundPolicy(join_window_s=join_s, deadline_s=1.0),
        leases=LeasePolicy(min_ttl_s=600.0, initial_ttl_s=600.0),
    )


def one_round(
    clients: dict[str, CoordinatorClient],
    deltas: list[Path],
    round_no: int,
    generation: int,
    idle_s: float,
    on_leased: Callable[[], None],
) -> list[tuple[float, float]]:
    """Upload, lease and submit the three deltas of ``round_no`` (``on_leased`` once they
    hold their leases, which open the round's join window); the uploads' and the
    submissions' spans."""
    uploading = time.time()
    keys = [clients[site].upload_blob(path) for site, path in zip(SENDERS, deltas, strict=True)]
    uploaded = time.time()
    leases = [clients[site].lease(site, round_no, 4, 1.0, 1.0)["lease"] for site in SENDERS]
    on_leased()
    time.sleep(idle_s)  # heartbeats with nothing else going on
    started = time.time()
    for site, path, key, held in zip(SENDERS, deltas, keys, leases, strict=True):
        n = held["n_blocks"]
        clients[site].submit_delta(
            round_no, path, inline=False, key=key, site=site, lease_id=held["lease_id"],
            generation=generation, tokens=32 * n, steps=n, consumed=n,
        )  # fmt: skip
    return [(uploading, uploaded), (started, time.time())]


def wait_closed(admin: CoordinatorClient, round_no: int, timeout_s: float) -> dict:
    """The round's row once it is closed (its report holds merge_s and checkpoint_s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = admin.round_info(round_no)
        if info["status"] == "closed":
            return info
        time.sleep(0.5)
    raise TimeoutError(f"round {round_no} did not close within {timeout_s:.0f} s")


def figures(values: list[float]) -> dict[str, float | int]:
    ms = np.array(values or [math.nan]) * 1000.0
    return {
        "n": len(values),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "max_ms": round(float(ms.max()), 2),
    }


def split(
    samples: list[tuple[float, float]],
    merge: tuple[float, float],
    busy: list[tuple[float, float]],
) -> tuple[list[float], list[float]]:
    """Latencies of the heartbeats overlapping the merge, and of those overlapping nothing."""

    def overlaps(start: float, took: float, span: tuple[float, float]) -> bool:
        return start <= span[1] and start + took >= span[0]

    during = [took for start, took in samples if overlaps(start, took, merge)]
    idle = [
        took
        for start, took in samples
        if not any(overlaps(start, took, span) for span in [merge, *busy])
    ]
    return during, idle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavour", default="0.6B")
    ap.add_argument("--every-ms", type=float, default=50.0, help="heartbeat period")
    ap.add_argument("--idle-s", type=float, default=10.0, help="quiet heartbeats per round")
    ap.add_argument("--dir", type=Path, default=None, help="working folder (default: a temp dir)")
    ap.add_argument("--join-s", type=float, default=None, help="join window (idle-s + 30)")
    args = ap.parse_args()
    # room for the submissions, each a full check of a delta
    join_s = args.idle_s + 30.0 if args.join_s is None else args.join_s
    with tempfile.TemporaryDirectory(prefix="crossfed-hb-merge-", dir=args.dir) as tmp:
        work = Path(tmp)
        state = work / "coordinator"
        state.mkdir()
        secrets = ensure_secrets(state / "secrets.yaml", [*SENDERS, WATCHER])
        os.environ.pop(MERGE_HOLDS_LOCK_ENV, None)
        port = free_port(HOST)
        process = spawn_coordinator(ServeCommand(state, state / "secrets.yaml", HOST, port), 240)
        url = f"http://{HOST}:{port}"

        def client(who: str) -> CoordinatorClient:
            token = secrets["admin"] if who == "admin" else secrets["sites"][who]
            return CoordinatorClient(url, token, timeout_s=900.0)

        clients = {who: client(who) for who in ["admin", *SENDERS, WATCHER]}
        beats: Beats | None = None
        try:
            started = time.perf_counter()
            spec = spec_for(args.flavour, join_s)
            clients["admin"].init_run(spec.to_dict())
            print(f"run created in {time.perf_counter() - started:.1f} s", flush=True)
            layout = read_shapes(state / "models" / "master-000000.safetensors")
            params = sum(math.prod(s) for s in layout.values())
            state_file, deltas = write_inputs(work, layout, len(SENDERS), seed=0)
            state_file.unlink()  # only the deltas are needed
            print(f"{len(deltas)} deltas of {params:,} parameters written", flush=True)
            digest = BlockSpace(spec.n_windows, spec.block_size, spec.data_seed).digest()
            for who in [*SENDERS, WATCHER]:
                clients[who].register(who, digest, 1, 1.0)
            beats = None

            def start_beats() -> None:
                nonlocal beats
                if beats is None:  # round 1: the watcher's lease, heartbeaten to the end
                    held = clients[WATCHER].lease(WATCHER, 1, 1, 1.0, 1.0)["lease"]
                    beats = Beats(client(WATCHER), held["lease_id"], args.every_ms / 1000.0)
                    beats.start()

            results: dict = {}
            for round_no, locked in ((1, False), (2, True)):
                if locked:  # the same state, served by a coordinator whose merge holds the lock
                    assert beats is not None
                    beats.paused.set()
                    process.terminate()
                    process.wait(timeout=60)
                    os.environ[MERGE_HOLDS_LOCK_ENV] = "1"
                    command = ServeCommand(state, state / "secrets.yaml", HOST, port)
                    process = spawn_coordinator(command, 240)
                    beats.paused.clear()
                since = time.time()
                submitted = one_round(
                    clients, deltas, round_no, round_no - 1, args.idle_s, start_beats
                )
                assert beats is not None
                info = wait_closed(clients["admin"], round_no, timeout_s=1800)
                time.sleep(1.0)  # and the heartbeats just after the commit
                until = time.time()
                report = info["report"]
                merge = (info["closed_at"] - report["merge_s"] - report["checkpoint_s"],
                         info["closed_at"])  # fmt: skip
                mine = [s for s in beats.samples if since <= s[0] <= until]
                during, idle = split(mine, merge, submitted)
                results[locked] = {
                    "during": figures(during),
                    "idle": figures(idle),
                    "merge_s": round(report["merge_s"] + report["checkpoint_s"], 2),
                }
                r = results[locked]
                print(
                    f"round {round_no} ({'merge holds the lock' if locked else 'lock free'}): "
                    f"merge {r['merge_s']} s; heartbeat p50/p99/max ms during the merge "
                    f"{r['during']['p50_ms']}/{r['during']['p99_ms']}/{r['during']['max_ms']} "
                    f"(n={r['during']['n']}), idle {r['idle']['p50_ms']}/{r['idle']['p99_ms']}/"
                    f"{r['idle']['max_ms']} (n={r['idle']['n']})",
                    flush=True,
                )
        finally:
            if beats is not None:
                beats.stopped.set()
                beats.join(timeout=1000)
            process.terminate()
            try:
                process.wait(timeout=60)
            except Exception:  # noqa: BLE001
                process.kill()
            os.environ.pop(MERGE_HOLDS_LOCK_ENV, None)
    free, locked = results[False], results[True]
    out = {
        "flavour": args.flavour,
        "params": params,
        "every_ms": args.every_ms,
        "merge_s": free["merge_s"],
        "merge_s_locked": locked["merge_s"],
        "heartbeat_errors": beats.errors if beats is not None else None,
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    for name, part in (("idle", free["idle"]), ("during_merge", free["during"]),
                       ("idle_locked", locked["idle"]),
                       ("during_merge_locked", locked["during"])):  # fmt: skip
        out |= {f"{k}_{name}": v for k, v in part.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
