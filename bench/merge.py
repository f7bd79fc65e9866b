"""Benchmark: merge bf16 deltas into an fp32 master + momentum at Qwen3-0.6B scale.

Times ``crossfed.outer.outer_step`` against a memory-bandwidth floor measured in the same run:
plain torch streaming ops over the bytes any merge must touch (read every delta once, read
and write master and momentum once). Prints one JSON object as its last line; ``ratio`` is
merge_s / floor_s, both summed over the same model slices timed alternately (this machine is
shared, so floor and merge are paired slice by slice and the quietest repeat is reported).

    .venv/bin/python bench/merge.py                      # 596M parameters, about 9 GB of RAM
    .venv/bin/python bench/merge.py --params 50000000    # quick run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from collections.abc import Callable

import torch

from crossfed.outer import OuterConfig, outer_step

# Qwen3-0.6B: tied embeddings, 28 layers, 16 query / 8 key-value heads of 128, SwiGLU 3072.
VOCAB, HIDDEN, LAYERS, HEAD_DIM, Q_HEADS, KV_HEADS, FFN = 151936, 1024, 28, 128, 16, 8, 3072


def qwen3_layout(vocab: int = VOCAB, layers: int = LAYERS) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Qwen3-0.6B-like model (596M parameters, 310 tensors)."""
    q, kv = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (vocab, HIDDEN)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attention_norm.weight": (HIDDEN,),
            p + "attention.wq.weight": (q, HIDDEN),
            p + "attention.wk.weight": (kv, HIDDEN),
            p + "attention.wv.weight": (kv, HIDDEN),
            p + "attention.q_norm.weight": (HEAD_DIM,),
            p + "attention.k_norm.weight": (HEAD_DIM,),
            p + "attention.wo.weight": (HIDDEN, q),
            p + "ffn_norm.weight": (HIDDEN,),
            p + "feed_forward.w1.weight": (FFN, HIDDEN),
            p + "feed_forward.w3.weight": (FFN, HIDDEN),
            p + "feed_forward.w2.weight": (HIDDEN, FFN),
        }
    shapes["norm.weight"] = (HIDDEN,)
    return shapes


def scaled_layout(params: int | None) -> dict[str, tuple[int, ...]]:
    """The full layout, or one with vocabulary and depth scaled down to about ``params``."""
    full = sum(_numel(s) for s in qwen3_layout().values())
    if params is None or params >= full:
        return qwen3_layout()
    f = params / full
    return qwen3_layout(vocab=max(1, round(VOCAB * f)), layers=max(1, round(LAYERS * f)))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def flat_views(layout: dict[str, tuple[int, ...]], flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each tensor of ``layout`` as a contiguous view of one flat buffer, in order."""
    views, offset = {}, 0
    for name, shape in layout.items():
        n = _numel(shape)
        views[name] = flat[offset : offset + n].view(shape)
        offset += n
    return views


def floor_pass(master: torch.Tensor, momentum: torch.Tensor, deltas: list[torch.Tensor]) -> None:
    """Touch exactly the merge's bytes with plain streaming ops over flat buffers."""
    for d in deltas:
        d.view(torch.int16).max()  # read each bf16 delta once
    master.mul_(1.0)  # read + write master
    momentum.mul_(1.0)  # read + write momentum


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def param_groups(layout: dict[str, tuple[int, ...]], target: int) -> list[list[str]]:
    """Consecutive tensors in groups of about ``target`` parameters (a big tensor stands alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in layout.items():
        if size >= target:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += _numel(shape)
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=None, help="scale the model down to ~N params")
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions")
    ap.add_argument("--contributors", type=int, default=3)
    ap.add_argument("--kernel", choices=["auto", "eager", "fused"], default="auto")
    ap.add_argument("--eager", action="store_true", help="also time the eager (fallback) kernel")
    ap.add_argument("--group", type=int, default=80_000_000, help="params per paired slice")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    layout = scaled_layout(args.params)
    params = sum(_numel(s) for s in layout.values())
    groups = param_groups(layout, args.group)
    print(f"layout: {len(layout)} tensors, {params:,} parameters, {len(groups)} slices", flush=True)
    # Tensors are views of one flat buffer per role, so the floor can stream each role in one op.
    flat_master = torch.empty(params).uniform_(-0.05, 0.05)
    flat_momentum = torch.empty(params).uniform_(-1e-3, 1e-3)
    flat_deltas = [
        torch.empty(params, dtype=torch.bfloat16).uniform_(-1e-3, 1e-3)
        for _ in range(args.contributors)
    ]
    master = flat_views(layout, flat_master)
    momentum = flat_views(layout, flat_momentum)
    deltas = [flat_views(layout, d) for d in flat_deltas]
    tokens = [1_000_000 + 250_000 * i for i in range(args.contributors)]
    config = OuterConfig()
    bytes_touched = params * (2 * args.contributors + 8 + 8)

    def merge(kernel: str, names: list[str] | None = None) -> Callable[[], object]:
        if names is None:
            m, b, ds = master, momentum, deltas
        else:
            m = {k: master[k] for k in names}
            b = {k: momentum[k] for k in names}
            ds = [{k: d[k] for k in names} for d in deltas]
        return lambda: outer_step(m, b, ds, tokens, config, kernel=kernel)

    def floor(names: list[str]) -> Callable[[], object]:
        lo = master[names[0]].data_ptr() // 4 - flat_master.data_ptr() // 4
        hi = lo + sum(master[k].numel() for k in names)
        return lambda: floor_pass(
            flat_master[lo:hi], flat_momentum[lo:hi], [d[lo:hi] for d in flat_deltas]
        )

    def paired(kernel: str) -> tuple[float, float]:
        """Floor and merge slice by slice, alternating which goes first: same load for both."""
        f = m = 0.0
        for i, names in enumerate(groups):
            if i % 2:
                m += timed(merge(kernel, names))
            f += timed(floor(names))
            if not i % 2:
                m += timed(merge(kernel, names))
        return f, m

    first_s = timed(merge(args.kernel))  # includes compiling the fused kernel, if used
    runs, eager_runs, whole = [], [], []
    for r in range(args.repeat):
        runs.append(paired(args.kernel))
        whole.append(timed(merge(args.kernel)))
        line = f"repeat {r}: floor {runs[-1][0]:.3f} s, merge[{args.kernel}] {runs[-1][1]:.3f} s"
        line += f" (ratio {runs[-1][1] / runs[-1][0]:.2f}), one call {whole[-1]:.3f} s"
        if args.eager and args.kernel != "eager":
            eager_runs.append(paired("eager"))
            e_floor, e_merge = eager_runs[-1]
            line += f"; floor {e_floor:.3f} s, merge[eager] {e_merge:.3f} s"
        print(line, flush=True)

    floor_s, merge_s = min(runs, key=sum)  # the quietest repeat: both halves ran under it
    ratios = [m / f for f, m in runs]
    result = {
        "merge_s": round(merge_s, 4),
        "floor_s": round(floor_s, 4),
        "ratio": round(merge_s / floor_s, 3),
        "params": params,
        "threads": torch.get_num_threads(),
        "kernel": args.kernel,
        "tensors": len(layout),
        "contributors": args.contributors,
        "repeat": args.repeat,
        "ratio_median": round(statistics.median(ratios), 3),
        "merge_one_call_best_s": round(min(whole), 4),
        "floor_gb_per_s": round(bytes_touched / floor_s / 1e9, 2),
        "first_call_s": round(first_s, 3),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    if eager_runs:
        e_floor, e_merge = min(eager_runs, key=sum)
        result |= {
            "eager_s": round(e_merge, 4),
            "eager_ratio": round(e_merge / e_floor, 3),
            "eager_ratio_median": round(statistics.median(m / f for f, m in eager_runs), 3),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
