"""Fault injection for durability tests: a process SIGKILLs itself at a named point.

Set ``CROSSFED_CRASH_AT`` to one of ``POINTS`` in the coordinator's (or a site job's)
environment, or to ``<point>@<scope>`` to arm it for one scope only (a site point's scope is
``<site>:<round>``); unset (the normal case) every :func:`crash_point` is a no-op. With
``CROSSFED_CRASH_ONCE`` set to a path, the point fires once per rank: the first crash creates
``<path>.<rank>`` and a retried job runs through.
"""

from __future__ import annotations

import os
import signal

ENV = "CROSSFED_CRASH_AT"
ONCE_ENV = "CROSSFED_CRASH_ONCE"
POINTS = frozenset(
    {
        "after_upload_part",  # a blob part is on disk (fsynced), before its reply
        "inside_generation_write",  # half of generation g+1's tensors are in its temp files
        "after_generation_write",  # generation g+1's files are written, not yet committed
        "after_close_commit",  # the round is closed and committed, before retention
        "site_after_step",  # a site job has finished an inner step of its phase (every rank)
        "site_mid_upload",  # overlap: round r's delta is being sent while r+1 trains (rank 0)
        "site_after_send",  # overlap: round r's delta accepted, its record not yet written
        "site_mid_fold",  # overlap: the merged model is half folded into the weights
        "site_awaiting_merge",  # overlap: an early phase waits for the merge, checkpointed
    }
)


def crash_armed(name: str) -> bool:
    """Whether ``CROSSFED_CRASH_AT`` names the point ``name`` (for any scope)."""
    return os.environ.get(ENV, "").split("@")[0] == name


def crash_point(name: str, scope: str | None = None) -> None:
    """SIGKILL this process if ``CROSSFED_CRASH_AT`` names ``name`` (or ``name@scope``)."""
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}")
    armed = os.environ.get(ENV)
    if armed != name and (scope is None or armed != f"{name}@{scope}"):
        return
    once = os.environ.get(ONCE_ENV)
    if once:
        try:  # the marker first: a crash that has happened never happens again
            os.close(os.open(f"{once}.{os.environ.get('RANK', '0')}", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
    os.kill(os.getpid(), signal.SIGKILL)
