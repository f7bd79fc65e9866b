"""Benchmark: the coordinator's merge as it runs, files in and files out, at Qwen3 sizes.

Writes generation g's fp32 state file (master + momentum) and ``--contributors`` bf16 delta
files of random weights shaped like Qwen3 ``--flavour``, then runs exactly what the
coordinator runs to close a round (``crossfed.coordinator.generations.write_generation``
around ``merge_step``: read the state and each delta tensor by tensor, Eq. 1, write g+1's fp32
state and bf16 global model with fsync and rename). Its I/O floor is measured in the same run:
plain reads of the same input files and plain writes (fsync'ed) of as many bytes as the merge
writes, alternating with the merge. Prints one JSON object as its last line: ``merge_s``,
``floor_s``, ``ratio`` (merge_s / floor_s of the quietest repeat) and ``peak_rss_gib`` (the
process's peak resident memory during the merge; no file is memory-mapped, so this is the
merge's private memory plus the interpreter's). The merge's writer thread overlaps its reads
and arithmetic: "writer busy" is the seconds it spent writing, and ``compute_s_best`` the
best repeat's merge seconds outside them (the pipeline's fill and what the writer waited for).

    .venv/bin/python bench/merge.py                      # Qwen3-0.6B: about 14 GB of disk
    .venv/bin/python bench/merge.py --flavour 1.7B       # about 42 GB of disk
    .venv/bin/python bench/merge.py --params 50000000    # quick run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from crossfed.coordinator.generations import MOMENTUM, merge_step, write_generation
from crossfed.fileio import fsync_dir
from crossfed.outer import warm_up
from crossfed.outer_presets import OuterConfig
from crossfed.wire.tensors import TensorSpec, save_stream

VOCAB, HEAD_DIM = 151936, 128
# Qwen3 dense flavours: hidden, layers, query heads, key-value heads, SwiGLU width, tied
FLAVOURS = {
    "0.6B": (1024, 28, 16, 8, 3072, True),
    "1.7B": (2048, 28, 16, 8, 6144, True),
    "4B": (2560, 36, 32, 8, 9728, True),
    "8B": (4096, 36, 32, 8, 12288, False),
}


def qwen3_layout(
    flavour: str = "0.6B", vocab: int = VOCAB, layers: int | None = None
) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Qwen3 flavour (torchtitan's names; tied embeddings once)."""
    hidden, depth, q_heads, kv_heads, ffn, tied = FLAVOURS[flavour]
    q, kv = q_heads * HEAD_DIM, kv_heads * HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (vocab, hidden)}
    for i in range(depth if layers is None else layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attention_norm.weight": (hidden,),
            p + "attention.wq.weight": (q, hidden),
            p + "attention.wk.weight": (kv, hidden),
            p + "attention.wv.weight": (kv, hidden),
            p + "attention.q_norm.weight": (HEAD_DIM,),
            p + "attention.k_norm.weight": (HEAD_DIM,),
            p + "attention.wo.weight": (hidden, q),
            p + "ffn_norm.weight": (hidden,),
            p + "feed_forward.w1.weight": (ffn, hidden),
            p + "feed_forward.w3.weight": (ffn, hidden),
            p + "feed_forward.w2.weight": (hidden, ffn),
        }
    shapes["norm.weight"] = (hidden,)
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    return shapes


def scaled_layout(flavour: str, params: int | None) -> dict[str, tuple[int, ...]]:
    """The flavour's layout, or one with vocabulary and depth scaled down to about ``params``."""
    full = qwen3_layout(flavour)
    total = sum(math.prod(s) for s in full.values())
    if params is None or params >= total:
        return full
    f = params / total
    depth = FLAVOURS[flavour][1]
    return qwen3_layout(flavour, vocab=max(1, round(VOCAB * f)), layers=max(1, round(depth * f)))


def write_inputs(
    folder: Path, layout: dict[str, tuple[int, ...]], contributors: int, seed: int
) -> tuple[Path, list[Path]]:
    """Generation 1's state file and the delta files, each written one tensor at a time."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(shape: tuple[int, ...], scale: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape).uniform_(-scale, scale, generator=gen).to(dtype)

    specs = []
    for name, shape in layout.items():
        specs += [TensorSpec(name, torch.float32, shape)]
        specs += [TensorSpec(MOMENTUM + name, torch.float32, shape)]
    state = folder / "master-000001.safetensors"

    def state_tensor(spec: TensorSpec) -> torch.Tensor:
        scale = 1e-3 if spec.name.startswith(MOMENTUM) else 0.05
        return uniform(spec.shape, scale, torch.float32)

    save_stream(state, specs, state_tensor, algo=None)
    deltas = []
    for i in range(contributors):
        deltas.append(folder / f"delta-{i}.safetensors")
        delta_specs = [TensorSpec(n, torch.bfloat16, s) for n, s in layout.items()]
        save_stream(deltas[-1], delta_specs, lambda s: uniform(s.shape, 1e-3, torch.bfloat16))
    return state, deltas


def floor_pass(inputs: list[Path], outputs: list[tuple[Path, int]], chunk: int = 64 << 20) -> None:
    """The merge's I/O and nothing else: read every input file once, write (and fsync) as
    many bytes as the merge writes."""
    buffer = bytearray(chunk)
    for path in inputs:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass
    view = memoryview(buffer)
    for path, size in outputs:
        with open(path, "wb", buffering=0) as handle:
            left = size
            while left > 0:
                left -= handle.write(view[: min(left, chunk)])
            os.fsync(handle.fileno())
        fsync_dir(path.parent)
        path.unlink()


def status_kib(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else 0


def reset_peak_rss() -> bool:
    """Linux: make the peak RSS (VmHWM) start again from the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavour", choices=sorted(FLAVOURS), default="0.6B")
    ap.add_argument("--params", type=int, default=None, help="scale the model down to ~N params")
    ap.add_argument("--repeat", type=int, default=2, help="timed merge + floor pairs")
    ap.add_argument("--contributors", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="working folder (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    layout = scaled_layout(args.flavour, args.params)
    params = sum(math.prod(s) for s in layout.values())
    top = max(math.prod(s) for s in layout.values())
    folder = Path(tempfile.mkdtemp(prefix="crossfed-merge-", dir=args.dir))
    try:
        print(f"layout: {len(layout)} tensors, {params:,} parameters, in {folder}", flush=True)
        started = time.perf_counter()
        state, deltas = write_inputs(folder, layout, args.contributors, args.seed)
        print(f"inputs written in {time.perf_counter() - started:.1f} s", flush=True)
        warm_up(params)  # the coordinator compiles its kernel when it loads a run
        tokens = [1_000_000 + 250_000 * i for i in range(args.contributors)]
        out_state = folder / "master-000002.safetensors"
        out_model = folder / "global-000002.safetensors"
        read_bytes = sum(p.stat().st_size for p in [state, *deltas])
        runs, peaks, merge_only = [], [], []

        def merge() -> tuple[float, float]:
            def step(emit):  # noqa: ANN001, ANN202
                return merge_step(state, layout, deltas, tokens, emit, OuterConfig())

            t0 = time.perf_counter()
            _, _, write_s = write_generation(out_state, out_model, layout, 2, step, momentum=True)
            return time.perf_counter() - t0, write_s

        def measured_merge() -> tuple[float, float, tuple[int, int]]:
            for p in (out_state, out_model):
                p.unlink(missing_ok=True)
            reset_peak_rss()
            base = status_kib("VmRSS")
            merge_s, write_s = merge()
            return merge_s, write_s, (status_kib("VmHWM"), base)

        sizes: list[tuple[Path, int]] = []

        def measured_floor() -> float:
            for p in (out_state, out_model):
                p.unlink(missing_ok=True)
            t0 = time.perf_counter()
            floor_pass([state, *deltas], sizes)
            return time.perf_counter() - t0

        for r in range(args.repeat):  # alternate which goes first: the same load for both
            if r % 2 == 0:
                merge_s, write_s, peak = measured_merge()
                outs = (out_state, out_model)
                sizes = [(folder / f"floor-{p.name}", p.stat().st_size) for p in outs]
                floor_s = measured_floor()
            else:
                floor_s = measured_floor()
                merge_s, write_s, peak = measured_merge()
            peaks.append(peak)
            runs.append((floor_s, merge_s))
            merge_only.append(merge_s - write_s)
            print(
                f"repeat {r}: floor {floor_s:.2f} s, merge {merge_s:.2f} s "
                f"(ratio {merge_s / floor_s:.2f}; writer busy {write_s:.2f} s), "
                f"peak RSS {peak[0] / 2**20:.2f} GiB",
                flush=True,
            )
        written = sum(size for _, size in sizes)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    floor_s, merge_s = min(runs, key=sum)  # the quietest repeat: both halves ran under it
    peak, base = max(peaks)
    result = {
        "flavour": args.flavour,
        "params": params,
        "peak_rss_gib": round(peak / 2**20, 2),
        "merge_s": round(merge_s, 2),
        "floor_s": round(floor_s, 2),
        "ratio": round(merge_s / floor_s, 3),
        "ratio_median": round(statistics.median(m / f for f, m in runs), 3),
        "rss_growth_gib": round((peak - base) / 2**20, 2),
        "largest_tensor_gib": round(top * 4 / 2**30, 3),
        "state_gib": round(params * 8 / 2**30, 2),
        "bytes_read_gb": round(read_bytes / 1e9, 2),
        "bytes_written_gb": round(written / 1e9, 2),
        "floor_gb_per_s": round((read_bytes + written) / floor_s / 1e9, 2),
        "compute_s_best": round(min(merge_only), 2),
        "tensors": len(layout),
        "contributors": args.contributors,
        "threads": torch.get_num_threads(),
        "repeat": args.repeat,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
