"""A site: the loop its jobs run, round after round, and what that loop writes down.

``records`` (settings and the typed records of a round), ``control`` (rank 0's traffic with
the coordinator, behind one seam), ``runner`` (one round: prepare, train, checkpoint, send),
``loop`` (rounds back to back, torch-free), ``slurm`` (the allocation and its nodes), ``job``
(one site job from the config), ``lock`` (one job per site folder).

The names below load their module on first use, so ``crossfed.site.loop`` (which the
workflow imports when it is read) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Heartbeat": "crossfed.site.control",
    "RoundOutcome": "crossfed.site.records",
    "SiteSettings": "crossfed.site.records",
    "outcome_json": "crossfed.site.records",
    "SiteRunner": "crossfed.site.runner",
    "block_end": "crossfed.site.runner",
    "out_of_time": "crossfed.site.runner",
    "site_settings": "crossfed.site.job",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'crossfed.site' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
