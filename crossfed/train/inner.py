"""One DiLoCo inner phase: AdamW steps over exactly the leased windows.

The leased blocks form one sequence of windows, its *positions* ``0 .. n-1``; the data cursor
is a position. An optimiser step takes the next ``ranks * accumulation * micro_batch`` (W*A*B)
positions; rank ``r`` trains the ``r``-th contiguous share of them in micro-batches of B. The
last step of a lease may be short: its windows are split as evenly as the ranks allow, and a
rank with fewer micro-batches runs zero-weight ones so every rank makes the same collective
calls. Every leased window is trained exactly once, in the same step, whatever W, A and B are.

Each micro-batch's mean loss is weighted by its share of the step's windows and the weighted
gradients are *summed* over ranks, so the step's gradient is the mean over its windows. In one
process the W ranks are simulated one after another (the local default); under torchrun with
FSDP each process trains its own rank and FSDP sums the gradients (see ``distributed.py``).
Both give the same step, to floating-point summation order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from crossfed.train.model import attention_masks
from crossfed.train.schedule import LRSchedule


class InnerConfigError(ValueError):
    """An inner-phase shape or setting that cannot be trained."""


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
    #: simulated floor of a local site: each step lasts at least this long (after ``slowdown``),
    #: so simulated rounds take the same time on fast and slow machines
    min_step_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("micro_batch", "ranks", "accumulation"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InnerConfigError(f"inner {name} must be a positive integer, got {value!r}")
        if not self.slowdown >= 1.0:
            raise InnerConfigError(f"inner slowdown must be >= 1, got {self.slowdown!r}")
        if not self.min_step_s >= 0.0:
            raise InnerConfigError(f"inner min_step_s must be >= 0, got {self.min_step_s!r}")

    @property
    def windows_per_step(self) -> int:
        return self.micro_batch * self.ranks * self.accumulation


# ---------------------------------------------------------------------- lease -> steps
@dataclass(frozen=True)
class LeaseWindows:
    """The leased windows as one sequence: ``ranges`` are dataset window spans in lease order."""

    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, ranges: Sequence[tuple[int, int]]) -> LeaseWindows:
        return cls(tuple((int(a), int(b)) for a, b in ranges))

    def __len__(self) -> int:
        return sum(b - a for a, b in self.ranges)

    def spans(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Dataset window spans behind lease positions ``[lo, hi)``, in order."""
        out, offset = [], 0
        for a, b in self.ranges:
            size = b - a
            s, e = max(lo, offset), min(hi, offset + size)
            if s < e:
                out.append((a + s - offset, a + e - offset))
            offset += size
            if offset >= hi:
                break
        return out

    def indices(self, lo: int, hi: int) -> list[int]:
        """Dataset window indices behind lease positions ``[lo, hi)``."""
        return [i for a, b in self.spans(lo, hi) for i in range(a, b)]


def rank_shares(n: int, ranks: int) -> list[tuple[int, int]]:
    """Split ``n`` step positions into ``ranks`` contiguous ``[lo, hi)`` shares, sizes +-1."""
    base, extra = divmod(n, ranks)
    out, lo = [], 0
    for r in range(ranks):
        hi = lo + base + (1 if r < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


@dataclass(frozen=True)
class StepPlan:
    """One optimiser step: positions ``[start, start + n)``, cut into micro-batches per rank.

    ``micro[r]`` lists rank r's micro-batches as absolute position spans; every rank has
    ``passes`` micro-batch slots, the ones beyond ``len(micro[r])`` are zero-weight padding.
    """

    start: int
    n: int
    micro: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def passes(self) -> int:
        return max(len(m) for m in self.micro)


def plan_step(start: int, n: int, config: InnerConfig) -> StepPlan:
    """The micro-batches of the step over positions ``[start, start + n)``."""
    if not 0 < n <= config.windows_per_step:
        raise InnerConfigError(f"a step holds 1..{config.windows_per_step} windows, not {n}")
    micro = []
    for lo, hi in rank_shares(n, config.ranks):
        cuts = range(start + lo, start + hi, config.micro_batch)
        micro.append(tuple((c, min(c + config.micro_batch, start + hi)) for c in cuts))
    return StepPlan(start, n, tuple(micro))


def plan_steps(total: int, config: InnerConfig, start: int = 0) -> Iterator[StepPlan]:
    """Steps from cursor ``start`` to ``total``; only the last may be short."""
    per_step = config.windows_per_step
    cursor = start
    while cursor < total:
        n = min(per_step, total - cursor)
        yield plan_step(cursor, n, config)
        cursor += n


# ---------------------------------------------------------------------- training
@dataclass
class StepInfo:
    """What a step reports to the site loop (console, heartbeat, metrics).

    ``step_loss`` may still be computing on an accelerator: the phase does not wait for it,
    so the host queues the next step while this one runs. Reading ``loss`` waits for it.
    """

    step: int
    global_step: int
    windows_done: int
    step_loss: torch.Tensor | float
    lr: float
    step_s: float
    tokens: int

    @property
    def loss(self) -> float:
        """The step's mean loss over all ranks (waits for the step to finish)."""
        return float(self.step_loss)


@dataclass
class PhaseState:
    """The data cursor and running totals of one inner phase (what a checkpoint saves)."""

    windows: int = 0
    steps: int = 0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    compute_s: float = 0.0
    checkpoint_s: float = 0.0
    stopped_early: bool = False
    #: the first window whose tokens the phase's row counts take in: 0, or (overlapped
    #: rounds) the windows trained before the merged model was folded in
    counted_from: int = 0

    def to_dict(self) -> dict:
        return {
            "windows": self.windows,
            "steps": self.steps,
            "tokens": self.tokens,
            "losses": list(self.losses),
            "compute_s": self.compute_s,
            "checkpoint_s": self.checkpoint_s,
            "stopped_early": self.stopped_early,
            "counted_from": self.counted_from,
        }

    @classmethod
    def from_dict(cls, data: dict) -> PhaseState:
        return cls(**{k: data[k] for k in cls().to_dict() if k in data})


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
    checkpoint_s: float = 0.0

    @classmethod
    def of(cls, state: PhaseState) -> PhaseResult:
        return cls(
            steps=state.steps,
            windows=state.windows,
            tokens=state.tokens,
            loss_mean=float(np.mean(state.losses)) if state.losses else float("nan"),
            loss_last=state.losses[-1] if state.losses else float("nan"),
            compute_s=state.compute_s,
            step_s=state.compute_s / state.steps if state.steps else 0.0,
            stopped_early=state.stopped_early,
            checkpoint_s=state.checkpoint_s,
        )


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups with weight decay on matrices only, as torchtitan and nanoGPT do."""
    return [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]


def make_optimizer(model: torch.nn.Module, config: InnerConfig, lr: float) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (:func:`decay_groups`)."""
    groups = decay_groups(model, config.weight_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=config.betas, fused=False)


def language_model_loss(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over windows of ``seq_len + 1`` tokens."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    masks = attention_masks(model, inputs.shape[0], inputs.shape[1], inputs.device)
    logits = model(inputs) if masks is None else model(inputs, attention_masks=masks)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def read_positions(
    read: Callable[[int, int], np.ndarray], lease: LeaseWindows, lo: int, hi: int
) -> np.ndarray:
    """The windows at lease positions ``[lo, hi)``: one contiguous memmap read per span."""
    parts = [read(a, b) for a, b in lease.spans(lo, hi)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


@dataclass
class Trainer:
    """Forward/backward/step of one rank (or of all W ranks, simulated in one process).

    ``rank``/``world`` are the real process ranks: ``world == 1`` simulates every one of
    ``config.ranks``; ``world == config.ranks`` trains rank ``rank``'s share only.
    ``reduce_loss`` sums a loss tensor over real ranks (identity in one process); it must not
    wait for the device, so the host can queue the next step while this one runs.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    config: InnerConfig
    device: str = "cpu"
    rank: int = 0
    world: int = 1
    autocast: bool = False
    reduce_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss

    def __post_init__(self) -> None:
        if self.world not in (1, self.config.ranks):
            raise InnerConfigError(
                f"{self.world} processes cannot train {self.config.ranks} ranks: run one "
                "process (ranks simulated) or exactly one process per rank"
            )
        self._sync = hasattr(self.model, "set_requires_gradient_sync") and self.world > 1

    def _micro_batches(self, plan: StepPlan) -> list[tuple[int, int] | None]:
        """This process's micro-batch spans, padded with None (zero weight) to ``passes``."""
        ranks = range(self.config.ranks) if self.world == 1 else [self.rank]
        out: list[tuple[int, int] | None] = []
        for r in ranks:
            mine = list(plan.micro[r])
            if self.world > 1:
                mine += [None] * (plan.passes - len(mine))
            out += mine
        return out

    def step(
        self,
        plan: StepPlan,
        fetch: Callable[[int, int], np.ndarray],
        lr: float,
        window_len: Callable[[], int] | None = None,
    ) -> torch.Tensor:
        """One optimiser step over ``plan``; returns the step's mean loss over all ranks.

        The loss comes back as a device tensor without waiting for the device (reading it is
        the caller's sync point). Padding passes train a window of zeros with weight 0
        (``window_len()`` tokens long).
        """
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        micro = self._micro_batches(plan)
        local: torch.Tensor | None = None
        for i, span in enumerate(micro):
            if span is None:  # padding: same collectives, no contribution
                length = window_len() if window_len else fetch(plan.start, plan.start + 1).shape[1]
                windows, weight = np.zeros((1, length), dtype=np.int64), 0.0
            else:
                windows, weight = fetch(*span), (span[1] - span[0]) / plan.n
            if self._sync:
                self.model.set_requires_gradient_sync(i == len(micro) - 1)
            batch = torch.from_numpy(windows).to(self.device, non_blocking=True)
            with self._autocast():
                loss = language_model_loss(self.model, batch) * weight
            loss.backward()
            loss = loss.detach().float()
            local = loss if local is None else local + loss
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        assert local is not None  # a plan has at least one micro-batch
        return self.reduce_loss(local)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.split(":")[0], dtype=torch.bfloat16)


class _LeaseReader:
    """The lease's windows by position, remembering their length (for padding passes)."""

    def __init__(self, read: Callable[[int, int], np.ndarray], lease: LeaseWindows) -> None:
        self.read, self.lease, self.window_len = read, lease, 0

    def __call__(self, lo: int, hi: int) -> np.ndarray:
        windows = read_positions(self.read, self.lease, lo, hi)
        self.window_len = windows.shape[1]
        return windows

    def length_at(self, position: int) -> int:
        """Window length, read once at ``position`` when no window was read yet (a lease
        smaller than its ranks pads before it reads)."""
        if not self.window_len:
            self.window_len = read_positions(self.read, self.lease, position, position + 1).shape[1]
        return self.window_len


class _LossQueue:
    """Step losses the device may still be computing, read in one sync (every 256 steps)."""

    def __init__(self, state: PhaseState) -> None:
        self.state = state
        self.queued: list[torch.Tensor] = []

    def add(self, loss: torch.Tensor) -> None:
        self.queued.append(loss)
        if len(self.queued) >= 256:
            self.settle()

    def settle(self) -> None:
        if self.queued:
            self.state.losses.extend(torch.stack(self.queued).tolist())
            self.queued.clear()


def paced(step_s: float, config: InnerConfig) -> float:
    """A step's seconds after the simulated slowdown and the minimum step time (sleeping)."""
    if config.slowdown > 1.0:
        time.sleep(step_s * (config.slowdown - 1.0))
        step_s *= config.slowdown
    if step_s < config.min_step_s:
        time.sleep(config.min_step_s - step_s)
        step_s = config.min_step_s
    return step_s


def _limited(plan: StepPlan, limit: int, state: PhaseState, config: InnerConfig) -> StepPlan | None:
    """The step cut at the lease's current limit (a steal, the walltime); None: stop here."""
    if plan.start + plan.n <= limit:
        return plan
    state.stopped_early = True
    return None if limit <= plan.start else plan_step(plan.start, limit - plan.start, config)


def run_inner_phase(
    trainer: Trainer,
    read: Callable[[int, int], np.ndarray],
    lease: LeaseWindows,
    *,
    schedule: LRSchedule,
    global_step: int,
    state: PhaseState | None = None,
    window_limit: Callable[[], int] | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
    checkpoint: Callable[[PhaseState], None] | None = None,
    checkpoint_every: int = 0,
    before_step: Callable[[PhaseState], None] | None = None,
) -> PhaseState:
    """Train the lease from ``state.windows`` (the cursor) to its end, one step per W*A*B.

    ``global_step`` is the run's step when the phase began; step ``k`` of the phase uses the
    learning rate of global step ``global_step + k``, so a resumed phase and a joiner both
    continue the schedule. ``window_limit()`` is asked before each step (on every rank): a
    steal shrinks the lease and the phase stops exactly at the new limit, never past it.
    ``checkpoint(state)`` runs every ``checkpoint_every`` steps (0: never); its time is kept
    apart from compute. ``before_step(state)`` runs before each step (on every rank), outside
    the step's time: an overlapped round folds the merged model in there.

    Step time runs from one step's return to the next, so waiting for the device (a settle, a
    logged loss) counts as compute wherever it happens, and the host never waits for a step
    before queueing the next: on an accelerator the host runs at most the launch queue
    ahead, so launch-to-launch time is the device's step time.
    """
    state = state or PhaseState()
    trainer.model.train()
    total, config = len(lease), trainer.config
    windows, losses = _LeaseReader(read, lease), _LossQueue(state)
    mark = time.perf_counter()
    for planned in plan_steps(total, config, start=state.windows):
        if before_step is not None:  # its time is kept out of the next step's
            hook = time.perf_counter()
            before_step(state)
            mark += time.perf_counter() - hook
        plan = _limited(planned, window_limit() if window_limit else total, state, config)
        if plan is None:
            break
        lr = schedule.lr_at(global_step + state.steps)
        loss = trainer.step(plan, windows, lr, lambda: windows.length_at(plan.start))  # noqa: B023
        step_s = paced(time.perf_counter() - mark, config)
        mark = time.perf_counter()
        state.steps += 1
        state.windows += plan.n
        state.compute_s += step_s
        state.tokens += plan.n * (windows.window_len - 1)
        losses.add(loss)
        if on_step:
            info = (state.steps, global_step + state.steps, state.windows, loss, lr, step_s)
            on_step(StepInfo(*info, state.tokens))
        due = checkpoint_every and state.steps % checkpoint_every == 0
        if checkpoint and due and state.windows < total and not state.stopped_early:
            losses.settle()
            state.compute_s += time.perf_counter() - mark
            t1 = time.perf_counter()
            checkpoint(state)
            mark = time.perf_counter()
            state.checkpoint_s += mark - t1
        if state.stopped_early:
            break
    losses.settle()
    state.compute_s += time.perf_counter() - mark
    return state


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
