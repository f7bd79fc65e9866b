"""Overlapped rounds: how a site folds the merged model into weights it kept training.

With overlap on, a site that ends round r's inner phase sends its delta (measured against
generation g, the model it started from) and at once trains its round r+1 lease from its own
weights. When the merged model of round r (generation g+1) arrives, some steps later, the
site folds it in at a step boundary; from then on its weights descend from generation g+1,
and the delta it sends for round r+1 is measured against g+1, so the coordinator's Eq. 1
stays exact for what it merges.

Two published rules, with ``theta`` the site's weights when the merged model arrives,
``sent`` its weights when it sent round r's delta, and ``merged`` generation g+1:

* ``rebase`` (the default; the delayed outer update of "Eager updates for overlapped
  communication and computation in DiLoCo", Kale et al. 2025, arXiv 2502.12996, without
  their eager local term): ``theta <- merged + (theta - sent)``. The site keeps every step
  it took during the overlap and swaps its base from its own round-r weights to the merged
  ones, exactly as if it had waited for the merge and then taken those steps from it.
  ``stale_weight`` (default 1) scales what it keeps: ``theta <- merged + stale_weight *
  (theta - sent)``; 0 drops those steps' update (the merged model as it is; their gradients
  live on only in the AdamW moments), which the quality benchmark measures better at H=25
  and worse at H=100 (docs: Quality, "Stale steps kept at a weight").
* ``mix`` (Streaming DiLoCo's overlapped outer sync, Douillard et al. 2025, arXiv
  2501.18512, mixing weight ``alpha``, 0.5 there): ``theta <- alpha * theta +
  (1 - alpha) * merged``.

A phase takes at most ``max_stale`` of its steps (default a quarter) before the fold-in; if
the merged model has not arrived by then it waits for it there, so the staleness of the
steps is bounded (the quality benchmark measures a fold after half a phase at 1.0% above
plain rounds, against 3.8% for one at its end). The bound holds on the mean, not every phase:
what earlier phases left unused of their ``max_stale`` (they folded in sooner) accrues, up
to ``stale_burst``, and a phase whose merge is late spends it before it waits
(:class:`StaleBudget`). A merge held up once (a site killed and restarted, a stalled
upload) is then trained through instead of idled through, while a merge late every round
(a long link) still folds at ``max_stale``.

Pure: tensors in, tensors out; the runner applies the result to its model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import torch

RULES = ("rebase", "mix")


class OverlapConfigError(ValueError):
    """An overlap setting that does not name a valid rule."""


@dataclass(frozen=True)
class OverlapConfig:
    """Whether a site trains its next lease while its delta is merged, and the fold-in rule."""

    enabled: bool = False
    rule: str = "rebase"
    #: the site's weight in the ``mix`` rule (Streaming DiLoCo's alpha)
    alpha: float = 0.5
    #: the share of a phase's steps it may take before the merged model is folded in; past
    #: it the phase waits for the merge (1: the whole phase, folding at its end)
    max_stale: float = 0.25
    #: how much further than ``max_stale`` (a share of the phase) a phase may go before the
    #: fold-in on the share earlier phases left unused; 0: every phase waits at max_stale
    stale_burst: float = 0.75
    #: ``rebase``: the weight the fold-in keeps the steps taken before it with (1: whole)
    stale_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise OverlapConfigError(
                f"overlap.rule must be one of {', '.join(RULES)}, got {self.rule!r}"
            )
        if not 0.0 <= self.alpha <= 1.0:
            raise OverlapConfigError(f"overlap.alpha must be in [0, 1], got {self.alpha}")
        if not 0.0 < self.max_stale <= 1.0:
            raise OverlapConfigError(f"overlap.max_stale must be in (0, 1], got {self.max_stale}")
        if not 0.0 <= self.stale_burst <= 1.0:
            raise OverlapConfigError(
                f"overlap.stale_burst must be in [0, 1], got {self.stale_burst}"
            )
        if not 0.0 <= self.stale_weight <= 1.0:
            raise OverlapConfigError(
                f"overlap.stale_weight must be in [0, 1], got {self.stale_weight}"
            )

    @classmethod
    def of(cls, raw: Mapping[str, object] | bool | None) -> OverlapConfig:
        """From the workflow config's ``overlap`` value: a bool or a mapping."""
        if raw is None:
            return cls()
        if isinstance(raw, bool):
            return cls(enabled=raw)
        if not isinstance(raw, Mapping):
            raise OverlapConfigError(f"overlap must be true, false or a mapping, got {raw!r}")
        defaults = {f.name: f.default for f in fields(cls)}
        unknown = sorted(set(raw) - set(defaults))
        if unknown:
            raise OverlapConfigError(f"unknown overlap setting(s): {', '.join(unknown)}")
        enabled = raw.get("enabled", True)
        if not isinstance(enabled, bool):
            raise OverlapConfigError(f"overlap.enabled must be true or false, got {enabled!r}")
        numbers = {}
        for key in ("alpha", "max_stale", "stale_burst", "stale_weight"):
            value = raw.get(key, defaults[key])
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise OverlapConfigError(f"overlap.{key} must be a number, got {value!r}")
            numbers[key] = float(value)
        return cls(enabled=enabled, rule=str(raw.get("rule", "rebase")), **numbers)


@dataclass
class StaleBudget:
    """How far into a phase a site may train before it waits for the merged model.

    A token bucket of phase shares: every phase earns ``max_stale`` and spends the share of
    its steps it took before the fold-in (0 for one that started from the merged model);
    what is left accrues up to ``burst``. A phase may go ``max_stale`` plus what has accrued
    (at most the whole phase) before it waits. Over any n phases the steps taken before
    their fold-ins are then at most ``n * max_stale + burst`` phases' worth: the bound
    ``max_stale`` sets holds on the mean, and a merge late every round folds at
    ``max_stale`` as with no burst at all. A job starts with the bucket full.
    """

    max_stale: float
    burst: float
    credit: float = field(init=False)  # the share accrued

    def __post_init__(self) -> None:
        self.credit = self.burst

    def allowed(self) -> float:
        """The share of the next phase's steps it may take before the fold-in."""
        return min(1.0, self.max_stale + self.credit)

    def spend(self, share: float) -> None:
        """A phase took ``share`` of its steps before its fold-in (0 for none)."""
        self.credit = min(self.burst, max(0.0, self.credit + self.max_stale - share))


@torch.no_grad()
def fold_in(
    theta: Mapping[str, torch.Tensor],
    sent: Mapping[str, torch.Tensor],
    merged: Mapping[str, torch.Tensor],
    config: OverlapConfig,
) -> dict[str, torch.Tensor]:
    """The site's weights after the merged model is folded in (new tensors, float32 math,
    each in ``theta``'s dtype). Every mapping holds the same names and shapes."""
    if set(theta) != set(merged) or (config.rule == "rebase" and set(theta) != set(sent)):
        missing = sorted(set(theta) ^ set(merged) | (set(theta) ^ set(sent)))
        raise ValueError(f"fold-in over different tensors: {missing[:5]}")
    out = {}
    for name, now in theta.items():
        base = merged[name].to(torch.float32)
        if config.rule == "rebase":
            stale = now.to(torch.float32) - sent[name].to(torch.float32)
            value = base + config.stale_weight * stale  # x 1.0 is exact: weight 1 is rebase
        else:
            value = base.lerp(now.to(torch.float32), config.alpha)
        out[name] = value.to(now.dtype)
    return out


#: merge waits worth a word: at least this many seconds and this share of the phase's
#: compute, in this many rounds in a row (one long wait is a slow site, not the link)
LONG_WAIT_S = 1.0
LONG_WAIT_SHARE = 0.1
LONG_WAIT_ROUNDS = 2


@dataclass
class MergeWaits:
    """Whether a site keeps waiting for the merged model at its fold-in: the round trip of
    the weights (the slowest site's delta up, the merge, the model down) takes longer than
    the ``max_stale`` share of a phase the site trains ahead. Says so once a job."""

    max_stale: float
    in_a_row: int = 0
    said: bool = False

    def advice(self, wait_s: float, compute_s: float) -> str | None:
        """After a phase that waited ``wait_s`` and computed ``compute_s``: what to tell the
        user, the first time the waits are long in ``LONG_WAIT_ROUNDS`` rounds in a row."""
        long = wait_s > 0 and wait_s >= LONG_WAIT_S and wait_s >= LONG_WAIT_SHARE * compute_s
        self.in_a_row = self.in_a_row + 1 if long else 0
        if self.said or self.in_a_row < LONG_WAIT_ROUNDS:
            return None
        self.said = True
        share = f"{wait_s / compute_s:.0%} of" if compute_s > 0 else "beside"
        return (
            f"waited {wait_s:.1f}s for the merged model ({share} the phase's compute), "
            f"{self.in_a_row} rounds in a row: the round trip of the weights takes longer than "
            f"the {self.max_stale:.0%} of a phase trained before the fold-in. Longer phases "
            "(inner.steps, a site's accumulation) or a later fold-in (overlap.max_stale) hide "
            "it; see 'Phases long enough for the link' in docs/wan.md"
        )
