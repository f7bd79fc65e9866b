"""Load: 200 simulated sites against one real coordinator process on loopback.

Each site registers, leases, heartbeats and commits a (zero) bf16 delta over HTTP, with its own
bearer token; the requests of each phase are spread over a window (``--spread-s``) as a
round's joins and commits would be, heartbeats run open-loop at ``--hb-hz`` per site. Prints
p50/p99 latency per request kind and the error count, then ONE JSON line.

    .venv/bin/python bench/load.py [--sites 200] [--hb-hz 5] [--hb-s 10]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from crossfed.client.http import CoordinatorClient
from crossfed.coordinator.embedded import ServeCommand, ensure_secrets, free_port, spawn_coordinator
from crossfed.coordinator.runspec import LeasePolicy, RoundPolicy, RunSpec
from crossfed.darl.blockspace import BlockSpace
from crossfed.wire.digests import sha256_file

HOST = "127.0.0.1"


def bench_spec(sites: list[str], n_blocks: int) -> RunSpec:
    """A tiny-model run over n_blocks one-window blocks; rounds never close during a bench."""
    return RunSpec(
        n_windows=n_blocks,
        block_size=1,
        data_seed=7,
        flavour="tiny",
        vocab_size=512,
        seq_len=32,
        model_seed=0,
        inner_steps=4,
        sites={site: 1 for site in sites},
        rounds=RoundPolicy(join_window_s=86_400.0, deadline_s=86_400.0),
        leases=LeasePolicy(min_ttl_s=600.0, initial_ttl_s=600.0),
    )


def zero_delta(master: dict[str, torch.Tensor], path: Path) -> Path:
    """A valid bf16 delta (all zeros) with the model's names and shapes."""
    save_file({k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in master.items()}, path)
    return path


@dataclass
class LiveRun:
    """A coordinator process serving a bench run, with its tokens and a delta to send."""

    url: str
    secrets: dict
    process: subprocess.Popen
    digest: str
    delta: Path
    sites: list[str]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_run(work: Path, n_sites: int, n_blocks: int) -> LiveRun:
    sites = [f"site{i:03d}" for i in range(n_sites)]
    state = work / "coordinator"
    state.mkdir(parents=True)
    secrets = ensure_secrets(state / "secrets.yaml", sites)
    port = free_port(HOST)
    process = spawn_coordinator(ServeCommand(state, state / "secrets.yaml", HOST, port), 240)
    url = f"http://{HOST}:{port}"
    admin = CoordinatorClient(url, secrets["admin"])
    spec = bench_spec(sites, n_blocks)
    admin.init_run(spec.to_dict())
    master = load_file(str(admin.download_model(0, work / "g0.safetensors")))
    delta = zero_delta(master, work / "delta.safetensors")
    digest = BlockSpace(spec.n_windows, spec.block_size, spec.data_seed).digest()
    return LiveRun(url, secrets, process, digest, delta, sites)


@dataclass
class Stats:
    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)

    async def timed(self, kind: str, request: Callable[[], Awaitable[dict]]) -> dict | None:
        started = time.perf_counter()
        try:
            reply = await request()
        except (TimeoutError, aiohttp.ClientError, RuntimeError) as exc:
            self.errors[kind] = self.errors.get(kind, 0) + 1
            if self.errors[kind] <= 3:
                print(f"{kind} failed: {exc}")
            return None
        self.latencies.setdefault(kind, []).append(time.perf_counter() - started)
        return reply

    def summary(self, kind: str) -> dict:
        values = np.array(self.latencies.get(kind, [float("nan")])) * 1000.0
        return {
            "n": len(self.latencies.get(kind, [])),
            "errors": self.errors.get(kind, 0),
            "p50_ms": round(float(np.percentile(values, 50)), 2),
            "p99_ms": round(float(np.percentile(values, 99)), 2),
        }


class SimSite:
    """One simulated site: the protocol's requests, each timed."""

    def __init__(self, http: aiohttp.ClientSession, run: LiveRun, name: str, stats: Stats):
        self.http, self.run, self.name, self.stats = http, run, name, stats
        self.headers = {"Authorization": f"Bearer {run.secrets['sites'][name]}"}
        self.lease: dict | None = None
        self.echo: tuple[int, float] | None = None

    async def _post(self, path: str, **kwargs) -> dict:
        async with self.http.post(
            path, headers=self.headers | kwargs.pop("headers", {}), **kwargs
        ) as r:
            body = await r.json()
            if r.status >= 400:
                raise RuntimeError(f"{r.status} {body}")
            return body

    async def register(self) -> None:
        body = {"digest": self.run.digest, "ranks": 1, "rtt_ms": 0.5}
        await self.stats.timed(
            "register", lambda: self._post(f"/v1/sites/{self.name}/register", json=body)
        )

    async def take_lease(self, n_blocks: int = 4) -> None:
        body = {"site": self.name, "round": 1, "n_blocks": n_blocks, "t_step_s": None}
        reply = await self.stats.timed("lease", lambda: self._post("/v1/leases", json=body))
        self.lease = reply["lease"] if reply else None

    async def heartbeat(self, consumed: int = 0) -> None:
        assert self.lease is not None
        body = {"site": self.name, "consumed": consumed, "t_step_s": 1.0}
        if self.echo is not None:
            body |= {"echo": self.echo[0], "echo_held_s": time.perf_counter() - self.echo[1]}
        path = f"/v1/leases/{self.lease['lease_id']}/heartbeat"
        reply = await self.stats.timed("heartbeat", lambda: self._post(path, json=body))
        if reply is not None:
            self.echo = (reply["echo"], time.perf_counter())

    async def commit(self) -> None:
        assert self.lease is not None
        params = {
            "site": self.name,
            "lease_id": self.lease["lease_id"],
            "generation": 0,
            "tokens": 32 * self.lease["n_blocks"],  # one 32-token window per block
            "steps": self.lease["n_blocks"],
            "consumed": self.lease["n_blocks"],
        }
        data = self.run.delta.read_bytes()
        key = sha256_file(self.run.delta)
        await self.stats.timed(
            "commit",
            lambda: self._post(
                "/v1/rounds/1/deltas/inline",
                params=params,
                data=data,
                headers={"X-Content-SHA256": key},
            ),
        )


async def spread(calls: list[Callable[[], Awaitable[None]]], window_s: float, rng) -> float:
    """Start each call at a uniform random moment of the window; returns the elapsed time."""
    started = time.perf_counter()

    async def at(offset: float, call: Callable[[], Awaitable[None]]) -> None:
        await asyncio.sleep(offset)
        await call()

    await asyncio.gather(*(at(rng.uniform(0, window_s), call) for call in calls))
    return time.perf_counter() - started


async def heartbeat_load(sites: list[SimSite], hz: float, seconds: float) -> float:
    """Open loop: every site heartbeats hz times a second (phases staggered); achieved rate."""
    period = 1.0 / hz
    started = time.perf_counter()

    async def beats(k: int, site: SimSite) -> None:
        n = 0
        while True:
            due = started + (k / len(sites) + n) * period
            if due - started >= seconds:
                return
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await site.heartbeat()
            n += 1

    done = len(sites[0].stats.latencies.get("heartbeat", []))
    await asyncio.gather(*(beats(k, site) for k, site in enumerate(sites)))
    elapsed = time.perf_counter() - started
    return (len(sites[0].stats.latencies.get("heartbeat", [])) - done) / elapsed


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def beats(stats: Stats) -> int:
    return len(stats.latencies.get("heartbeat", []))


def session(url: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        url,
        # below uvicorn's 5 s keep-alive, so no request goes out on a connection it closes
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
        timeout=aiohttp.ClientTimeout(total=60),
    )


async def run_load(run: LiveRun, hz: float, seconds: float, spread_s: float, seed: int) -> dict:
    gc.collect()  # the generator's own long-lived objects (torch, the delta) out of the way of
    gc.freeze()  # the cyclic collector, whose full passes would show up as request latency
    try:
        return await _run_load(run, hz, seconds, spread_s, seed)
    finally:
        gc.unfreeze()  # collectable again, so the interpreter's exit finalises them cleanly


async def _run_load(run: LiveRun, hz: float, seconds: float, spread_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    stats = Stats()
    async with session(run.url) as http:
        sites = [SimSite(http, run, name, stats) for name in run.sites]
        await spread([s.register for s in sites], spread_s, rng)
        await spread([s.take_lease for s in sites], spread_s, rng)
        live = [s for s in sites if s.lease is not None]
        server0, client0, n0 = cpu_seconds(run.process.pid), own_cpu_seconds(), beats(stats)
        rate = await heartbeat_load(live, hz, seconds)
        server_cpu = cpu_seconds(run.process.pid) - server0
        client_cpu = own_cpu_seconds() - client0
        n = beats(stats) - n0
        await spread([s.commit for s in live], spread_s, rng)
    return {
        "sites": len(sites),
        "load_avg_1min": round(os.getloadavg()[0], 2),  # this machine is shared: context
        **{kind: stats.summary(kind) for kind in ("register", "lease", "heartbeat", "commit")},
        "heartbeats_per_s": round(rate, 1),
        "heartbeat_offered_per_s": round(hz * len(live), 1),
        # CPU the coordinator process spent per heartbeat (all threads) and what it implies
        # for one otherwise idle core; the load generator's own CPU per heartbeat beside it
        "heartbeat_server_cpu_us": round(server_cpu / max(n, 1) * 1e6, 1),
        "heartbeats_per_core_s": round(n / server_cpu, 1) if server_cpu else None,
        "heartbeat_client_cpu_us": round(client_cpu / max(n, 1) * 1e6, 1),
        "errors": sum(stats.errors.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=100_000, help="M, one window each")
    parser.add_argument("--hb-hz", type=float, default=5.0, help="heartbeats per site per s")
    parser.add_argument("--hb-s", type=float, default=10.0, help="seconds of heartbeats")
    parser.add_argument("--spread-s", type=float, default=5.0, help="window of joins, commits")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="crossfed-load-") as tmp:
        run = start_run(Path(tmp), args.sites, args.blocks)
        try:
            result = asyncio.run(run_load(run, args.hb_hz, args.hb_s, args.spread_s, args.seed))
        finally:
            run.stop()
    for kind in ("register", "lease", "heartbeat", "commit"):
        s = result[kind]
        print(f"{kind:>9}: n={s['n']:5d} p50 {s['p50_ms']:7.2f} ms  p99 {s['p99_ms']:7.2f} ms")
    print(f"heartbeats: {result['heartbeats_per_s']}/s of {result['heartbeat_offered_per_s']}/s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
