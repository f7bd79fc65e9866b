"""What every transfer of blobs and models shares, to the coordinator or to an object store:
refusals, the statuses worth retrying, the progress budget, byte spans and positional writes."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from crossfed.backoff import Backoff
from crossfed.fileio import create_temp_beside, replace_durably
from crossfed.wire.digests import digest_file, parse_digest

#: answers worth sending again: the coordinator (or a proxy before it) is away or busy, or
#: its disk is full (507, nothing kept)
RETRY_STATUS = {502, 503, 504, 507}
#: fresh uploads after a digest mismatch before giving up
MISMATCH_RETRIES = 3
#: spans start on multiples of this
SPAN_ALIGN = 64 << 10


class Refused(Exception):
    """The coordinator refused a request (4xx); ``code`` is its stable error word."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


class Unreachable(Exception):
    """The coordinator did not answer within the retry budget."""


class IntegrityError(Exception):
    """Bytes did not match their digest."""


class Progress:
    """Retry budget that restarts whenever a transfer makes progress, with backoff."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.backoff = Backoff(0.2, 5.0, jitter=True, budget_s=budget_s)

    def advanced(self) -> None:
        self.backoff.reset()

    def wait(self, sleep: Callable[[float], None], what: str, error: Exception) -> None:
        self.backoff.sleep = sleep
        if not self.backoff.wait():
            raise Unreachable(f"{what} made no progress for {self.budget_s}s: {error}") from error


def split_spans(size: int, n: int) -> list[tuple[int, int]]:
    """``[start, end)`` of ``n`` contiguous spans covering ``size`` bytes, as even as whole
    ``SPAN_ALIGN`` blocks allow (the last takes the rest)."""
    blocks = -(-size // SPAN_ALIGN)
    n = max(1, min(n, blocks))
    bounds = [min(size, (blocks * i // n) * SPAN_ALIGN) for i in range(n)] + [size]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


def write_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (pwrite may write less)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def fetch_spans(
    dest: Path,
    size: int,
    digest: str,
    n_spans: int,
    fetch: Callable[[int, int, tuple[int, int]], None],
    what: str,
) -> Path:
    """``dest`` from ``size`` bytes fetched as ``n_spans`` byte spans in parallel, each by
    ``fetch(i, fd, span)`` writing at its offsets into one temporary file beside ``dest``;
    the whole is digest-checked, then published atomically (nothing is left on failure)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = create_temp_beside(dest, suffix=".part", mode=0o644)
    spans = split_spans(size, n_spans)
    try:
        os.ftruncate(fd, size)
        with ThreadPoolExecutor(len(spans), thread_name_prefix="crossfed-download") as pool:
            list(pool.map(lambda i: fetch(i, fd, spans[i]), range(len(spans))))
        os.fsync(fd)
        if digest_file(tmp, parse_digest(digest)[0]) != digest:
            raise IntegrityError(f"{what}: the bytes received do not match {digest}")
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    replace_durably(tmp, dest)
    return dest
