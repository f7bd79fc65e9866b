"""Benchmark: the memory a coordinator needs to create a run (draw generation 0).

Each way runs in a fresh process of its own, side by side in one run, and passes every fp32
parameter on as run creation does (``value.float().contiguous()``), dropping it after:

* ``stream``: ``crossfed.train.model.initial_parameters``, one init unit (the embedding or
  one layer) in memory at a time, what ``Coordinator.init_run`` uses;
* ``whole``: ``build_model`` then its parameters, the whole model in memory at once.

Both draw the same tensors (tests/unit/test_train_inner.py checks them bit for bit). Prints each
process's peak RSS (``ru_maxrss``), the model's fp32 size, and as its last line one JSON
object with ``peak_rss_gib_stream``, ``peak_rss_gib_whole`` and ``ratio`` (stream / whole).

    .venv/bin/python bench/init_memory.py                    # Qwen3-1.7B's shapes, ~3 min
    .venv/bin/python bench/init_memory.py --flavour 0.6B
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def child(flavour: str, way: str, vocab_size: int) -> None:
    import torch

    from crossfed.train.model import build_model, initial_parameters, parameters_of

    torch.set_num_threads(1)
    if way == "whole":
        drawn = parameters_of(build_model(flavour, vocab_size=vocab_size, seed=0)).items()
    else:
        drawn = initial_parameters(flavour, vocab_size=vocab_size, seed=0)
    elements = 0
    for _, value in drawn:
        elements += value.float().contiguous().numel()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(json.dumps({"way": way, "elements": elements, "peak_rss_gib": round(peak, 2)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flavour", default="1.7B")
    parser.add_argument("--vocab-size", type=int, default=151936, help="Qwen3's")
    parser.add_argument("--child", choices=["stream", "whole"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.flavour, args.child, args.vocab_size)
        return
    peaks, elements = {}, 0
    for way in ("stream", "whole"):
        out = subprocess.run(
            [sys.executable, __file__, "--flavour", args.flavour,
             "--vocab-size", str(args.vocab_size), "--child", way],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        row = json.loads(out.strip().splitlines()[-1])
        peaks[way], elements = row["peak_rss_gib"], row["elements"]
        print(f"{way:<7} peak RSS {row['peak_rss_gib']:.2f} GiB", flush=True)
    print(
        json.dumps(
            {
                "benchmark": "init_memory",
                "flavour": args.flavour,
                "params": elements,
                "fp32_gib": round(elements * 4 / 2**30, 2),
                "peak_rss_gib_stream": peaks["stream"],
                "peak_rss_gib_whole": peaks["whole"],
                "ratio": round(peaks["stream"] / peaks["whole"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
