"""The coordinator's logic: rounds, DARL leases and the merge, wired to SQLite and disk.

HTTP lives in ``app.py``; this class never sees a request. ``Coordinator`` is the face of
parts split by verb over one core (``core.py``: its state, the lock, one SQLite transaction
per change): ``leasing.py`` (register, lease, heartbeat, release), ``intake.py`` (a delta's
claim vetted and committed), ``closing.py`` (generations, the round's close, merge, publish and
retention) and ``views.py`` (status, rounds, sites, the ledger).
"""

from __future__ import annotations

from crossfed.coordinator.claims import RESEND_FIELDS, DeltaClaim
from crossfed.coordinator.closing import Closing
from crossfed.coordinator.core import MERGE_HOLDS_LOCK_ENV, CoordinatorError, lease_errors
from crossfed.coordinator.intake import Intake, claim_windows
from crossfed.coordinator.leasing import Leasing
from crossfed.coordinator.views import read_ledger, read_status

__all__ = [
    "MERGE_HOLDS_LOCK_ENV",
    "RESEND_FIELDS",
    "Coordinator",
    "CoordinatorError",
    "DeltaClaim",
    "claim_windows",
    "lease_errors",
    "read_ledger",
    "read_status",
]


class Coordinator(Leasing, Intake, Closing):
    """State of one run: global model, momentum, rounds and the DARL ledger."""
