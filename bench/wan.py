"""Benchmark: a round's weight transfers over the paper's links, one stream against N.

A real coordinator process serves HTTPS (a self-signed certificate) on loopback; a WAN
emulator (``crossfed.testing.wan_emulator``, an emulator, not a network) stands in front of
it with one link per site of the paper's Table 3: Snellius 3 ms, LUMI 70 ms, Frontier 347 ms
round trip, each connection held to Linux's default 6 MiB window (so one stream moves at
most window / RTT, about 145 Mbit/s at 347 ms) and each link to an aggregate
``--rate-mbit`` (default 1 Gbit/s) per direction. Through the proxy (``--modes proxy``) the
site's bytes go through Debian's squid, a real forward proxy started here, as ``CONNECT``
tunnels: site -> link -> squid -> coordinator, as a Frontier compute node reaches out.

The payloads are bf16 safetensors files laid out as Qwen3-0.6B (1.19 GB) and Qwen3-1.7B
(3.4 GB), random values (``bench/transport.py``'s writer). Per payload, link, mode and
stream count, a client (``CoordinatorClient``, ``streams=N``, the site's code) uploads the
file as a delta blob and downloads it back as a site fetches a global model; the blob is
deleted from the coordinator between runs.

Last line, one JSON object: ``speedup_347ms`` (the 0.6B round trip, delta up plus model
down, at 347 ms over one stream, divided by the same over the most streams run, direct);
``round_s_0.6B_<link>`` (that round trip's seconds with the most streams, direct), and every
run's seconds under ``runs``. Targets: ``speedup_347ms`` >= 4; the 347 ms site's 0.6B round
trip within the paper's 90 s at an aggregate 1 Gbit/s.

    .venv/bin/python bench/wan.py                         # every payload, link and mode
    .venv/bin/python bench/wan.py --payloads 0.6B --links frontier --modes direct \\
        --streams 1 2 4 8 16                              # the streams sweep
    .venv/bin/python bench/wan.py --params 20000000 --links frontier --streams 1 4  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transport import (  # noqa: E402  (sibling benchmark)
    reset_peak,
    rss_bytes,
    start_coordinator,
    write_model,
)

from crossfed.client.http import CoordinatorClient  # noqa: E402
from crossfed.coordinator.embedded import ensure_secrets, free_port  # noqa: E402
from crossfed.testing.squid import Squid  # noqa: E402
from crossfed.testing.tls import self_signed  # noqa: E402
from crossfed.testing.wan_emulator import (  # noqa: E402
    DEFAULT_WINDOW,
    PAPER_LINKS,
    EmulatorProcess,
    Link,
)
from crossfed.wire.digests import PART_BYTES  # noqa: E402

#: the paper's per-round communication budget for 1.32 GiB (seconds)
PAPER_ROUND_S = 90.0


def transfer(url: str, token: str, streams: int, model: Path, key: str, dest: Path) -> dict:
    """Upload ``model`` as a blob and download it back over ``streams`` connections; the
    seconds of each, and the growth of this process's peak RSS meanwhile."""
    client = CoordinatorClient(url, token, streams=streams, retry_budget_s=300)
    try:
        client.health()
        exact = reset_peak(os.getpid())
        rss0 = rss_bytes(os.getpid())[0]
        t0 = time.perf_counter()
        client.upload_blob(model, key)
        t1 = time.perf_counter()
        client.download_blob(key, dest)
        t2 = time.perf_counter()
    finally:
        client.close()
    growth = rss_bytes(os.getpid())[1] - rss0 if exact else None
    dest.unlink()
    return {"up_s": t1 - t0, "down_s": t2 - t1, "round_s": t2 - t0, "rss_growth": growth}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--payloads", nargs="+", default=["0.6B", "1.7B"])
    parser.add_argument(
        "--params", type=int, default=None, help="scale every payload to about this many"
    )
    parser.add_argument("--links", nargs="+", default=list(PAPER_LINKS), choices=PAPER_LINKS)
    parser.add_argument("--modes", nargs="+", default=["direct", "proxy"])
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--rate-mbit", type=float, default=1000.0)
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: tmp)")
    args = parser.parse_args()
    if bad := set(args.modes) - {"direct", "proxy"}:
        parser.error(f"unknown mode(s) {sorted(bad)}; use direct, proxy")

    work = Path(tempfile.mkdtemp(prefix="crossfed-wan-", dir=args.dir))
    coordinator = None
    runs: list[dict] = []
    try:
        cert, tls_key = self_signed(work)
        os.environ["SSL_CERT_FILE"] = str(cert)
        state = work / "coordinator"
        state.mkdir()
        token = ensure_secrets(state / "secrets.yaml", ["bench"])["sites"]["bench"]
        port = free_port("127.0.0.1")
        coordinator = start_coordinator(state, port, tls=(cert, tls_key))
        squid = Squid()
        links = [
            Link(
                name,
                "127.0.0.1",
                port,
                rtt_ms=PAPER_LINKS[name],
                window_bytes=args.window,
                rate_mbit=args.rate_mbit,
            )
            for name in args.links
        ]
        with squid, EmulatorProcess(links) as direct_ports:
            proxied = [
                replace(link, name=f"{link.name}-proxy", target_port=squid.port) for link in links
            ]
            with EmulatorProcess(proxied) as proxy_ports:
                for payload in args.payloads:
                    model = work / f"{payload}.safetensors"
                    key, size, _ = write_model(model, args.params, payload)
                    blob = state / "blobs" / "blake3" / key.split(":")[1][:2]
                    for name in args.links:
                        for mode in args.modes:
                            for streams in args.streams:
                                if mode == "direct":
                                    os.environ.pop("HTTPS_PROXY", None)
                                    url = f"https://localhost:{direct_ports[name]}"
                                else:  # the site's side of the link leads to squid
                                    proxy = proxy_ports[f"{name}-proxy"]
                                    os.environ["HTTPS_PROXY"] = f"http://127.0.0.1:{proxy}"
                                    url = f"https://localhost:{port}"
                                os.environ["NO_PROXY"] = os.environ["no_proxy"] = ""
                                run = transfer(url, token, streams, model, key, work / "download")
                                shutil.rmtree(blob, ignore_errors=True)
                                run |= {"payload": payload, "bytes": size, "link": name,
                                        "rtt_ms": PAPER_LINKS[name], "mode": mode,
                                        "streams": streams}  # fmt: skip
                                runs.append(run)
                                print(json.dumps(run), flush=True)
                    model.unlink()
    finally:
        if coordinator is not None:
            coordinator.terminate()
            coordinator.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)

    round_s = {(r["payload"], r["link"], r["streams"], r["mode"]): r["round_s"] for r in runs}

    def seconds(payload: str, link: str, streams: int) -> float | None:
        """The round's seconds of a direct run, None where it did not run."""
        return round_s.get((payload, link, streams, "direct"))

    first = args.payloads[0]
    most = max(args.streams)
    one, many = seconds(first, "frontier", 1), seconds(first, "frontier", most)
    result: dict = {
        "bench": "wan",
        "payload": first,
        "rate_mbit": args.rate_mbit,
        "window_bytes": args.window,
        "part_bytes": PART_BYTES,
        "streams_n": most,
        "speedup_347ms": None if one is None or many is None else round(one / many, 3),
        "paper_round_s": PAPER_ROUND_S,
    }
    for name in args.links:
        value = seconds(first, name, most)
        result[f"round_s_{first}_{name}"] = None if value is None else round(value, 2)
    growths = [run["rss_growth"] for run in runs if run["rss_growth"] is not None]
    result["client_peak_rss_growth_mb"] = round(max(growths, default=0) / 2**20, 1)
    result["runs"] = runs
    print(json.dumps(result))


if __name__ == "__main__":
    main()
