"""crossfed.backoff: the one rule every wait and retry loop follows, on a simulated clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossfed.backoff import Backoff


class Clock:
    """Simulated time: sleeping moves it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def backoff(clock: Clock, **kwargs) -> Backoff:
    return Backoff(sleep=clock.sleep, clock=clock, **kwargs)


def test_delays_grow_by_the_factor_up_to_the_cap() -> None:
    clock = Clock()
    b = backoff(clock, first_s=0.2, cap_s=2.0, factor=1.5)
    for _ in range(9):
        assert b.wait()
    assert clock.slept == pytest.approx([0.2, 0.3, 0.45, 0.675, 1.0125, 1.51875, 2.0, 2.0, 2.0])


@given(
    first=st.floats(0.01, 5),
    ratio=st.floats(1, 20),
    factor=st.floats(1, 3),
    budget=st.floats(0, 120),
    jitter=st.booleans(),
)
def test_the_sleeps_end_at_the_budget_for_a_last_try_and_then_it_gives_up(
    first: float, ratio: float, factor: float, budget: float, jitter: bool
) -> None:
    clock = Clock()
    b = backoff(clock, first_s=first, cap_s=first * ratio, factor=factor, jitter=jitter,
                budget_s=budget)  # fmt: skip
    start = clock.now
    tries = 0
    while b.wait():
        tries += 1
        assert tries < 100_000
    assert clock.now - start == pytest.approx(budget)  # the last sleep ended at the budget's end
    assert b.expired() and not b.wait()  # and it stays given up
    low, high = (0.5, 1.5) if jitter else (1.0, 1.0)
    delay = first
    for s in clock.slept[:-1]:  # each sleep but the clamped last
        assert low * delay * (1 - 1e-9) <= s <= high * delay * (1 + 1e-9)
        delay = min(delay * factor, first * ratio)


def test_progress_restarts_the_delay_and_the_budget() -> None:
    clock = Clock()
    b = backoff(clock, first_s=1.0, cap_s=4.0, budget_s=6.0)
    assert b.wait() and b.wait()  # 1 + 2 s
    assert not b.expired()
    assert b.wait()  # 4 more would end at 7 s: it sleeps to the budget's end, 6 s
    assert b.expired() and not b.wait()
    b.reset()
    assert not b.expired() and b.wait()
    assert clock.slept == [1.0, 2.0, 3.0, 1.0]


def test_a_try_that_took_its_delay_by_itself_relaxes_the_delay_not_the_budget() -> None:
    clock = Clock()
    b = backoff(clock, first_s=1.0, cap_s=8.0, budget_s=10.0)
    assert b.wait() and b.wait() and b.wait()  # 1 + 2 + 4 s
    b.relax()  # the next try was held for 8 s or more before it failed
    clock.now += 1.5  # (say the budget's clock ran on meanwhile)
    assert b.wait()  # the first delay again, not 8 s
    assert clock.slept == [1.0, 2.0, 4.0, 1.0]
    assert b.wait() and clock.slept[-1] == pytest.approx(0.5)  # to the budget's end: 10 s
    assert b.expired() and not b.wait()  # the budget was not restarted


def test_without_a_budget_it_never_gives_up() -> None:
    clock = Clock()
    b = backoff(clock, first_s=5, cap_s=5)
    assert all(b.wait() for _ in range(1000)) and not b.expired()
    assert clock.now == pytest.approx(100 + 5000)


@pytest.mark.parametrize(
    "kwargs",
    [dict(first_s=0, cap_s=1), dict(first_s=2, cap_s=1), dict(first_s=1, cap_s=2, factor=0.5)],
)
def test_a_backoff_that_cannot_wait_is_refused_naming_its_numbers(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="first_s .* cap_s .* factor"):
        Backoff(**kwargs)
