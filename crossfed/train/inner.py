"""One DiLoCo inner phase: AdamW steps over exactly the leased windows.

A site's global batch per step is ``ranks * accumulation * micro_batch`` windows. In a single
process the ``ranks`` are simulated as extra accumulation micro-batches (the same gradient a
data-parallel all-reduce would give); under torchrun each rank takes its own slice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from crossfed.train.schedule import LRSchedule


@dataclass(frozen=True)
class InnerConfig:
    """Shape and optimiser of one site's inner phase."""

    micro_batch: int = 4
    ranks: int = 1
    accumulation: int = 1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    #: simulated slowness of a local site: each step is stretched to ``slowdown`` times its cost
    slowdown: float = 1.0

    @property
    def windows_per_step(self) -> int:
        return self.micro_batch * self.ranks * self.accumulation


@dataclass
class StepInfo:
    """What a step reports to the site loop (console, heartbeat, metrics)."""

    step: int
    global_step: int
    windows_done: int
    loss: float
    lr: float
    step_s: float
    tokens: int


@dataclass
class PhaseResult:
    """Outcome of one inner phase."""

    steps: int
    windows: int
    tokens: int
    loss_mean: float
    loss_last: float
    compute_s: float
    step_s: float
    stopped_early: bool


def make_optimizer(model: torch.nn.Module, config: InnerConfig, lr: float) -> torch.optim.AdamW:
    """AdamW with decay on matrices only, as torchtitan and nanoGPT do."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=config.betas, fused=False)


def language_model_loss(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over windows of ``seq_len + 1`` tokens."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def iter_window_batches(
    read: Callable[[int, int], np.ndarray], ranges: Sequence[tuple[int, int]], size: int
) -> Iterator[np.ndarray]:
    """Yield consecutive batches of ``size`` windows over the ranges, the last possibly short."""
    pending: list[np.ndarray] = []
    count = 0
    for start, stop in ranges:
        cursor = start
        while cursor < stop:
            take = min(stop - cursor, size - count)
            pending.append(read(cursor, cursor + take))
            count += take
            cursor += take
            if count == size:
                yield np.concatenate(pending)
                pending, count = [], 0
    if count:
        yield np.concatenate(pending)


def run_inner_phase(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    read: Callable[[int, int], np.ndarray],
    ranges: Sequence[tuple[int, int]],
    *,
    config: InnerConfig,
    schedule: LRSchedule,
    global_step: int,
    window_limit: Callable[[], int] | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
    device: str = "cpu",
) -> PhaseResult:
    """Train on every window of ``ranges`` in order, one optimiser step per global batch.

    ``window_limit()`` is asked before each step: a steal shrinks the lease and the phase
    stops exactly at the new limit (the last step may be short), never training past it.
    """
    model.train()
    per_step = config.windows_per_step
    done = steps = tokens = 0
    losses: list[float] = []
    stopped_early = False
    started = time.perf_counter()
    for batch in iter_window_batches(read, ranges, per_step):
        limit = window_limit() if window_limit else None
        if limit is not None and done + len(batch) > limit:
            batch = batch[: max(0, limit - done)]
            stopped_early = True
            if len(batch) == 0:
                break
        t0 = time.perf_counter()
        lr = schedule.lr_at(global_step + steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro = torch.from_numpy(batch.astype(np.int64)).to(device)
        chunks = torch.split(micro, config.micro_batch)
        step_loss = 0.0
        for chunk in chunks:
            loss = language_model_loss(model, chunk) * (len(chunk) / len(micro))
            loss.backward()
            step_loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s = time.perf_counter() - t0
        if config.slowdown > 1.0:
            time.sleep(step_s * (config.slowdown - 1.0))
            step_s *= config.slowdown
        steps += 1
        done += len(batch)
        tokens += int(batch.shape[0] * (batch.shape[1] - 1))
        losses.append(step_loss)
        if on_step:
            on_step(StepInfo(steps, global_step + steps, done, step_loss, lr, step_s, tokens))
        if stopped_early:
            break
    compute_s = time.perf_counter() - started
    return PhaseResult(
        steps=steps,
        windows=done,
        tokens=tokens,
        loss_mean=float(np.mean(losses)) if losses else float("nan"),
        loss_last=losses[-1] if losses else float("nan"),
        compute_s=compute_s,
        step_s=compute_s / steps if steps else 0.0,
        stopped_early=stopped_early,
    )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    read: Callable[[int, int], np.ndarray],
    n_windows: int,
    *,
    batch: int = 16,
    max_windows: int | None = None,
    device: str = "cpu",
) -> tuple[float, float]:
    """Held-out (mean loss, perplexity) over the first ``max_windows`` validation windows."""
    model.eval()
    total = min(n_windows, max_windows or n_windows)
    loss_sum = 0.0
    for start in range(0, total, batch):
        stop = min(total, start + batch)
        windows = torch.from_numpy(read(start, stop).astype(np.int64)).to(device)
        loss_sum += float(language_model_loss(model, windows)) * (stop - start)
    mean = loss_sum / max(1, total)
    return mean, float(np.exp(mean))
