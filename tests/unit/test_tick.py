"""The coordinator's ticker: a failing tick is retried with backoff and logged once, not at
every tick (the object store down mid-merge used to log a traceback four times a second)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from crossfed.coordinator.app import tick_until

TICK_S = 0.02
FAILURES = 6  # the last wait: 0.02 s x 2^6 = 1.28 s, under the 2 s cap


def test_a_failing_tick_backs_off_logs_once_and_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[float] = []
    recovered = threading.Event()

    def tick() -> None:
        calls.append(time.monotonic())
        if len(calls) <= FAILURES:
            raise ConnectionError("store unreachable")
        if len(calls) >= FAILURES + 3:
            recovered.set()

    stop = threading.Event()
    caplog.set_level(logging.INFO, logger="crossfed")
    thread = threading.Thread(target=tick_until, args=(tick, stop, TICK_S))
    thread.start()
    try:
        assert recovered.wait(30)
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()

    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    # the waits after each failure double from tick_s (a wait never ends early; a busy
    # machine only makes it longer); after a success, ticks come every tick_s again
    for k, gap in enumerate(gaps[:FAILURES]):
        assert gap >= TICK_S * 2 ** (k + 1) * 0.99, (k, gaps)
    assert TICK_S * 0.99 <= gaps[FAILURES] < gaps[FAILURES - 1] / 2, gaps
    failures = [r for r in caplog.records if "tick failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
    again = [r for r in caplog.records if "succeeds again" in r.getMessage()]
    assert len(again) == 1 and "store unreachable" in again[0].getMessage()


def test_ticks_stop_when_asked_even_while_failing() -> None:
    stop = threading.Event()

    def tick() -> None:
        raise RuntimeError("always")

    thread = threading.Thread(target=tick_until, args=(tick, stop, 0.01))
    thread.start()
    time.sleep(0.2)
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
