"""Benchmark: how long a checkpoint stops the step loop, written in the foreground against
in the background, side by side.

A site checkpoints its model, AdamW state and data cursor every ``inner.checkpoint_every``
steps. Written in the foreground (``crossfed.train.checkpoint.save``) the step loop waits
for every byte; written in the background (``save_in_background``, DCP's ``async_save``, what
a site does) it waits only for the state's copy, and the files are written while
the next steps train. Both write the same state of one torchtitan Qwen3 (AdamW state filled
by one step on random gradients) into one folder, alternating which goes first (this
machine is shared). The last line printed is one JSON object: per mode the median seconds
the caller is held (``stall_s_foreground``, ``stall_s_background``) and the background
write's seconds until it is published (``write_s_background``), the bytes of one checkpoint,
and ``stall_ratio`` (background over foreground; lower is better).

    .venv/bin/python bench/checkpoint.py                    # Qwen3-0.6B, 7.2 GB a checkpoint
    .venv/bin/python bench/checkpoint.py --flavour tiny --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from crossfed.train import checkpoint
from crossfed.train.distributed import Ranks
from crossfed.train.inner import InnerConfig, make_optimizer
from crossfed.train.model import build_model, parameters_of

#: Qwen3's tokenizer vocabulary: the embedding a real site checkpoints
QWEN3_VOCAB = 151_936


def filled_state(flavour: str, vocab_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and an AdamW whose state one step on random gradients has filled."""
    model = build_model(flavour, vocab_size=vocab_size)
    optimizer = make_optimizer(model, InnerConfig(), lr=1e-4)
    for p in parameters_of(model).values():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    for p in parameters_of(model).values():
        p.grad = None
    return model, optimizer


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = list(parameters_of(model).values())
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def one_save(
    mode: str, folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> tuple[float, float]:
    """Seconds the caller is held and seconds until the checkpoint is published."""
    cursor = {"round": 1, "status": "training", "steps": step, "windows": step}
    t0 = time.perf_counter()
    if mode == "foreground":
        checkpoint.save(folder, model, optimizer, cursor, Ranks())
        held = time.perf_counter() - t0
        return held, held
    pending = checkpoint.save_in_background(folder, model, optimizer, cursor, Ranks())
    held = time.perf_counter() - t0
    pending.wait()
    return held, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavour", default="0.6B", help="a torchtitan Qwen3 flavour or tiny")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: Qwen3's")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    args = parser.parse_args()
    vocab = args.vocab_size or (2048 if args.flavour == "tiny" else QWEN3_VOCAB)
    torch.manual_seed(0)
    model, optimizer = filled_state(args.flavour, vocab)
    size = state_bytes(model, optimizer)
    print(f"{args.flavour}: {size / 1e9:.2f} GB of weights and AdamW state a checkpoint")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="crossfed-ckpt-bench-") as tmp:
        folder = Path(tmp)
        times: dict[str, list[tuple[float, float]]] = {"foreground": [], "background": []}
        step = 0
        for repeat in range(args.repeats):
            order = ("foreground", "background")
            for mode in order if repeat % 2 == 0 else order[::-1]:
                step += 1
                held, total = one_save(mode, folder, model, optimizer, step)
                times[mode].append((held, total))
                print(f"repeat {repeat + 1} {mode}: held {held:.3f}s, published after {total:.3f}s")
    stall = {m: statistics.median(h for h, _ in v) for m, v in times.items()}
    result = {
        "bench": "checkpoint",
        "flavour": args.flavour,
        "vocab_size": vocab,
        "bytes_per_checkpoint": size,
        "repeats": args.repeats,
        "stall_s_foreground": round(stall["foreground"], 4),
        "stall_s_background": round(stall["background"], 4),
        "write_s_background": round(statistics.median(t for _, t in times["background"]), 4),
        "stall_ratio": round(stall["background"] / stall["foreground"], 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
