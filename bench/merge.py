"""Benchmark: merge bf16 deltas into an fp32 master + momentum at Qwen3-0.6B scale.

Times ``crossfed.outer.outer_step`` against a memory-bandwidth floor measured in the same run:
plain torch streaming ops over the bytes any merge must touch (read every delta once, read
and write master and momentum once). Prints one JSON object as its last line; ``ratio`` is
merge_s / floor_s (best of ``--repeat``, taken side by side).

    .venv/bin/python bench/merge.py                      # 596M parameters, about 9 GB of RAM
    .venv/bin/python bench/merge.py --params 50000000    # quick run
"""

from __future__ import annotations

import argparse
import json
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


def floor_pass(
    master: dict[str, torch.Tensor],
    momentum: dict[str, torch.Tensor],
    deltas: list[dict[str, torch.Tensor]],
) -> None:
    """Touch exactly the merge's bytes with plain streaming ops: no arithmetic worth the name."""
    for name, w in master.items():
        for d in deltas:
            d[name].view(torch.int16).max()  # read the bf16 delta once
        w.mul_(1.0)  # read + write master
        momentum[name].mul_(1.0)  # read + write momentum


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=None, help="scale the model down to ~N params")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions (best is kept)")
    ap.add_argument("--contributors", type=int, default=3)
    ap.add_argument("--kernel", choices=["auto", "eager", "fused"], default="auto")
    ap.add_argument("--eager", action="store_true", help="also time the eager (fallback) kernel")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    layout = scaled_layout(args.params)
    params = sum(_numel(s) for s in layout.values())
    print(f"layout: {len(layout)} tensors, {params:,} parameters", flush=True)
    master = {k: torch.empty(s).uniform_(-0.05, 0.05) for k, s in layout.items()}
    momentum = {k: torch.empty(s).uniform_(-1e-3, 1e-3) for k, s in layout.items()}
    deltas = [
        {k: torch.empty(s, dtype=torch.bfloat16).uniform_(-1e-3, 1e-3) for k, s in layout.items()}
        for _ in range(args.contributors)
    ]
    tokens = [1_000_000 + 250_000 * i for i in range(args.contributors)]
    config = OuterConfig()
    bytes_touched = params * (2 * args.contributors + 8 + 8)

    def merge(kernel: str) -> Callable[[], object]:
        return lambda: outer_step(master, momentum, deltas, tokens, config, kernel=kernel)

    first_s = timed(merge(args.kernel))  # includes compiling the fused kernel, if used
    timed(lambda: floor_pass(master, momentum, deltas))
    floors, merges, eagers = [], [], []
    for r in range(args.repeat):
        floors.append(timed(lambda: floor_pass(master, momentum, deltas)))
        merges.append(timed(merge(args.kernel)))
        if args.eager and args.kernel != "eager":
            eagers.append(timed(merge("eager")))
        line = f"repeat {r}: floor {floors[-1]:.3f} s, merge[{args.kernel}] {merges[-1]:.3f} s"
        print(line + (f", merge[eager] {eagers[-1]:.3f} s" if eagers else ""), flush=True)

    floor_s, merge_s = min(floors), min(merges)
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
        "merge_median_s": round(statistics.median(merges), 4),
        "floor_median_s": round(statistics.median(floors), 4),
        "floor_gb_per_s": round(bytes_touched / floor_s / 1e9, 2),
        "first_call_s": round(first_s, 3),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    if eagers:
        result |= {"eager_s": round(min(eagers), 4), "eager_ratio": round(min(eagers) / floor_s, 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
