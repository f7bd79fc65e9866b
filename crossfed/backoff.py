"""One rule for every wait and retry loop: a delay that grows from ``first_s`` by ``factor``
up to ``cap_s`` (jittered to 0.5-1.5x where many clients retry at once), within an optional
budget that progress restarts.

A loop tries, and on a miss calls ``wait()``; ``False`` means the budget is spent (the loop
gives up, naming what it waited for); the last sleep ends at the budget's end, for a last
try. ``reset()`` after progress: the next delay is the first again and the budget starts
over. ``relax()`` after a miss that spaced itself (a request held, then cut, as a long poll
behind a proxy that ends connections is): the next delay is the first again; the budget
runs on."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Growing delays between tries, within ``budget_s`` (None: no end) since the last reset."""

    first_s: float
    cap_s: float
    factor: float = 2.0
    jitter: bool = False
    budget_s: float | None = None
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    delay_s: float = field(init=False)
    deadline: float | None = field(init=False)

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.cap_s or self.factor < 1:
            raise ValueError(
                f"backoff needs 0 < first_s <= cap_s and factor >= 1, got first_s "
                f"{self.first_s}, cap_s {self.cap_s}, factor {self.factor}"
            )
        self.reset()

    def reset(self) -> None:
        """Progress was made: start again from the first delay and a whole budget."""
        self.delay_s = self.first_s
        self.deadline = None if self.budget_s is None else self.clock() + self.budget_s

    def relax(self) -> None:
        """The last try spaced itself (the caller judges how long is enough): the next delay
        is the first again (the budget is not restarted: no progress was made)."""
        self.delay_s = self.first_s

    def expired(self) -> bool:
        """Whether the budget is spent (never without one)."""
        return self.deadline is not None and self.clock() >= self.deadline

    def wait(self) -> bool:
        """Sleep the next delay (no further than the budget's end, for a last try there) and
        grow it; False, without sleeping, once the budget is spent."""
        if self.expired():
            return False
        delay = self.delay_s * (0.5 + random.random()) if self.jitter else self.delay_s
        if self.deadline is not None:
            delay = min(delay, self.deadline - self.clock())
        self.sleep(delay)
        self.delay_s = min(self.delay_s * self.factor, self.cap_s)
        return True
