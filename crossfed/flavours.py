"""The model flavours crossfed trains, by name, without importing torch or torchtitan.

Reading a config or a run spec checks the flavour here, so a typo is refused before any job
starts. ``crossfed.train.model.flavour_names`` builds the same list from torchtitan's registry;
tests/unit/test_config.py keeps the two equal.
"""

from __future__ import annotations

import difflib

#: crossfed's CPU flavours, then torchtitan's dense Qwen3 flavours (MoE ones are refused)
FLAVOURS: tuple[str, ...] = (
    "small",
    "tiny",
    "0.6B",
    "1.7B",
    "14B",
    "32B",
    "4B",
    "8B",
    "debugmodel",
    "debugmodel_non_fused_qkv",
)


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice (case-insensitive), or ``''``."""
    by_folded = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(by_folded), n=1, cutoff=0.6)
    return f" (did you mean {by_folded[close[0]]!r}?)" if close else ""


def flavour_error(flavour: object) -> str | None:
    """Why ``flavour`` is not one crossfed trains, naming the allowed ones; None if it is."""
    if isinstance(flavour, str) and flavour in FLAVOURS:
        return None
    hint = did_you_mean(flavour, FLAVOURS) if isinstance(flavour, str) else ""
    return f"unknown model flavour {flavour!r}{hint}; crossfed trains {', '.join(FLAVOURS)}"
