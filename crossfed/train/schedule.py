"""The inner learning-rate schedule, indexed by the GLOBAL step so joiners continue it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

#: a new run's warmup when its config leaves ``inner.warmup_steps`` unset, as a share of its
#: steps (docs/quality.md, "The inner schedule with today's defaults")
WARMUP_SHARE = 0.1


#: a new run's floor when its config leaves ``inner.min_lr_factor`` unset, as a share of the peak
#: rate: at H=25 and H=100 over three seeds each, three sites decaying to half the peak rate
#: instead of a tenth end 3-8% lower in perplexity (docs/quality.md, "The sites'
#: learning-rate floor")
DEFAULT_MIN_LR_FACTOR = 0.5


def default_warmup_steps(total_steps: int) -> int:
    """The warmup of a new run of ``total_steps`` inner steps whose config leaves it unset:
    :data:`WARMUP_SHARE` of them, at least one."""
    return max(1, round(WARMUP_SHARE * total_steps))


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup then cosine decay to ``min_lr_factor * peak_lr`` at ``total_steps``.

    ``warmup_steps`` or ``min_lr_factor`` None is a run spec's setting not yet decided (a
    config that leaves it unset), resolved when the run is stored; a schedule that trains
    always has numbers.
    """

    peak_lr: float = 3e-3
    warmup_steps: int | None = 20
    total_steps: int = 1000
    min_lr_factor: float | None = DEFAULT_MIN_LR_FACTOR

    def lr_at(self, global_step: int) -> float:
        """Learning rate of the optimiser step numbered ``global_step`` (0-based)."""
        if self.warmup_steps is None or self.min_lr_factor is None:
            raise ValueError("the schedule is not decided yet: resolve the run spec first")
        if global_step < self.warmup_steps:
            return self.peak_lr * (global_step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (global_step - self.warmup_steps) / decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr * (self.min_lr_factor + (1.0 - self.min_lr_factor) * cosine)


def round_steps(schedule: Mapping[str, int], round_no: int) -> int:
    """H of round ``round_no`` under a run's inner schedule (``steps``, and optionally
    ``early_rounds`` and ``early_steps``: the first ``early_rounds`` rounds train
    ``early_steps`` inner steps each, the later ones ``steps``)."""
    if round_no <= int(schedule.get("early_rounds", 0)):
        return int(schedule["early_steps"])
    return int(schedule["steps"])
