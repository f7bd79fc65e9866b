"""Which outer step a round takes: the presets and the rule of the live sites' shares.

Pure Python, no torch: the run spec (``crossfed.coordinator.runspec``) names a run's outer
step when the workflow is read, and the arithmetic that applies it lives in
:mod:`crossfed.outer`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

Preset = Literal["average", "paper", "tuned"]
PRESET_NAMES: tuple[str, ...] = get_args(Preset)
#: the preset of a new run whose config leaves ``outer.preset`` unset
DEFAULT_PRESET: Preset = "average"


@dataclass(frozen=True)
class OuterConfig:
    """Outer learning rate ``eta``, Nesterov momentum ``beta``, the solo rule, and the preset.

    ``preset="paper"`` steps with ``eta`` and ``beta`` as given (DiLoCo's 0.7 and 0.9 by
    default) and ``solo_full_step``; ``preset="average"`` and ``preset="tuned"`` ignore those
    three: ``average`` steps with :data:`AVERAGE_STEP` for any number of contributors,
    ``tuned`` takes both from the number of live contributors (:func:`tuned_step`). ``None`` is
    a preset not yet decided (a config that leaves it unset); the coordinator resolves it when
    it stores the run (``crossfed.coordinator.runspec.resolve_unset``), and no step runs with
    it.
    """

    eta: float = 0.7
    beta: float = 0.9
    solo_full_step: bool = True
    preset: Preset | None = "paper"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.eta) and self.eta > 0):
            raise ValueError(f"outer eta must be a positive finite number, got {self.eta!r}")
        if not (math.isfinite(self.beta) and 0 <= self.beta < 1):
            raise ValueError(f"outer beta must lie in [0, 1), got {self.beta!r}")
        if self.preset is not None and self.preset not in PRESET_NAMES:
            names = ", ".join(repr(n) for n in PRESET_NAMES)
            raise ValueError(f"outer preset must be one of {names}, got {self.preset!r}")

    def step_for(self, shares: Sequence[float]) -> tuple[float, float]:
        """``(eta, beta)`` of a round whose live contributors have token ``shares``."""
        if self.preset is None:
            raise ValueError("outer preset is not resolved (None): resolve it before a merge")
        if self.preset == "average":
            return AVERAGE_STEP
        if self.preset == "tuned":
            return tuned_step(shares)
        solo = len(shares) == 1 and self.solo_full_step
        return (1.0 if solo else self.eta), self.beta


def effective_sites(shares: Sequence[float]) -> float:
    """``1 / Σ p_i²``: the number of equal contributors with the same spread of shares."""
    return 1.0 / sum(p * p for p in shares)


#: the ``average`` preset's ``(eta, beta)``: the new global model is the token-weighted mean
#: of the site models, whatever H and however many sites are live. It is the step that did
#: best at the workflow's H=25 and the paper's H=100 of those measured (docs: Quality).
AVERAGE_STEP: tuple[float, float] = (1.0, 0.0)

#: the ``tuned`` preset's outer rate for one contributor and its momentum (docs/quality.md)
TUNED_SOLO_ETA = 1.0
TUNED_BETA = 0.0


def tuned_step(shares: Sequence[float]) -> tuple[float, float]:
    """The ``tuned`` preset's ``(eta, beta)``: ``eta = TUNED_SOLO_ETA / sqrt(M)`` with
    ``M = effective_sites(shares)``, and no momentum.

    A lone site's delta is adopted as it is (its run continues as if never interrupted);
    several sites' mean delta is damped by their number. The measurements behind it are
    docs/quality.md's tables (``bench/quality.py``).
    """
    return TUNED_SOLO_ETA / math.sqrt(effective_sites(shares)), TUNED_BETA


#: named outer-step settings for the benchmarks; ``paper`` is DiLoCo's (arXiv 2311.08105)
PRESETS: dict[str, OuterConfig] = {
    "paper": OuterConfig(eta=0.7, beta=0.9, solo_full_step=True, preset="paper"),
    "tuned": OuterConfig(preset="tuned"),
    "average": OuterConfig(preset="average"),
}
