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

* centralised: one model, batch 3*B, T AdamW steps;
* DiLoCo 3 sites: three sites of batch B, H inner steps per round (R = T / H rounds), the
  outer step of ``--outer`` (a preset of ``crossfed.outer.PRESETS``: ``tuned``, the
  workflow's default, or ``paper``, eta=0.7 and beta=0.9 with the solo full step; or
  ``eta=E,beta=B[,solo=0|1]``), inner AdamW state kept per site across rounds;
* FedAvg: the same with beta=0, eta=1 (the token-weighted mean of the site models);
* DiLoCo 1 site: one site of batch 3*B with the same outer step as the DiLoCo row.

Each H of ``--inner-steps`` and each seed of ``--seeds`` (model seed s, block order 1234 + s)
is one set of runs; the table gives mean and sample standard deviation over seeds. The last
line is one JSON object: per-H summaries, and ``ratio`` (DiLoCo 3 sites / centralised) and
``solo_over_centralised``, each the mean over seeds and H values (the paper's ratio is
34.7 / 28.2 = 1.23). Runs are deterministic: the same command prints the same figures.

    .venv/bin/python bench/quality.py --threads 1 --jobs 3    # tens of minutes on 2 cores
    .venv/bin/python bench/quality.py --outer paper tuned --variants centralised diloco
    .venv/bin/python bench/quality.py --outer paper --inner-steps 10 --steps 80 --batch 8 \
        --seeds 0                                              # the issue-18 figures
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from crossfed.darl.blockspace import BlockSpace
from crossfed.outer import PRESETS, OuterConfig, outer_step
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
from crossfed.wire.deltas import delta_of

PAPER_RATIO = 34.7 / 28.2
VARIANTS = ("centralised", "diloco", "fedavg", "solo")


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


def parse_outer(text: str) -> tuple[str, OuterConfig]:
    """An outer-step setting: a preset name, or ``eta=E,beta=B[,solo=0|1]``."""
    if text in PRESETS:
        return text, PRESETS[text]
    fields = {"solo": "solo_full_step"}
    try:
        kwargs: dict[str, float | bool] = {}
        for part in text.split(","):
            key, value = part.split("=")
            name = fields.get(key.strip(), key.strip())
            kwargs[name] = bool(int(value)) if name == "solo_full_step" else float(value)
        return text, OuterConfig(**kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(
            f"--outer {text!r}: expected one of {sorted(PRESETS)} or eta=E,beta=B[,solo=0|1] "
            f"({exc})"
        ) from None


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5


def train_one(args, store, val, seed: int, H: int, variants: list[str], outers) -> dict:
    """One data order and model seed at one H: every requested row, trained side by side."""
    S, B, T = args.sites, args.batch, args.steps
    R = T // H
    space = BlockSpace(store.n_windows, 16, seed=1234 + seed)
    plan = site_windows(space, S, B, H, R)
    schedule = LRSchedule(
        peak_lr=args.lr,
        warmup_steps=args.warmup_steps,
        total_steps=T,
        min_lr_factor=args.min_lr_factor,
    )
    site_cfg = InnerConfig(micro_batch=B)
    wide_cfg = InnerConfig(micro_batch=B, accumulation=S)  # the combined per-step batch
    fedavg = OuterConfig(eta=1.0, beta=0.0)
    vocab = store.vocab_size
    runs: dict[str, Run] = {}
    if "centralised" in variants:
        runs["centralised"] = Run("centralised", store, vocab, seed, schedule, None, 1, wide_cfg)
    for label, outer in outers:
        tag = "" if len(outers) == 1 else f" [{label}]"
        if "diloco" in variants:
            runs[f"DiLoCo {S} sites{tag}"] = Run("diloco", store, vocab, seed, schedule, outer,
                                                 S, site_cfg)  # fmt: skip
        if "solo" in variants:
            runs[f"DiLoCo 1 site{tag}"] = Run("solo", store, vocab, seed, schedule, outer, 1,
                                              wide_cfg)  # fmt: skip
    if "fedavg" in variants:
        runs["FedAvg (beta=0, eta=1)"] = Run("fedavg", store, vocab, seed, schedule, fedavg, S,
                                             site_cfg)  # fmt: skip
    curves: dict[str, list[float]] = {name: [] for name in runs}
    every = args.eval_every or T
    for r in range(R):
        leases = plan[r]
        together = [interleave(leases, B)]
        for run in runs.values():
            run.round(together if len(run.optimizers) == 1 else leases, H)
        step = (r + 1) * H
        if step % every == 0 or r == R - 1:
            for name, run in runs.items():
                curves[name].append(run.perplexity(val, args.eval_windows))
            print(
                f"seed {seed} H={H} round {r + 1}/{R} (step {step}): "
                + ", ".join(f"{n} {c[-1]:.1f}" for n, c in curves.items()),
                flush=True,
            )
    return {
        "final": {name: c[-1] for name, c in curves.items()},
        "curves": {name: [round(p, 2) for p in c] for name, c in curves.items()},
        "train_s": {name: round(run.train_s, 1) for name, run in runs.items()},
    }


def train_cell(args, data: Path, seed: int, H: int, outers) -> dict:
    """:func:`train_one` in a worker process (``--jobs``): its own data handles and threads."""
    torch.set_num_threads(args.threads)
    store, val = WindowStore.open(data, "train"), WindowStore.open(data, "val")
    return train_one(args, store, val, seed, H, args.variants, outers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="a prepared data directory (default: build one)")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="B per site per step")
    parser.add_argument("--inner-steps", type=int, nargs="+", default=[3, 5],
                        help="H values, each its own set of runs")  # fmt: skip
    parser.add_argument("--steps", type=int, default=150,
                        help="optimiser steps T of every run (R = T / H rounds)")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="model seed s and data order 1234 + s")  # fmt: skip
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--outer", nargs="+", type=parse_outer, default=[parse_outer("tuned")],
                        help=f"outer step(s) of the DiLoCo rows: {sorted(PRESETS)} or "
                        "eta=E,beta=B[,solo=0|1]; the first one is the JSON's")  # fmt: skip
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--min-lr-factor", type=float, default=0.1)
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluate every this many steps (0: at the end only)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--jobs", type=int, default=1,
                        help="train the (H, seed) cells in this many processes")  # fmt: skip
    args = parser.parse_args()
    for H in args.inner_steps:
        if H < 1 or args.steps % H:
            parser.error(f"--steps {args.steps} is not a whole number of rounds of H={H}")
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    data = Path(args.data) if args.data else Path(tmp.name) / "data"
    if not args.data:
        prepare(data, vocab_size=args.vocab_size, seq_len=args.seq_len, val_fraction=0.05,
                shards=2, log=lambda *_: None)  # fmt: skip
    store, val = WindowStore.open(data, "train"), WindowStore.open(data, "val")
    S, B, T = args.sites, args.batch, args.steps
    outers = args.outer
    cells = [(H, seed) for H in args.inner_steps for seed in args.seeds]
    if args.jobs > 1:  # each (H, seed) in its own process, one thread each
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = {
                cell: pool.submit(train_cell, args, data, cell[1], cell[0], outers)
                for cell in cells
            }
            results = {cell: future.result() for cell, future in futures.items()}
    else:
        results = {
            (H, seed): train_one(args, store, val, seed, H, args.variants, outers)
            for H, seed in cells
        }
    tokens = T * S * B * store.seq_len
    lead = "" if len(outers) == 1 else f" [{outers[0][0]}]"
    diloco, solo = f"DiLoCo {S} sites{lead}", f"DiLoCo 1 site{lead}"
    print()
    print(f"tokens {tokens} and {T} optimiser steps in every run; seeds {args.seeds}")
    print("| H | rounds | run | held-out perplexity (mean ± sd) | vs centralised (mean ± sd) |")
    print("|---|---|---|---|---|")
    by_h: dict[str, dict] = {}
    ratios: dict[str, list[float]] = {"ratio": [], "solo_over_centralised": []}
    for H in args.inner_steps:
        finals = [results[(H, s)]["final"] for s in args.seeds]
        summary: dict[str, dict] = {}
        for name in finals[0]:
            ppl = [f[name] for f in finals]
            rel = [f[name] / f["centralised"] for f in finals] if "centralised" in finals[0] else []
            m, sd = mean_std(ppl)
            cell = f"{mean_std(rel)[0]:.3f} ± {mean_std(rel)[1]:.3f}" if rel else "-"
            print(f"| {H} | {T // H} | {name} | {m:.1f} ± {sd:.1f} | {cell} |")
            summary[name] = {"mean": round(m, 3), "sd": round(sd, 3),
                             "seeds": [round(p, 3) for p in ppl]}  # fmt: skip
            if rel:
                summary[name]["vs_centralised"] = round(mean_std(rel)[0], 4)
                summary[name]["vs_centralised_sd"] = round(mean_std(rel)[1], 4)
                if name == diloco:
                    ratios["ratio"].extend(rel)
                if name == solo:
                    ratios["solo_over_centralised"].extend(rel)
        by_h[str(H)] = summary
    result = {
        "benchmark": "quality",
        "model": "tiny",
        "sites": S,
        "batch_per_site": B,
        "inner_steps": args.inner_steps,
        "optimiser_steps": T,
        "tokens": tokens,
        "seeds": args.seeds,
        "outer": {label: asdict(cfg) for label, cfg in outers},
        "warmup_steps": args.warmup_steps,
        "min_lr_factor": args.min_lr_factor,
        "by_h": by_h,
        "curves": {f"H={H} seed={s}": v["curves"] for (H, s), v in results.items()},
        "train_s": {f"H={H} seed={s}": v["train_s"] for (H, s), v in results.items()},
        "paper_diloco_over_centralised": round(PAPER_RATIO, 4),
    }
    for key, values in ratios.items():  # mean over seeds and H values
        result[key] = round(mean_std(values)[0], 4) if values else None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
