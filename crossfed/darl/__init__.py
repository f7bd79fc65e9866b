"""DARL: distributed allocation and remote leasing of pre-tokenised data blocks."""

from crossfed.darl.blockspace import BlockSpace, BlockSpaceError
from crossfed.darl.leases import (
    CommitResult,
    Lease,
    LeaseBook,
    LeaseError,
    LeaseSizingError,
    SiteStats,
    lease_blocks,
    lease_ttl,
    proportional_grant,
)
from crossfed.darl.ledger import DuplicateCommitError, LedgerError, LedgerStore, apply_event

__all__ = [
    "BlockSpace",
    "BlockSpaceError",
    "CommitResult",
    "DuplicateCommitError",
    "Lease",
    "LeaseBook",
    "LeaseError",
    "LeaseSizingError",
    "LedgerError",
    "LedgerStore",
    "SiteStats",
    "apply_event",
    "lease_blocks",
    "lease_ttl",
    "proportional_grant",
]
