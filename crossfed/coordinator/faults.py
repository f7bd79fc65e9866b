"""Fault injection for durability tests: the coordinator SIGKILLs itself at a named point.

Set ``CROSSFED_CRASH_AT`` to one of ``POINTS`` in the coordinator's environment; unset (the
normal case) every :func:`crash_point` is a no-op.
"""

from __future__ import annotations

import os
import signal

ENV = "CROSSFED_CRASH_AT"
POINTS = frozenset(
    {
        "after_upload_part",  # a blob part is on disk (fsynced), before its reply
        "inside_generation_write",  # half of generation g+1's tensors are in its temp files
        "after_generation_write",  # generation g+1's files are written, not yet committed
        "after_close_commit",  # the round is closed and committed, before retention
    }
)


def crash_point(name: str) -> None:
    """SIGKILL this process if ``CROSSFED_CRASH_AT`` names ``name``."""
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}")
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
