"""Benchmark: held-out perplexity of centralised training vs 3-site DiLoCo vs FedAvg vs 1-site
DiLoCo, at matched tokens, matched optimiser steps and matched combined per-step batch.

All runs train crossfed's tiny Qwen3 on the embedded corpus, in this process, with the inner
phase the sites run (``crossfed.train.inner``) and the coordinator's outer step
(``crossfed.outer.outer_step``), no coordinator in between. Every round the data come from a
DARL block permutation: site i's step h of round r trains the same windows in every variant,
and the centralised step trains the three sites' step-h windows together, so every variant
sees the same windows in the same number of sequential optimiser steps (the paper's control:
Photon's federated advantage came from ~8x more steps). The learning-rate schedule is indexed
by the global step in all of them.

* centralised: one model, batch 3*B, R*H AdamW steps;
* DiLoCo 3 sites: three sites of batch B, H inner steps per round, outer Nesterov
  (eta=0.7, beta=0.9), inner AdamW state kept per site across rounds;
* FedAvg: the same with beta=0, eta=1 (the token-weighted mean of the site models);
* DiLoCo 1 site: one site of batch 3*B with the same outer step (a lone contributor takes
  the full step, eta=1, as crossfed's elastic rule does).

Prints a table and, as its last line, one JSON object (perplexities and the DiLoCo /
centralised ratio; the paper's is 34.7 / 28.2 = 1.23).

    .venv/bin/python bench/quality.py                    # a few minutes on 2 CPU cores
    .venv/bin/python bench/quality.py --rounds 12 --inner-steps 25
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from crossfed.darl.blockspace import BlockSpace
from crossfed.outer import OuterConfig, outer_step
from crossfed.train.inner import (
    InnerConfig,
    LeaseWindows,
    Trainer,
    evaluate,
    make_optimizer,
    run_inner_phase,
)
from crossfed.train.model import build_model, load_parameters, parameters_of
from crossfed.train.prepare import prepare
from crossfed.train.schedule import LRSchedule
from crossfed.train.windows import WindowStore
from crossfed.transport import delta_of

PAPER_RATIO = 34.7 / 28.2


def site_windows(
    space: BlockSpace, sites: int, batch: int, steps: int, rounds: int
) -> list[list[list[int]]]:
    """Dataset windows per round and site: ``out[r][i]`` is site i's lease, in step order."""
    order = [w for b in space.permutation(0) for w in space.block_windows(int(b))]
    per_site = batch * steps
    out, cursor = [], 0
    for _ in range(rounds):
        leases = []
        for _ in range(sites):
            leases.append(order[cursor : cursor + per_site])
            cursor += per_site
        out.append(leases)
    if cursor > len(order):
        raise SystemExit(f"the data has {len(order)} windows, the benchmark needs {cursor}")
    return out


def as_ranges(windows: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of window indices as [start, stop) ranges, in order."""
    ranges: list[tuple[int, int]] = []
    for w in windows:
        if ranges and ranges[-1][1] == w:
            ranges[-1] = (ranges[-1][0], w + 1)
        else:
            ranges.append((w, w + 1))
    return ranges


def interleave(leases: list[list[int]], batch: int) -> list[int]:
    """The centralised order: step h takes every site's step-h windows together."""
    steps = len(leases[0]) // batch
    return [w for h in range(steps) for lease in leases for w in lease[h * batch : (h + 1) * batch]]


class Run:
    """One variant: a global model, per-site inner optimisers, the outer state."""

    def __init__(self, name, store, vocab, seed, schedule, outer, sites, inner) -> None:
        self.name, self.store, self.schedule, self.outer = name, store, schedule, outer
        self.model = build_model("tiny", vocab_size=vocab, seed=seed)
        self.master = {k: v.detach().clone().float() for k, v in parameters_of(self.model).items()}
        self.momentum: dict[str, torch.Tensor] = {}
        self.inner = inner
        self.optimizers = [make_optimizer(self.model, inner, lr=0.0) for _ in range(sites)]
        self.global_step = 0
        self.train_s = 0.0

    def round(self, leases: list[list[int]], steps: int) -> None:
        """Every site trains its lease from the global model; the outer step merges."""
        t0 = time.perf_counter()
        deltas, tokens = [], []
        for i, lease in enumerate(leases):
            load_parameters(self.model, self.master)
            optimizer = self.optimizers[i]
            trainer = Trainer(self.model, optimizer, self.inner)
            state = run_inner_phase(
                trainer,
                self.store.windows,
                LeaseWindows.of(as_ranges(lease)),
                schedule=self.schedule,
                global_step=self.global_step,
            )
            deltas.append(delta_of(parameters_of(self.model), self.master))
            tokens.append(state.tokens)
        if self.outer is None:  # centralised: the model simply continues
            self.master = {k: v.detach().clone() for k, v in parameters_of(self.model).items()}
        else:
            outer_step(self.master, self.momentum, deltas, tokens, self.outer)
        self.global_step += steps
        self.train_s += time.perf_counter() - t0

    def perplexity(self, val: WindowStore, max_windows: int) -> float:
        load_parameters(self.model, self.master)
        _, ppl = evaluate(self.model, val.windows, val.n_windows, max_windows=max_windows)
        return ppl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="a prepared data directory (default: build one)")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="B per site per step")
    parser.add_argument("--inner-steps", type=int, default=10, help="H")
    parser.add_argument("--rounds", type=int, default=8, help="R")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    data = Path(args.data) if args.data else Path(tmp.name) / "data"
    if not args.data:
        prepare(data, vocab_size=args.vocab_size, seq_len=args.seq_len, val_fraction=0.05,
                shards=2, log=lambda *_: None)  # fmt: skip
    store, val = WindowStore.open(data, "train"), WindowStore.open(data, "val")
    space = BlockSpace(store.n_windows, 16, seed=1234)
    S, B, H, R = args.sites, args.batch, args.inner_steps, args.rounds
    plan = site_windows(space, S, B, H, R)
    schedule = LRSchedule(peak_lr=args.lr, warmup_steps=H, total_steps=R * H)
    site_cfg = InnerConfig(micro_batch=B)
    wide_cfg = InnerConfig(micro_batch=B, accumulation=S)  # the combined per-step batch
    diloco, fedavg = OuterConfig(eta=0.7, beta=0.9), OuterConfig(eta=1.0, beta=0.0)
    vocab = store.vocab_size
    runs = {
        "centralised": Run("centralised", store, vocab, 0, schedule, None, 1, wide_cfg),
        f"DiLoCo {S} sites": Run("diloco", store, vocab, 0, schedule, diloco, S, site_cfg),
        "FedAvg (beta=0, eta=1)": Run("fedavg", store, vocab, 0, schedule, fedavg, S, site_cfg),
        "DiLoCo 1 site": Run("diloco1", store, vocab, 0, schedule, diloco, 1, wide_cfg),
    }
    initial = runs["centralised"].perplexity(val, args.eval_windows)
    curves: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(R):
        leases = plan[r]
        together = [interleave(leases, B)]
        for name, run in runs.items():
            run.round(together if len(run.optimizers) == 1 else leases, H)
            curves[name].append(run.perplexity(val, args.eval_windows))
        print(
            f"round {r + 1}/{R}: " + ", ".join(f"{n} {c[-1]:.1f}" for n, c in curves.items()),
            flush=True,
        )
    tokens = R * S * B * H * store.seq_len
    final = {name: c[-1] for name, c in curves.items()}
    central = final["centralised"]
    print()
    print("| run | held-out perplexity | vs centralised | tokens | optimiser steps |")
    print("|---|---|---|---|---|")
    for name, ppl in final.items():
        print(f"| {name} | {ppl:.2f} | {ppl / central:.3f} | {tokens} | {R * H} |")
    result = {
        "benchmark": "quality",
        "model": "tiny",
        "sites": S,
        "batch_per_site": B,
        "inner_steps": H,
        "rounds": R,
        "tokens": tokens,
        "optimiser_steps": R * H,
        "initial_perplexity": round(initial, 2),
        "perplexity": {name: round(p, 3) for name, p in final.items()},
        "curves": {name: [round(p, 2) for p in c] for name, c in curves.items()},
        "train_s": {name: round(run.train_s, 1) for name, run in runs.items()},
        "diloco_over_centralised": round(final[f"DiLoCo {S} sites"] / central, 4),
        "paper_diloco_over_centralised": round(PAPER_RATIO, 4),
        "ratio": round(final[f"DiLoCo {S} sites"] / central, 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
