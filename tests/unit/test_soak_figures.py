"""The soak's figures read from the coordinator's log (bench/soak.py): a coordinator killed in
the middle of a line leaves it unfinished, and the next life's first line follows it."""

from __future__ import annotations

from pathlib import Path

from bench.soak import http_5xx


def test_a_log_line_cut_by_a_kill_still_counts_its_status_and_nothing_else(
    tmp_path: Path,
) -> None:
    """The line a SIGKILL cut after "status=507" runs into the restarted coordinator's
    "00:09:58 ..." line: that is a 507, not a status of 50700 (which the soak counted as an
    unexpected 5xx and failed a CI run for)."""
    log = tmp_path / "coordinator.log"
    log.write_text(
        "00:09:53 ERROR crossfed.http: http_5xx status=507 POST /v1/leases\n"
        "00:09:54 ERROR crossfed.http: http_5xx status=507"
        "00:09:58 WARNING crossfed.coordinator: lease 18 of snellius expired\n"
        "00:10:02 ERROR crossfed.http: http_5xx status=503 GET /v1/status\n"
    )
    assert http_5xx(log) == {507: 2, 503: 1}
    assert http_5xx(tmp_path / "none.log") == {}
