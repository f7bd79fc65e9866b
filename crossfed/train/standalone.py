"""An inner phase without a coordinator: given window ranges, train them as a site would.

The same ``Trainer`` and ``run_inner_phase`` the site loop uses, on the same parallelised
model, with the data read recorded. Under torchrun it trains W real ranks (FSDP2); as one
process it simulates them. Used to check that the two agree and by the benchmarks::

    torchrun --nproc-per-node 2 -m crossfed.train.standalone --data DIR --ranges 0:64 \\
        --ranks 2 --accumulation 2 --micro-batch 2 --out result.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from crossfed.data.windows import WindowStore
from crossfed.train.distributed import (
    ParallelConfig,
    Ranks,
    close_ranks,
    full_parameters,
    init_ranks,
    parallelize,
    rank_device,
    sum_over_ranks,
    uses_autocast,
)
from crossfed.train.inner import (
    InnerConfig,
    LeaseWindows,
    PhaseState,
    Trainer,
    make_optimizer,
    run_inner_phase,
)
from crossfed.train.model import build_model
from crossfed.train.schedule import LRSchedule


@dataclass
class RecordingReader:
    """A window reader that remembers every dataset window it handed out."""

    read: Callable[[int, int], np.ndarray]
    seen: list[int] = field(default_factory=list)

    def __call__(self, start: int, stop: int) -> np.ndarray:
        self.seen.extend(range(start, stop))
        return self.read(start, stop)


def train_ranges(
    store: WindowStore,
    ranges: Sequence[tuple[int, int]],
    config: InnerConfig,
    *,
    ranks: Ranks,
    flavour: str = "tiny",
    seed: int = 0,
    device: str = "cpu",
    schedule: LRSchedule | None = None,
    global_step: int = 0,
    parallel: ParallelConfig | None = None,
) -> tuple[torch.nn.Module, PhaseState, RecordingReader]:
    """Train ``ranges`` from a fresh ``flavour`` model; returns the model, state and reads."""
    device = rank_device(device, ranks)
    model = build_model(flavour, vocab_size=store.vocab_size, seed=seed, device=device)
    model = parallelize(model, ranks, parallel or ParallelConfig(), device)
    optimizer = make_optimizer(model, config, lr=0.0)
    trainer = Trainer(
        model,
        optimizer,
        config,
        device=device,
        rank=ranks.rank,
        world=ranks.world,
        autocast=uses_autocast(device, ranks),
        reduce_loss=lambda loss: sum_over_ranks(loss, ranks),
    )
    reader = RecordingReader(store.windows)
    state = run_inner_phase(
        trainer,
        reader,
        LeaseWindows.of(ranges),
        schedule=schedule or LRSchedule(peak_lr=1e-3, warmup_steps=2, total_steps=100),
        global_step=global_step,
    )
    return model, state, reader


def _ranges(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        a, _, b = part.partition(":")
        out.append((int(a), int(b)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crossfed.train.standalone")
    parser.add_argument("--data", required=True, help="a prepared data directory")
    parser.add_argument("--ranges", required=True, help="window ranges a:b,c:d (lease order)")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--flavour", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--activation-checkpointing", default="none")
    parser.add_argument("--out", required=True, help="result JSON (rank 0)")
    parser.add_argument("--params-out", help="final parameters as safetensors (rank 0)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    ranks = init_ranks(args.device)
    store = WindowStore.open(Path(args.data), "train")
    config = InnerConfig(
        micro_batch=args.micro_batch, ranks=args.ranks, accumulation=args.accumulation
    )
    model, state, reader = train_ranges(
        store,
        _ranges(args.ranges),
        config,
        ranks=ranks,
        flavour=args.flavour,
        device=args.device,
        parallel=ParallelConfig(activation_checkpointing=args.activation_checkpointing),
    )
    mine = reader.seen
    every = [mine]
    if ranks.distributed:
        every = [None] * ranks.world
        dist.all_gather_object(every, mine)
    params = full_parameters(model)
    if ranks.main:
        result = {"world": ranks.world, **state.to_dict(), "windows_by_rank": every}
        Path(args.out).write_text(json.dumps(result))
        if args.params_out:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in params.items()}, args.params_out)
    close_ranks(ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
