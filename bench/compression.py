"""Benchmark: int8 and int4 delta compression, with and without error feedback: bytes on the
wire and the effect on the trained model.

Two measurements, one run:

1. Bytes and time, on Qwen3-0.6B-shaped deltas (the real model's tensor shapes; ``--params``
   keeps the vocabulary and depth that give about that many values, the per-value cost is
   the same): the file size of a bf16 delta against blockwise int8 (one fp32 scale per 256
   values) and int4 (one bf16 scale per 64 values) ones (``crossfed.wire.codecs``), the time to
   write and to decode each, and the relative error of one delta and of one outer step
   computed from the decoded deltas against the same step from exact fp32 deltas.
2. Quality, on the tiny Qwen3 trained by DiLoCo in this process (2 sites, real inner AdamW
   phases, the coordinator's outer step), five runs on the same data: bf16 deltas, int8 and
   int4 without and with error feedback (the site adds the residual its codec dropped last
   round and keeps the new one, through the real files: ``save_delta`` -> ``open_delta``).
   Every round of a compressed run also computes the step its sites' plain bf16 deltas would
   have given from the same state (the per-round update error); the held-out loss of every
   run is compared with bf16's.

Prints one JSON object as its last line; ``bytes_ratio_4bit`` (int4 bytes / bf16 bytes) and
``loss_rel_diff_4bit`` ((int4 with error feedback - bf16) / bf16 final held-out loss) are the
targets' figures (<= 0.27 and <= 0.005).

    .venv/bin/python bench/compression.py            # 30 rounds: about 14 min under load
    .venv/bin/python bench/compression.py --params 20000000 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors.torch import load_file

from crossfed.darl.blockspace import BlockSpace
from crossfed.data.prepare import prepare
from crossfed.data.windows import WindowStore
from crossfed.outer import outer_step
from crossfed.outer_presets import OuterConfig
from crossfed.train.inner import (
    InnerConfig,
    LeaseWindows,
    Trainer,
    evaluate,
    make_optimizer,
    run_inner_phase,
)
from crossfed.train.model import build_model, load_parameters, parameters_of
from crossfed.train.schedule import LRSchedule
from crossfed.wire.codecs import BLOCK, BLOCK_INT4, open_delta, save_delta

CODECS = ("none", "int8", "int4")
#: the quality runs: name -> (codec, error feedback)
RUNS = {
    "bf16": ("none", False),
    "int8": ("int8", False),
    "int8_ef": ("int8", True),
    "int4": ("int4", False),
    "int4_ef": ("int4", True),
}
#: bytes per value of each codec (scales included, headers left out)
PER_VALUE = {"none": 2.0, "int8": 1 + 4 / BLOCK, "int4": 0.5 + 2 / BLOCK_INT4}


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all tensors."""
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return math.sqrt(num / den) if den else 0.0


def step_update(
    master: dict[str, torch.Tensor],
    momentum: dict[str, torch.Tensor],
    deltas: list,
    tokens: list[int],
    outer: OuterConfig,
) -> dict[str, torch.Tensor]:
    """The change one outer step makes, on copies of the state."""
    w = {k: v.clone() for k, v in master.items()}
    b = {k: v.clone() for k, v in momentum.items()}
    outer_step(w, b, deltas, tokens, outer, kernel="eager")
    return {k: w[k] - master[k] for k in master}


# --------------------------------------------------------------------------- 1: bytes
def qwen3_06b_layout(params: int | None) -> dict[str, tuple[int, ...]]:
    """Qwen3-0.6B's tensor shapes (built on the meta device), or its first layers and a
    cut vocabulary holding about ``params`` values."""
    model = build_model("0.6B", vocab_size=151936, device="meta")
    full = {name: tuple(t.shape) for name, t in parameters_of(model).items()}
    total = sum(math.prod(s) for s in full.values())
    if params is None or params >= total:
        return full
    f = params / total
    layers = max(1, round(28 * f))
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in full.items():
        if name.startswith("layers.") and int(name.split(".")[1]) >= layers:
            continue
        if name in ("tok_embeddings.weight", "output.weight"):
            shape = (max(1, round(shape[0] * f)), *shape[1:])
        out[name] = shape
    return out


def bytes_and_error(params: int | None, work: Path) -> dict:
    layout = qwen3_06b_layout(params)
    gen = torch.Generator().manual_seed(0)
    master = {n: torch.randn(s, generator=gen) * 0.02 for n, s in layout.items()}
    scales = {n: 10 ** float(torch.empty(()).uniform_(-4, -2, generator=gen)) for n in layout}
    sites = [
        {n: master[n] + torch.randn(master[n].shape, generator=gen) * scales[n] for n in master}
        for _ in range(2)
    ]
    n_params = sum(v.numel() for v in master.values())
    out: dict = {"params": n_params, "tensors": len(layout)}
    files: dict[str, list[Path]] = {}
    for codec in CODECS:
        t0 = time.perf_counter()
        files[codec] = []
        for i, site in enumerate(sites):
            path = work / f"delta-{codec}-{i}.safetensors"
            save_delta(site, master, path, codec=codec)
            files[codec].append(path)
        out[f"write_s_{codec}"] = (time.perf_counter() - t0) / len(sites)
        out[f"bytes_{codec}"] = files[codec][0].stat().st_size
        t0 = time.perf_counter()
        with open_delta(files[codec][0]) as delta:
            for name in delta.keys():
                delta[name]
        out[f"read_s_{codec}"] = time.perf_counter() - t0
    out["bytes_ratio_int8"] = out["bytes_int8"] / out["bytes_none"]
    out["bytes_ratio_4bit"] = out["bytes_int4"] / out["bytes_none"]
    exact = [{n: site[n] - master[n] for n in master} for site in sites]
    tokens = [3000, 1000]
    outer = OuterConfig()
    reference = step_update(master, {}, exact, tokens, outer)
    for codec in CODECS:
        with ExitStack() as stack:
            views = [stack.enter_context(open_delta(p)) for p in files[codec]]
            got = step_update(master, {}, views, tokens, outer)
        out[f"outer_step_rel_err_{codec}"] = rel(got, reference)
        with open_delta(files[codec][0]) as view:
            out[f"delta_rel_err_{codec}"] = rel(dict(view.items()), exact[0])
    for paths in files.values():
        for p in paths:
            p.unlink()
    return out


# --------------------------------------------------------------------------- 2: quality
def as_ranges(windows: list[int]) -> list[tuple[int, int]]:
    """Consecutive window indices as [start, stop) ranges, in order."""
    ranges: list[tuple[int, int]] = []
    for w in windows:
        if ranges and ranges[-1][1] == w:
            ranges[-1] = (ranges[-1][0], w + 1)
        else:
            ranges.append((w, w + 1))
    return ranges


class DiLoCo:
    """Global model, per-site inner optimisers and residuals, and the outer state, all in
    this process."""

    def __init__(
        self, name: str, store, schedule, inner, sites: int, codec: str, feedback: bool, work
    ) -> None:
        self.name, self.store, self.schedule, self.inner = name, store, schedule, inner
        self.codec, self.feedback, self.work = codec, feedback, work
        self.model = build_model("tiny", vocab_size=store.vocab_size, seed=0)
        self.master = {k: v.detach().clone().float() for k, v in parameters_of(self.model).items()}
        self.momentum: dict[str, torch.Tensor] = {}
        self.optimizers = [make_optimizer(self.model, inner, lr=0.0) for _ in range(sites)]
        self.residuals: list[dict[str, torch.Tensor] | None] = [None] * sites
        self.global_step = 0
        self.outer = OuterConfig()
        self.update_errors: list[float] = []
        self.delta_bytes = 0

    def round(self, leases: list[list[tuple[int, int]]], steps: int) -> None:
        paths, plain, tokens = [], [], []
        reference = {k: v.to(torch.bfloat16) for k, v in self.master.items()}  # as served
        for i, lease in enumerate(leases):
            load_parameters(self.model, reference)
            trainer = Trainer(self.model, self.optimizers[i], self.inner)
            state = run_inner_phase(
                trainer,
                self.store.windows,
                LeaseWindows.of(lease),
                schedule=self.schedule,
                global_step=self.global_step,
            )
            params = parameters_of(self.model)
            path = self.work / f"{self.name}-{i}.safetensors"
            residual = self.work / f"{self.name}-residual-{i}.safetensors"
            save_delta(
                params,
                reference,
                path,
                codec=self.codec,
                residual_in=self.residuals[i],
                residual_out=residual if self.feedback else None,
            )
            if self.feedback:
                self.residuals[i] = load_file(str(residual))
            self.delta_bytes = path.stat().st_size
            paths.append(path)
            if self.codec != "none":
                bf16 = self.work / f"{self.name}-bf16-{i}.safetensors"
                save_delta(params, reference, bf16)
                plain.append(bf16)
            tokens.append(state.tokens)
        with ExitStack() as stack:
            views = [stack.enter_context(open_delta(p)) for p in paths]
            if plain:
                bf16_views = [stack.enter_context(open_delta(p)) for p in plain]
                want = step_update(self.master, self.momentum, bf16_views, tokens, self.outer)
                got = step_update(self.master, self.momentum, views, tokens, self.outer)
                self.update_errors.append(rel(got, want))
            outer_step(self.master, self.momentum, views, tokens, self.outer, kernel="eager")
        self.global_step += steps

    def held_out(self, val: WindowStore, max_windows: int) -> float:
        load_parameters(self.model, self.master)
        loss, _ = evaluate(self.model, val.windows, val.n_windows, max_windows=max_windows)
        return loss


def quality(args: argparse.Namespace, work: Path) -> dict:
    data = work / "data"
    prepare(data, vocab_size=1024, seq_len=64, val_fraction=0.05, shards=2, log=lambda *_: None)
    store, val = WindowStore.open(data, "train"), WindowStore.open(data, "val")
    space = BlockSpace(store.n_windows, 16, seed=args.data_seed)
    order = [w for b in space.permutation(0) for w in space.block_windows(int(b))]
    sites, batch, steps, rounds = 2, args.batch, args.inner_steps, args.rounds
    need = sites * batch * steps * rounds
    if need > len(order):
        raise SystemExit(f"the data has {len(order)} windows, the benchmark needs {need}")
    per_site = batch * steps
    plan = [
        [as_ranges(order[(r * sites + i) * per_site :][:per_site]) for i in range(sites)]
        for r in range(rounds)
    ]
    schedule = LRSchedule(peak_lr=3e-3, warmup_steps=steps, total_steps=rounds * steps)
    inner = InnerConfig(micro_batch=batch)
    runs = {
        name: DiLoCo(name, store, schedule, inner, sites, codec, feedback, work)
        for name, (codec, feedback) in RUNS.items()
        if name in args.runs
    }
    curves: dict[str, list[float]] = {name: [] for name in runs}
    evaluated: list[int] = []
    for r in range(rounds):
        for run in runs.values():
            run.round(plan[r], steps)
        if (r + 1) % args.eval_every and r + 1 != rounds:
            continue
        evaluated.append(r + 1)
        for name, run in runs.items():
            curves[name].append(run.held_out(val, args.eval_windows))
        shown = ", ".join(f"{name} {curve[-1]:.4f}" for name, curve in curves.items())
        print(f"round {r + 1}/{rounds}: held-out loss {shown}", flush=True)
    final = {name: curve[-1] for name, curve in curves.items()}
    out: dict = {
        "rounds": rounds,
        "inner_steps": steps,
        "sites": sites,
        "micro_batch": batch,
        "evaluated_after_rounds": evaluated,
        "runs": list(runs),
    }
    out["data_seed"] = args.data_seed
    for name, run in runs.items():
        out[f"held_out_loss_{name}"] = final[name]
        out[f"held_out_curve_{name}"] = [round(x, 4) for x in curves[name]]
        out[f"tiny_delta_bytes_{name}"] = run.delta_bytes
        if name != "bf16":
            out[f"loss_rel_diff_{name}"] = (final[name] - final["bf16"]) / final["bf16"]
            out[f"update_rel_err_{name}"] = sum(run.update_errors) / len(run.update_errors)
    if "int4_ef" in out["runs"]:
        out["loss_rel_diff_4bit"] = out["loss_rel_diff_int4_ef"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=50_000_000, help="delta size for part 1")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="windows per inner step")
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--eval-every", type=int, default=5, help="rounds between evaluations")
    parser.add_argument("--data-seed", type=int, default=1234, help="the block order's seed")
    parser.add_argument(
        "--runs",
        type=lambda text: text.split(","),
        default=list(RUNS),
        help=f"comma-separated subset of {','.join(RUNS)} (bf16 always runs)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (the tiny model gains nothing)"
    )
    args = parser.parse_args()
    unknown = sorted(set(args.runs).difference(RUNS))
    if unknown:
        parser.error(f"unknown runs {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    args.runs = ["bf16", *[r for r in args.runs if r != "bf16"]]
    torch.set_num_threads(args.threads)
    started, cpu_started = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory(prefix="crossfed-compress-") as tmp:
        work = Path(tmp)
        sizes = bytes_and_error(args.params, work)
        print(json.dumps(sizes), flush=True)
        q = quality(args, work)
    full = sum(math.prod(s) for s in qwen3_06b_layout(None).values())
    result = {
        "bench": "compression",
        "codecs": {
            "int8": f"int8, one fp32 scale per {BLOCK} values",
            "int4": f"int4 (-7..7), one bf16 scale per {BLOCK_INT4} values",
        },
        **sizes,
        **{f"full_model_bytes_{c}": round(full * PER_VALUE[c]) for c in CODECS},
        **q,
        "quality_target_met": q.get("loss_rel_diff_4bit", math.inf) <= 0.005
        and sizes["bytes_ratio_4bit"] <= 0.27,
        "wall_s": round(time.perf_counter() - started, 1),
        "cpu_s": round(time.process_time() - cpu_started, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
