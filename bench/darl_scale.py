"""DARL at scale: hot-path latency with M = 10^7 blocks against M = 10^3, and heartbeat load.

Part 1, side by side in one process: two coordinators (real SQLite state, WAL,
synchronous=FULL for grants and commits), one with 10^3 blocks and one with 10^7; for each of
100 sites in turn, lease + heartbeat + commit (a real, validated delta) on one and then the
other. No hot path may scan the block space, so the ratio of the mean latencies should stay
near 1 (target <= 1.2). The commit's delta check (every tensor read and tested for finite
values) does not depend on M and is also reported apart.

Part 2: 200 simulated sites heartbeat open-loop against a real coordinator process
(M = 10^7) over loopback HTTP (see bench/load.py); achieved heartbeats/s and p99 latency
(targets >= 1,000/s and < 50 ms).

The last line printed is ONE JSON object.

    .venv/bin/python bench/darl_scale.py [--sites 200] [--hb-hz 5] [--hb-s 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import bench_spec, run_load, start_run, zero_delta  # noqa: E402

from crossfed.coordinator.service import Coordinator  # noqa: E402
from crossfed.darl.blockspace import BlockSpace  # noqa: E402
from crossfed.wire.digests import sha256_file  # noqa: E402

SMALL, LARGE = 10**3, 10**7
BLOCKS_PER_LEASE = 4


async def _chunks(path: Path) -> AsyncIterator[bytes]:
    yield path.read_bytes()


class HotPath:
    """One in-process coordinator with `sites` registered and a valid delta in its blobs."""

    def __init__(self, root: Path, n_blocks: int, sites: list[str]) -> None:
        self.sites = sites
        self.coordinator = Coordinator(root / "state")
        spec = bench_spec(sites, n_blocks)
        self.coordinator.init_run(spec)
        master = load_file(str(self.coordinator.global_path(0)))
        delta = zero_delta(master, root / "delta.safetensors")
        self.blob = "sha256:" + sha256_file(delta)
        asyncio.run(self.coordinator.blobs.write_stream(self.blob, _chunks(delta), 1 << 30))
        digest = BlockSpace(spec.n_windows, spec.block_size, spec.data_seed).digest()
        for site in sites:
            self.coordinator.register(site, digest, 1, 1.0)
        # time the delta check apart: it reads every tensor and does not depend on M
        self.validate_s = 0.0
        validate = self.coordinator._validate_delta_blob

        def timed_validate(blob: str) -> None:
            started = time.perf_counter()
            validate(blob)
            self.validate_s = time.perf_counter() - started

        self.coordinator._validate_delta_blob = timed_validate

    def cycle(self, site: str) -> tuple[float, float, float, float]:
        """Seconds for lease, heartbeat and commit of one lease of one site, and the part of
        the commit spent checking the delta's tensors."""
        c = self.coordinator
        t0 = time.perf_counter()
        lease = c.lease(site, 1, BLOCKS_PER_LEASE, 1.0, 1.0)["lease"]
        t1 = time.perf_counter()
        c.heartbeat(lease["lease_id"], site, lease["n_blocks"], 1.0)
        t2 = time.perf_counter()
        c.submit(
            site=site,
            round_no=1,
            lease_id=lease["lease_id"],
            generation=0,
            tokens=32 * lease["n_blocks"],  # one 32-token window per block
            steps=lease["n_blocks"],
            consumed=lease["n_blocks"],
            blob=self.blob,
        )
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, self.validate_s


def hot_path_ratio(root: Path, n_sites: int) -> dict:
    sites = [f"site{i:03d}" for i in range(n_sites)]
    started = time.perf_counter()
    small = HotPath(root / "small", SMALL, ["warmup", *sites])
    large = HotPath(root / "large", LARGE, ["warmup", *sites])
    setup_s = time.perf_counter() - started
    for path in (small, large):  # first touch: permutation cache, SQLite pages, safetensors
        path.cycle("warmup")
    times: dict[int, list[tuple[float, float, float, float]]] = {SMALL: [], LARGE: []}
    for site in sites:  # interleaved, so machine noise hits both sides alike
        times[SMALL].append(small.cycle(site))
        times[LARGE].append(large.cycle(site))
    out = {"setup_s": round(setup_s, 1)}
    for m, samples in times.items():
        totals = [sum(s[:3]) for s in samples]
        darl = [sum(s[:3]) - s[3] for s in samples]
        out[f"mean_ms_{m:.0e}"] = round(statistics.fmean(totals) * 1000, 3)
        out[f"median_ms_{m:.0e}"] = round(statistics.median(totals) * 1000, 3)
        out[f"darl_mean_ms_{m:.0e}"] = round(statistics.fmean(darl) * 1000, 3)
        for k, op in enumerate(("lease", "heartbeat", "commit", "delta_check")):
            out[f"{op}_mean_ms_{m:.0e}"] = round(statistics.fmean(s[k] for s in samples) * 1000, 3)
    for key, name in (
        ("mean_ms", "ratio_1e7_vs_1e3"),
        ("median_ms", "median_ratio_1e7_vs_1e3"),
        ("darl_mean_ms", "darl_ratio_1e7_vs_1e3"),  # without the M-independent delta check
    ):
        out[name] = round(out[f"{key}_{LARGE:.0e}"] / out[f"{key}_{SMALL:.0e}"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=200, help="simulated sites over HTTP")
    parser.add_argument("--cycles", type=int, default=100, help="leases per M in part 1")
    parser.add_argument("--hb-hz", type=float, default=5.0, help="heartbeats per site per s")
    parser.add_argument("--hb-s", type=float, default=10.0, help="seconds of heartbeats")
    parser.add_argument("--skip-http", action="store_true", help="part 1 only")
    args = parser.parse_args()
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="crossfed-darl-scale-") as tmp:
        ratio = hot_path_ratio(Path(tmp) / "inproc", args.cycles)
        print(
            f"lease+heartbeat+commit: {ratio['mean_ms_1e+03']:.2f} ms at M=1e3, "
            f"{ratio['mean_ms_1e+07']:.2f} ms at M=1e7: ratio {ratio['ratio_1e7_vs_1e3']} "
            f"({ratio['darl_ratio_1e7_vs_1e3']} without the delta check)"
        )
        result |= ratio
        if not args.skip_http:
            run = start_run(Path(tmp) / "http", args.sites, LARGE)
            try:
                load = asyncio.run(run_load(run, args.hb_hz, args.hb_s, 5.0, 0))
            finally:
                run.stop()
            beat = load["heartbeat"]
            print(
                f"heartbeats: {load['heartbeats_per_s']}/s of {load['heartbeat_offered_per_s']}/s "
                f"offered, p50 {beat['p50_ms']} ms, p99 {beat['p99_ms']} ms, "
                f"{load['heartbeats_per_core_s']}/s per server core"
            )
            result |= {
                "heartbeats_per_s": load["heartbeats_per_s"],
                "heartbeat_offered_per_s": load["heartbeat_offered_per_s"],
                "p50_ms": beat["p50_ms"],
                "p99_ms": beat["p99_ms"],
                "heartbeat_server_cpu_us": load["heartbeat_server_cpu_us"],
                "heartbeats_per_core_s": load["heartbeats_per_core_s"],
                "http_errors": load["errors"],
            }
    result |= {
        "sites": args.sites,
        "targets": {"ratio_1e7_vs_1e3": 1.2, "heartbeats_per_s": 1000, "p99_ms": 50},
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
