"""Benchmark: int8 delta compression, bytes saved and the effect on the merged model.

Two measurements, one run:

1. Bytes and time, on Qwen3-0.6B-shaped deltas (``--params`` scales the layout down; the
   full model's figures follow from the same per-value cost): the file size of a bf16 delta
   against a blockwise-int8 one (``crossfed.compress``, one fp32 scale per 256 values), the
   time to write and to decode each, and the relative error of one outer step computed from
   the decoded deltas against the same step from exact fp32 deltas (bf16 is the baseline
   every run already pays).
2. Quality, on the tiny Qwen3 trained by DiLoCo in this process (2 sites, real inner AdamW
   phases, the coordinator's outer step): one run sends bf16 deltas, one sends int8 deltas
   through the real file path (``save_delta`` -> ``open_delta``). Every round of the int8 run
   also computes the step its sites' bf16 deltas would have given from the same state, so the
   per-round update error is measured without the two trajectories drifting apart; the final
   held-out loss of both runs is compared too.

Prints one JSON object as its last line.

    .venv/bin/python bench/compression.py                      # about two minutes
    .venv/bin/python bench/compression.py --params 20000000 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge import scaled_layout  # noqa: E402  (sibling benchmark: the Qwen3-0.6B layout)

from crossfed.compress import BLOCK, open_delta  # noqa: E402
from crossfed.darl.blockspace import BlockSpace  # noqa: E402
from crossfed.outer import OuterConfig, outer_step  # noqa: E402
from crossfed.train.inner import (  # noqa: E402
    InnerConfig,
    LeaseWindows,
    Trainer,
    evaluate,
    make_optimizer,
    run_inner_phase,
)
from crossfed.train.model import build_model, load_parameters, parameters_of  # noqa: E402
from crossfed.train.prepare import prepare  # noqa: E402
from crossfed.train.schedule import LRSchedule  # noqa: E402
from crossfed.train.windows import WindowStore  # noqa: E402
from crossfed.transport import save_delta  # noqa: E402

FULL_PARAMS = 596_049_920  # Qwen3-0.6B with tied embeddings (bench/merge.py's layout)


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
def bytes_and_error(params: int | None, work: Path) -> dict:
    layout = scaled_layout(params)
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
    for codec in ("none", "int8"):
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
    out["bytes_saved_fraction"] = 1 - out["bytes_int8"] / out["bytes_none"]
    exact = [{n: site[n] - master[n] for n in master} for site in sites]
    tokens = [3000, 1000]
    outer = OuterConfig()
    reference = step_update(master, {}, exact, tokens, outer)
    for codec in ("none", "int8"):
        with ExitStack() as stack:
            views = [stack.enter_context(open_delta(p)) for p in files[codec]]
            got = step_update(master, {}, views, tokens, outer)
        out[f"outer_step_rel_err_{codec}"] = rel(got, reference)
        with ExitStack() as stack:
            views = [stack.enter_context(open_delta(p)) for p in files[codec]]
            out[f"delta_rel_err_{codec}"] = rel(dict(views[0].items()), exact[0])
    for p in files["none"] + files["int8"]:
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
    """Global model, per-site inner optimisers and the outer state, all in this process."""

    def __init__(self, store, vocab, schedule, inner, sites, codec, work: Path) -> None:
        self.store, self.schedule, self.inner, self.codec, self.work = (
            store,
            schedule,
            inner,
            codec,
            work,
        )
        self.model = build_model("tiny", vocab_size=vocab, seed=0)
        self.master = {k: v.detach().clone().float() for k, v in parameters_of(self.model).items()}
        self.momentum: dict[str, torch.Tensor] = {}
        self.optimizers = [make_optimizer(self.model, inner, lr=0.0) for _ in range(sites)]
        self.global_step = 0
        self.outer = OuterConfig()
        self.update_errors: list[float] = []

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
            path = self.work / f"{self.codec}-{i}.safetensors"
            save_delta(params, reference, path, codec=self.codec)
            paths.append(path)
            if self.codec != "none":
                bf16 = self.work / f"bf16-{i}.safetensors"
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
    space = BlockSpace(store.n_windows, 16, seed=1234)
    order = [w for b in space.permutation(0) for w in space.block_windows(int(b))]
    sites, batch, steps, rounds = 2, 8, args.inner_steps, args.rounds
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
        codec: DiLoCo(store, store.vocab_size, schedule, inner, sites, codec, work)
        for codec in ("none", "int8")
    }
    curves: dict[str, list[float]] = {codec: [] for codec in runs}
    for r in range(rounds):
        for codec, run in runs.items():
            run.round(plan[r], steps)
            curves[codec].append(run.held_out(val, args.eval_windows))
        print(
            f"round {r + 1}/{rounds}: held-out loss bf16 {curves['none'][-1]:.4f}, "
            f"int8 {curves['int8'][-1]:.4f}, "
            f"int8 update error {runs['int8'].update_errors[-1]:.2e}",
            flush=True,
        )
    return {
        "rounds": rounds,
        "inner_steps": steps,
        "sites": sites,
        "held_out_loss_bf16": curves["none"][-1],
        "held_out_loss_int8": curves["int8"][-1],
        "held_out_loss_diff": curves["int8"][-1] - curves["none"][-1],
        "held_out_curve_bf16": [round(x, 4) for x in curves["none"]],
        "held_out_curve_int8": [round(x, 4) for x in curves["int8"]],
        "update_rel_err_int8_vs_bf16": runs["int8"].update_errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=50_000_000, help="delta size for part 1")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="crossfed-compress-") as tmp:
        work = Path(tmp)
        sizes = bytes_and_error(args.params, work)
        print(json.dumps(sizes), flush=True)
        q = quality(args, work)
    per_value_int8 = 1 + 4 / BLOCK
    result = {
        "bench": "compression",
        "codec": f"int8, one fp32 scale per {BLOCK} values",
        **{k: v for k, v in sizes.items()},
        "full_model_bytes_bf16": FULL_PARAMS * 2,
        "full_model_bytes_int8": round(FULL_PARAMS * per_value_int8),
        "full_model_bytes_saved": round(FULL_PARAMS * (2 - per_value_int8)),
        **q,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
