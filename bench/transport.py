"""Benchmark: blob upload + download of Qwen3-0.6B-sized bf16 weights through a real coordinator.

A coordinator process (``crossfed coordinator serve``) and client processes talk over
loopback; the weights are a 596M-parameter bf16 safetensors file laid out as the 310 tensors
of Qwen3-0.6B (random values, written tensor by tensor). Measured in the same run,
alternating, ``--repeat`` times (medians are reported):

* raw loopback TCP: one process ``sendall``s the same number of bytes from memory to another
  that ``recv_into``s and drops them (no HTTP, no disk, no integrity check);
* blob upload: ``CoordinatorClient.upload_blob`` in parts of ``--part-mb`` (the server hashes
  with BLAKE3, writes, fsyncs and renames; the key was computed when the file was written);
* blob download: ``CoordinatorClient.download_blob`` in ranges (the client hashes, writes,
  fsyncs and renames its copy);
* inline: the whole file in ONE request, the way the inline route receives a delta.

``throughput_ratio`` is (2 x bytes / (upload_s + download_s)) / raw TCP bytes/s;
``cpu_efficiency_ratio`` is raw TCP's CPU seconds per byte (sender + receiver) over ours
(client + server, averaged over the two directions), which a busy machine distorts less.
``peak_rss_ratio`` is the largest peak RSS growth of a client plus that of the server during
one transfer, over the model's bytes. Disk speed bounds the blob path (fsync); ``--dir
/dev/shm`` takes the disk out. Prints one JSON object as its last line.

    .venv/bin/python bench/transport.py                 # 1.19 GB, several minutes
    .venv/bin/python bench/transport.py --params 100000000 --repeat 2 --dir /dev/shm
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import resource
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import blake3
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge import scaled_layout  # noqa: E402  (sibling benchmark: the Qwen3-0.6B layout)

from crossfed.client.http import CoordinatorClient  # noqa: E402
from crossfed.coordinator.embedded import (  # noqa: E402
    ensure_secrets,
    free_port,
    wait_until_serving,
)
from crossfed.wire.digests import iter_chunks  # noqa: E402
from crossfed.wire.libc import keep_stream_buffers_in_heap  # noqa: E402
from crossfed.wire.tensors import TensorSpec, save_stream  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- fixtures
def write_model(path: Path, params: int | None, flavour: str = "0.6B") -> tuple[str, int, int]:
    """A bf16 model file of a Qwen3 flavour's layout (random values), tensor by tensor;
    (digest, bytes, tensors)."""
    layout = scaled_layout(flavour, params)
    specs = [TensorSpec(name, torch.bfloat16, shape) for name, shape in layout.items()]
    gen = torch.Generator().manual_seed(0)

    def produce(spec: TensorSpec) -> torch.Tensor:
        return (torch.randn(spec.shape, generator=gen) * 0.02).to(torch.bfloat16)

    digest = save_stream(path, specs, produce, {"format": "bench"})
    return digest, path.stat().st_size, len(specs)


def hash_rates(path: Path) -> dict[str, float]:
    """Single-core GB/s of each digest over the first 256 MiB of the file (page cache)."""
    data = path.read_bytes()[: 256 << 20]
    rates = {}
    for name, make in (("blake3", blake3.blake3), ("sha256", hashlib.sha256)):
        hasher = make()
        t0 = time.perf_counter()
        for lo in range(0, len(data), 4 << 20):
            hasher.update(data[lo : lo + (4 << 20)])
        rates[name] = len(data) / (time.perf_counter() - t0) / 1e9
    return rates


# --------------------------------------------------------------------------- raw TCP
def _sink(port_queue: mp.Queue, size: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port_queue.put(server.getsockname()[1])
        conn, _ = server.accept()
        cpu0 = _cpu()
        with conn:
            buffer = bytearray(4 << 20)
            view = memoryview(buffer)
            got = 0
            while got < size:
                n = conn.recv_into(view)
                if not n:
                    break
                got += n
            port_queue.put(_cpu() - cpu0)
            conn.sendall(b"k")


def _cpu() -> float:
    """CPU seconds (user + system) of this process so far."""
    times = os.times()
    return times.user + times.system


def raw_tcp(size: int) -> tuple[float, float]:
    """Bytes/s of a plain loopback TCP stream between two processes, and its CPU seconds."""
    queue: mp.Queue = mp.Queue()
    sink = mp.get_context("fork").Process(target=_sink, args=(queue, size))
    sink.start()
    port = queue.get(timeout=30)
    data = memoryview(os.urandom(4 << 20))
    with socket.create_connection(("127.0.0.1", port)) as conn:
        cpu0 = _cpu()
        t0 = time.perf_counter()
        left = size
        while left > 0:
            piece = data[: min(len(data), left)]
            conn.sendall(piece)
            left -= len(piece)
        conn.recv(1)
        seconds = time.perf_counter() - t0
        cpu = _cpu() - cpu0
    cpu += queue.get(timeout=30)
    sink.join(timeout=30)
    return size / seconds, cpu


# --------------------------------------------------------------------------- processes
def start_coordinator(
    state_dir: Path, port: int, tls: tuple[Path, Path] | None = None
) -> subprocess.Popen:
    """``crossfed coordinator serve`` on ``port`` (HTTPS with ``tls``: certificate, key)."""
    cmd = [sys.executable, "-m", "crossfed", "coordinator", "serve", "--state-dir"]
    cmd += [str(state_dir), "--secrets", str(state_dir / "secrets.yaml"), "--port", str(port)]
    if tls is not None:
        cmd += ["--ssl-certfile", str(tls[0]), "--ssl-keyfile", str(tls[1])]
    with open(state_dir / "coordinator.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    verify = True if tls is None else ssl.create_default_context(cafile=str(tls[0]))
    scheme = "http" if tls is None else "https"
    wait_until_serving(proc, state_dir, "localhost", port, 300.0, scheme, verify)
    return proc


def rss_bytes(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def reset_peak(pid: int) -> bool:
    """Reset a process's VmHWM to its current RSS (Linux clear_refs); False if not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) of another process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client(args: dict, out: mp.Queue) -> None:
    """One operation in a fresh client process: its seconds, CPU seconds and peak RSS growth."""
    keep_stream_buffers_in_heap()  # as a site job does (crossfed site run)
    client = CoordinatorClient(
        args["url"], args["token"], part_bytes=args["part_bytes"], retry_budget_s=120
    )
    path, key = Path(args["path"]), args["key"]
    client.health()
    rss0 = rss_bytes(os.getpid())[0]
    exact = reset_peak(os.getpid())
    cpu0 = _cpu()
    t0 = time.perf_counter()
    if args["op"] == "upload":
        client.upload_blob(path, key)
    elif args["op"] == "download":
        client.download_blob(key, Path(args["dest"]))
    else:  # inline: the whole file in one request, as the inline route receives it
        response = client.http.put(
            f"/v1/blobs/{key}",
            content=iter_chunks(path),
            headers={"Content-Length": str(path.stat().st_size)},
        )
        response.raise_for_status()
    seconds = time.perf_counter() - t0
    cpu = _cpu() - cpu0
    peak = (
        rss_bytes(os.getpid())[1]
        if exact
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    out.put({"seconds": seconds, "cpu": cpu, "rss_growth": max(0, peak - rss0)})


def run_op(op: str, server: subprocess.Popen, **args) -> dict:
    """``op`` in a client process; adds the server's CPU seconds and peak RSS growth."""
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_client, args=({"op": op, **args}, queue))
    proc.start()
    rss0 = rss_bytes(server.pid)[0]
    exact = reset_peak(server.pid)
    cpu0 = proc_cpu(server.pid)
    result = queue.get(timeout=3600)
    result["server_cpu"] = proc_cpu(server.pid) - cpu0
    peak = rss_bytes(server.pid)[1]
    result["server_rss_growth"] = max(0, peak - rss0) if exact else None
    proc.join(timeout=60)
    return result


# --------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=None, help="default: the full 596M")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--part-mb", type=int, default=64)
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: tmp)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="crossfed-bench-", dir=args.dir))
    proc = None
    try:
        model = work / "model.safetensors"
        t0 = time.perf_counter()
        key, size, n_tensors = write_model(model, args.params)
        write_s = time.perf_counter() - t0
        rates = hash_rates(model)

        state = work / "coordinator"
        state.mkdir()
        secrets = ensure_secrets(state / "secrets.yaml", ["bench"])
        port = free_port("127.0.0.1")
        proc = start_coordinator(state, port)
        common = {
            "url": f"http://127.0.0.1:{port}",
            "token": secrets["sites"]["bench"],
            "path": str(model),
            "key": key,
            "part_bytes": args.part_mb << 20,
            "dest": str(work / "download.safetensors"),
        }
        blob_dir = state / "blobs" / "blake3" / key.split(":")[1][:2]
        raws, ups, downs, inlines = [], [], [], []
        for _ in range(args.repeat):  # alternating, so a busy moment hits all alike
            raws.append(raw_tcp(size))
            ups.append(run_op("upload", proc, **common))
            downs.append(run_op("download", proc, **common))
            Path(common["dest"]).unlink()
            shutil.rmtree(blob_dir)
            inlines.append(run_op("inline", proc, **common))
            shutil.rmtree(blob_dir)

        def med(runs: list[dict], field: str) -> float:
            return statistics.median(r[field] for r in runs)

        raw = statistics.median(r[0] for r in raws)
        up, down = med(ups, "seconds"), med(downs, "seconds")
        ours = 2 * size / (up + down)
        raw_cpu = statistics.median(r[1] for r in raws)
        ours_cpu = (
            med(ups, "cpu") + med(ups, "server_cpu") + med(downs, "cpu") + med(downs, "server_cpu")
        ) / 2
        client_growth = max(r["rss_growth"] for r in ups + downs + inlines)
        server_growths = [r["server_rss_growth"] for r in ups + downs + inlines]
        server_growth = max((g for g in server_growths if g is not None), default=0)
        result = {
            "bench": "transport",
            "bytes": size,
            "tensors": n_tensors,
            "digest": key.split(":")[0],
            "part_bytes": args.part_mb << 20,
            "scratch": str(work.parent),
            "repeat": args.repeat,
            "raw_tcp_gbps": raw / 1e9,
            "upload_gbps": size / up / 1e9,
            "download_gbps": size / down / 1e9,
            "throughput_ratio": ours / raw,
            "cpu_s_per_gb_raw_tcp": raw_cpu / size * 1e9,
            "cpu_s_per_gb_ours": ours_cpu / size * 1e9,
            "cpu_efficiency_ratio": raw_cpu / ours_cpu,
            "blob_upload_s": up,
            "blob_download_s": down,
            "inline_upload_s": med(inlines, "seconds"),
            "write_file_s": write_s,
            "hash_gbps": rates,
            "client_rss_growth_bytes": client_growth,
            "server_rss_growth_bytes": server_growth,
            "peak_rss_ratio": (client_growth + server_growth) / size,
            "peak_rss_exact": all(g is not None for g in server_growths),
            "raw_tcp_runs_gbps": [r[0] / 1e9 for r in raws],
            "upload_runs_s": [r["seconds"] for r in ups],
            "download_runs_s": [r["seconds"] for r in downs],
            "inline_runs_s": [r["seconds"] for r in inlines],
        }
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
