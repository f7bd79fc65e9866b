"""What the launcher told this process, read from its environment alone (no torch import)."""

from __future__ import annotations

import os


def under_torchrun() -> bool:
    """True inside a process started by torchrun (it sets the rendezvous variables)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ
    )


def talks_to_coordinator(launcher: str) -> bool:
    """Whether this process is, or becomes, the rank that talks to the coordinator (rank 0):
    under torchrun its rank 0; outside it, a process whose ``launcher`` is not torchrun (one
    whose launcher is relaunches itself as the ranks and only waits for them)."""
    if under_torchrun():
        return os.environ.get("RANK", "0") == "0"
    return launcher != "torchrun"
