"""Benchmark: crossfed's inner phase against a bare torch training loop, side by side.

Both train the same torchtitan Qwen3 on the same pre-tokenised windows with the same AdamW,
clipping and learning rate, in this one process. crossfed's side is the real thing: windows
from a DARL lease (shuffled blocks, one memmap read per span), the step plan over W x A x B,
the window-limit check before every step, a heartbeat thread refreshing the lease, and the
per-step metrics the site loop records. The bare side reads contiguous batches and loops.
Repeats alternate between the two, each going first every other time (this machine is
shared); ``ratio`` is the median over repeats of crossfed's tokens/s over the bare loop's in
the same repeat. Prints one JSON object as its last line.

    .venv/bin/python bench/inner_loop.py                 # CPU: tiny flavour
    .venv/bin/python bench/inner_loop.py --flavour 0.6B --device cuda --seq-len 2048
    .venv/bin/python bench/inner_loop.py ... --compile --activation-checkpointing selective

``--compile`` / ``--activation-checkpointing`` apply the site's torchtitan options (the
``parallelize`` a one-process site runs) to the one model both sides train.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from crossfed.darl.blockspace import BlockSpace
from crossfed.data.prepare import prepare
from crossfed.data.windows import WindowStore
from crossfed.site import Heartbeat
from crossfed.train.distributed import ParallelConfig, Ranks, mfu, parallelize, uses_autocast
from crossfed.train.inner import (
    InnerConfig,
    LeaseWindows,
    StepInfo,
    Trainer,
    language_model_loss,
    make_optimizer,
    run_inner_phase,
)
from crossfed.train.model import build_model, flops_per_token
from crossfed.train.schedule import LRSchedule


class StubClient:
    """Answers heartbeats like a coordinator one round trip away."""

    def __init__(self, lease: dict, rtt_s: float) -> None:
        self.lease, self.rtt_s, self.beats = lease, rtt_s, 0

    def heartbeat(self, lease_id, site, consumed, t_step_s, *extra, **options) -> dict:
        time.sleep(self.rtt_s)
        self.beats += 1
        return {"lease": {**self.lease, "consumed": consumed}, "echo": None}


def bare_loop(model, optimizer, store, config, schedule, steps, device, autocast) -> int:
    """The loop anyone would write: contiguous batches, micro-batches, clip, step."""
    per_step, tokens = config.windows_per_step, 0
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        batch = torch.from_numpy(store.windows(step * per_step, (step + 1) * per_step))
        batch = batch.to(device)
        for chunk in torch.split(batch, config.micro_batch):
            with torch.autocast(device.split(":")[0], torch.bfloat16, enabled=autocast):
                loss = language_model_loss(model, chunk) * (len(chunk) / len(batch))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += batch.shape[0] * (batch.shape[1] - 1)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return tokens


def crossfed_phase(trainer, store, space, blocks, schedule, heartbeat_s) -> tuple[int, int]:
    """The site loop's inner phase on a lease of ``blocks``, with a live heartbeat thread."""
    ranges = [(r.start, r.stop) for r in (space.block_windows(b) for b in blocks)]
    lease = {"lease_id": 1, "n_blocks": len(blocks), "blocks": list(blocks), "consumed": 0}
    client = StubClient(lease, rtt_s=0.002)
    sizes = [b - a for a, b in ranges]
    rates: list[float] = []  # per-step tokens/s, as the site loop logs them
    with Heartbeat(client, "bench", lease, heartbeat_s) as beat:

        def limit() -> int:
            return 0 if beat.lost is not None else sum(sizes[: beat.allowed_blocks])

        def on_step(info: StepInfo) -> None:
            covered, left = 0, info.windows_done
            for size in sizes:
                if left < size:
                    break
                left, covered = left - size, covered + 1
            beat.consumed = max(beat.consumed, covered)
            beat.t_step_s = info.step_s
            rates.append(info.tokens / max(1e-9, info.step_s))

        state = run_inner_phase(
            trainer,
            store.windows,
            LeaseWindows.of(ranges),
            schedule=schedule,
            global_step=0,
            window_limit=limit,
            on_step=on_step,
        )
    if trainer.device.startswith("cuda"):
        torch.cuda.synchronize()
    return state.tokens, client.beats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flavour", default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--data", help="a prepared data directory (default: build one)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heartbeat-s", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="torch.compile per block")
    parser.add_argument("--activation-checkpointing", default="none")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    data = Path(args.data) if args.data else Path(tmp.name) / "data"
    if not args.data:
        prepare(data, vocab_size=args.vocab_size, seq_len=args.seq_len, val_fraction=0.05,
                shards=2, log=lambda *_: None)  # fmt: skip
    store = WindowStore.open(data, "train")
    config = InnerConfig(
        micro_batch=args.micro_batch, ranks=args.ranks, accumulation=args.accumulation
    )
    windows = config.windows_per_step * args.steps
    if windows > store.n_windows:
        raise SystemExit(f"need {windows} windows, the data has {store.n_windows}")
    block = config.windows_per_step
    space = BlockSpace(store.n_windows, block, seed=1)
    blocks = space.permutation(0)[: args.steps].tolist()
    schedule = LRSchedule(peak_lr=1e-3, warmup_steps=2, total_steps=1000)
    ranks = Ranks()
    autocast = uses_autocast(args.device, ranks)

    fresh = build_model(args.flavour, vocab_size=store.vocab_size, device=args.device)
    fpt = flops_per_token(fresh, args.flavour, store.vocab_size, store.seq_len)
    options = ParallelConfig(args.compile, args.activation_checkpointing)
    if options != ParallelConfig():  # as a one-process site applies them
        fresh = parallelize(fresh, ranks, options, args.device)
    state0 = {k: v.clone() for k, v in fresh.state_dict().items()}

    def reset() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        fresh.load_state_dict(state0)
        return fresh, make_optimizer(fresh, config, lr=0.0)

    model, optimizer = reset()  # warm-up: allocator, kernels, page cache
    bare_loop(model, optimizer, store, config, schedule, 2, args.device, autocast)
    bare, ours, beats = [], [], 0
    bare_cpu, ours_cpu = [], []  # tokens per main-thread CPU second: blind to other tenants

    def run_bare() -> None:
        model, optimizer = reset()
        t0, c0 = time.perf_counter(), time.thread_time()
        tokens = bare_loop(model, optimizer, store, config, schedule, args.steps, args.device,
                           autocast)  # fmt: skip
        bare.append(tokens / (time.perf_counter() - t0))
        bare_cpu.append(tokens / (time.thread_time() - c0))

    def run_ours() -> int:
        model, optimizer = reset()
        trainer = Trainer(model, optimizer, config, device=args.device, autocast=autocast)
        t0, c0 = time.perf_counter(), time.thread_time()
        tokens, n = crossfed_phase(trainer, store, space, blocks, schedule, args.heartbeat_s)
        ours.append(tokens / (time.perf_counter() - t0))
        ours_cpu.append(tokens / (time.thread_time() - c0))
        return n

    for i in range(args.repeats):  # alternate which goes first: no order advantage
        if i % 2 == 0:
            run_bare()
            beats += run_ours()
        else:
            beats += run_ours()
            run_bare()
    bare_tps, ours_tps = statistics.median(bare), statistics.median(ours)
    paired = statistics.median(o / b for o, b in zip(ours, bare, strict=True))
    result = {
        "benchmark": "inner_loop",
        "device": args.device,
        "flavour": args.flavour,
        "seq_len": store.seq_len,
        "windows_per_step": config.windows_per_step,
        "steps": args.steps,
        "repeats": args.repeats,
        "compile": args.compile,
        "activation_checkpointing": args.activation_checkpointing,
        "bare_tokens_per_s": round(bare_tps, 1),
        "crossfed_tokens_per_s": round(ours_tps, 1),
        "heartbeats": beats,
        "mfu": mfu(ours_tps, fpt, args.device, 1),
        "flops_per_token": fpt,
        "bare_runs": [round(x, 1) for x in bare],
        "crossfed_runs": [round(x, 1) for x in ours],
        "ratio_of_best": round(max(ours) / max(bare), 4),
        "cpu_time_ratio": round(
            statistics.median(o / b for o, b in zip(ours_cpu, bare_cpu, strict=True)), 4
        ),
        "ratio": round(paired, 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
