"""One delta as its site claims it, the same record at every hop.

A site builds it from its pending delta, its client sends its fields (the round travels in
the request's path), the coordinator's app rebuilds it from the request, vets it against its
lease and records it as the delta's row. Dataclasses only: both sides import it.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class DeltaClaim:
    """A delta of ``round_no`` trained on lease ``lease_id`` from ``generation``, in ``blob``."""

    site: str
    round_no: int
    lease_id: int
    generation: int  # the global model it was trained from
    tokens: int  # its weight in the merge
    steps: int  # inner steps: they move the global step
    consumed: int  # the lease's blocks trained completely (committed with it)
    blob: str  # the delta file's digest, ``algo:hex``
    loss: float | None = None
    compute_s: float | None = None
    #: seconds the lease was held waiting for a merge (overlapped rounds): not pace
    idle_s: float | None = None

    def sent(self) -> dict[str, Any]:
        """What a request carries besides the round (in its path) and the blob (the body's
        ``blob``, the inline body's digest header)."""
        return {k: v for k, v in asdict(self).items() if k not in ("round_no", "blob")}

    def row(self) -> dict[str, Any]:
        """The delta's row in the coordinator's ``deltas`` table (without its time)."""
        return {k: v for k, v in asdict(self).items() if k != "idle_s"}

    def repeats(self, row: dict[str, Any]) -> bool:
        """Whether this is the accepted ``row`` sent again: a resend after a crash repeats
        every field a claim must carry exactly."""
        return all(getattr(self, k) == row[k] for k in RESEND_FIELDS)


#: the fields a resent claim must repeat exactly (those without a default)
RESEND_FIELDS = tuple(f.name for f in fields(DeltaClaim) if f.default is MISSING)
