"""The site loop: the coordinator's current round, then the next, back to back.

A site job (the local profile's one job for the run, or one Slurm allocation of a chain)
trains the coordinator's current round, waits for the round to close, trains the next one,
and so on up to the run's last round. It never starts a round it could not finish before
the allocation ends: the time a round takes is estimated from the rounds already timed (in
this job or, from the per-round records, in earlier jobs of the site), and the next round
starts only if it fits with ``margin_s`` to spare. The workflow then submits the next job
of the chain, which continues from whatever round is current by then. A job that dies
anyway (walltime, node failure, ``scancel``) loses at most its one in-flight lease: the
lease's TTL returns its blocks to the pool, and the retried job carries on.

Pure: ``next_action`` and the estimates take ``now``; ``run_chain`` wires them to a site
runner and a coordinator client. Torch-free (the workflow imports it when it is read).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from crossfed.backoff import Backoff
from crossfed.progress import site_prefix

#: statuses of run_round after which the site's part of that round is over
_TRAINED = "accepted"
#: run_round's status when the delta's send goes on in the background (overlapped rounds)
_SENDING = "sending"


class ChainError(ValueError):
    """Settings or Slurm answers a site loop cannot work with."""


# ----------------------------------------------------------------------------- estimates


def estimate_round_s(
    durations: Sequence[float], prior_s: float | None, *, recent: int = 3, safety: float = 1.25
) -> float | None:
    """How long the next round will take: the slowest of the last ``recent`` timed rounds
    (or the prior when none was timed yet), times ``safety``. None when nothing is known."""
    timed = [d for d in durations if d > 0 and math.isfinite(d)]
    if timed:
        return max(timed[-recent:]) * safety
    if prior_s is not None and prior_s > 0:
        return prior_s * safety
    return None


def round_prior_s(
    tokens_per_round: float, tokens_per_s: float | None, overhead_s: float = 30.0
) -> float | None:
    """A first guess of one round's duration from the planner's throughput for the site."""
    if not tokens_per_s or tokens_per_s <= 0 or tokens_per_round <= 0:
        return None
    return tokens_per_round / tokens_per_s + overhead_s


def fits(now: float, deadline: float | None, estimate_s: float | None, margin_s: float) -> bool:
    """Whether a round started ``now`` ends ``margin_s`` before the deadline."""
    if deadline is None:
        return True
    return now + (estimate_s or 0.0) + margin_s <= deadline


# ----------------------------------------------------------------------------- the loop


class RoundRunner(Protocol):
    """What the chain needs of a site runner (crossfed.site.SiteRunner).

    With overlapped rounds (``overlapped``) ``run_round`` returns while the delta is still
    being sent (status "sending"); while that round is ``in_flight`` the chain starts the
    next one at once. ``settled()`` hands over the outcomes of such rounds once their sends
    are answered, and ``finish()`` waits for the last one. A runner may also say, with
    ``leased_ahead()``, the round of an early lease it has already been granted: the chain
    then starts that round without asking the coordinator's status.
    """

    overlapped: bool
    in_flight: bool

    def run_round(self, round_no: int, accumulation: int | None = None) -> Any: ...

    def settled(self) -> list[Any]: ...

    def finish(self) -> list[Any]: ...


class StatusSource(Protocol):
    """What the chain needs of a coordinator client."""

    def status(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ChainSettings:
    """When a chain job stops."""

    through_round: int  # the run's last round
    deadline: float | None = None  # epoch seconds the allocation ends; None: no limit
    margin_s: float = 60.0
    prior_s: float | None = None  # round-time guess before any round was timed
    history_s: tuple[float, ...] = ()  # round durations from earlier jobs of the site
    poll_s: float = 0.5  # first wait between status polls (doubles up to max_poll_s)
    max_poll_s: float = 2.0

    def __post_init__(self) -> None:
        if self.through_round < 1:
            raise ChainError(f"through_round must be >= 1, got {self.through_round}")
        if self.margin_s < 0 or self.poll_s <= 0 or self.max_poll_s < self.poll_s:
            raise ChainError(f"bad chain timings: {self}")


@dataclass
class ChainRecord:
    """One round a chain job took part in."""

    round: int
    status: str
    round_s: float
    detail: str = ""
    compute_s: float = 0.0
    merge_wait_s: float = 0.0


@dataclass
class ChainOutcome:
    """What one chain job did (the train job's JSON output)."""

    site: str
    stopped: str  # run_complete | walltime | too_short | not_planned
    rounds: list[ChainRecord] = field(default_factory=list)
    first_round: int | None = None  # the coordinator's round when the job started
    next_round: int | None = None  # the coordinator's round when it stopped
    started_at: float = 0.0
    ended_at: float = 0.0
    deadline: float | None = None
    estimate_s: float | None = None
    slurm_job_id: str | None = None
    detail: str = ""

    @property
    def trained(self) -> int:
        return sum(1 for r in self.rounds if r.status == _TRAINED)

    @property
    def compute_s(self) -> float:
        """Seconds of inner steps whose delta was accepted (goodput's numerator)."""
        return sum(r.compute_s for r in self.rounds if r.status == _TRAINED)

    @property
    def progressed(self) -> bool:
        """Trained a round, or saw the run move on while it held the allocation."""
        moved = (self.next_round or 0) > (self.first_round or 0)
        return self.trained > 0 or moved

    @property
    def next_job(self) -> bool:
        """Whether the workflow should submit the chain's next job."""
        return self.stopped == "walltime" and self.progressed

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "trained": self.trained,
            "compute_s": self.compute_s,
            "progressed": self.progressed,
            "next_job": self.next_job,
        }


def chain_continues(outcome: Mapping[str, Any], rounds: int) -> bool:
    """Whether a chain needs a job after this outcome, for a run of ``rounds`` rounds.

    A job that stopped at its walltime with progress hands on; one that completed the run
    as it was then hands on too once the run is extended past the round it reached.
    """
    if outcome["next_job"]:
        return True
    return outcome["stopped"] == "run_complete" and int(outcome["next_round"] or 0) <= rounds


def next_action(
    current: int,
    done: set[int],
    settings: ChainSettings,
    out: ChainOutcome,
    durations: Sequence[float],
    now: float,
    overlap: bool = False,
) -> tuple[str, int]:
    """What a chain does next at the coordinator's round ``current``.

    ``("stop", current)`` when the run is complete or the round would not fit (``out`` then
    says why), ``("wait", current)`` while this site's part of the round is in, else
    ``("train", current)``. With ``overlap`` a site whose part of the open round is in (or
    being sent) trains the next round at once, ``("train", current + 1)``, but never one
    further: it is at most one round ahead. Pure: the caller polls the coordinator and
    keeps the clock.
    """
    if out.first_round is None:
        out.first_round = current
    out.next_round = current
    if current > settings.through_round:
        out.stopped = "run_complete"
        return "stop", current
    estimate = estimate_round_s(durations, settings.prior_s)
    out.estimate_s = estimate
    upcoming = current + 1 if current in done else current  # the round this job would train
    if not fits(now, settings.deadline, estimate, settings.margin_s):
        out.detail = (
            f"round {upcoming} would not end before the walltime (estimate "
            f"{estimate or 0:.0f}s + margin {settings.margin_s:g}s)"
        )
        if not out.progressed:  # no round fits a whole job: the next would do the same
            out.stopped = "too_short"
            assert settings.deadline is not None
            out.detail += (
                f"; the job had {settings.deadline - out.started_at:.0f}s after start-up:"
                " choose a shape with a longer walltime, or a smaller chain.margin_s"
            )
        return "stop", current
    if current in done:  # our part is in; wait for the others and the merge
        ahead = current + 1
        if overlap and ahead <= settings.through_round and ahead not in done:
            return "train", ahead
        return "wait", current
    return "train", current


def run_chain(
    site: str,
    runner: RoundRunner,
    client: StatusSource | None,
    settings: ChainSettings,
    *,
    share: Callable[[Any], Any] = lambda decision: decision,
    on_round: Callable[[Any, float], None] | None = None,
    accumulation_for: Callable[[int], int | None] = lambda _round: None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = lambda _: None,
) -> ChainOutcome:
    """Train rounds back to back until the run is complete or the next one would not fit.

    The process holding the coordinator ``client`` (rank 0 under torchrun) decides; ``share``
    hands its decision to every rank (a broadcast), so all ranks train the same rounds. While
    it waits for a round to close, a decision is shared at least every ``max_poll_s``, which
    keeps the ranks' collectives well inside their timeouts. ``on_round(outcome, seconds)``
    sees every round's outcome as soon as it is known (the CLI writes the per-round record);
    ``accumulation_for(round)`` is the A the plans give the site for that round (None:
    unchanged), read by the deciding process only.
    """
    out = ChainOutcome(site, "walltime", started_at=clock(), deadline=settings.deadline)
    durations = list(settings.history_s)
    done: set[int] = set()
    backoff = Backoff(settings.poll_s, max(settings.poll_s, settings.max_poll_s), sleep=sleep)
    if hasattr(runner, "chained"):
        runner.chained = True  # this loop trains the next round while a delta is sent
        runner.through_round = settings.through_round  # no early lease past it
    overlap = bool(getattr(runner, "overlapped", False))
    sending: dict[int, float] = {}  # rounds whose send runs in the background: their seconds

    def report(outcome: Any, seconds: float) -> None:
        out.rounds.append(
            ChainRecord(
                outcome.round,
                str(outcome.status),
                seconds,
                str(getattr(outcome, "detail", "")),
                float(getattr(outcome, "compute_s", 0.0) or 0.0),
                float(getattr(outcome, "merge_wait_s", 0.0) or 0.0),
            )  # fmt: skip
        )
        if on_round is not None:
            on_round(outcome, seconds)

    def settle(outcomes: list[Any]) -> None:
        for outcome in outcomes:
            report(outcome, sending.pop(outcome.round, 0.0))

    started: dict[int, float] = {}
    if overlap:  # a background send's outcome is recorded the moment it is answered
        runner.on_settled = lambda o: report(o, clock() - started.get(o.round, clock()))

    while True:
        if overlap:
            settle(runner.settled())
            if settings.through_round in done and client is not None:
                # the last round's delta is sent: nothing is left to train, and waiting
                # for its merge would only hold the allocation idle
                out.first_round = out.first_round or settings.through_round
                out.stopped, out.next_round = "run_complete", settings.through_round + 1
                out.detail = f"round {settings.through_round}'s delta is sent"
                share(("stop", out.next_round))
                break
        decision = None
        if client is not None:
            ahead = overlap and bool(getattr(runner, "in_flight", False))
            leased = runner.leased_ahead() if ahead and hasattr(runner, "leased_ahead") else None
            if leased is not None and leased - 1 in done:
                # an early lease of the next round is granted: the coordinator is at most
                # there (it cannot close a round this site holds a live lease of), and the
                # decision is the same at either round, so no status round trip is spent
                current = leased - 1
            else:
                current = int(client.status()["round"])
            decision = next_action(current, done, settings, out, durations, clock(), ahead)
        action, current = share(decision)
        if action == "stop":
            break
        if action == "wait":
            backoff.wait()
            continue
        backoff.reset()
        # rank 0's alone: the runner hands the round's A to the other ranks with the lease
        accumulation = accumulation_for(current) if client is not None else None
        log(f"{site_prefix(site)} round {current}: starting (estimate {out.estimate_s or 0:.0f}s)")
        started[current] = clock()
        outcome = runner.run_round(current, accumulation)
        seconds = clock() - started[current]
        status = str(getattr(outcome, "status", "unknown"))
        if status in (_TRAINED, _SENDING):
            durations.append(seconds)
        if status == _SENDING:
            sending[current] = seconds
        else:
            report(outcome, seconds)
        done.add(current)
    if overlap:
        settle(runner.finish())
    out.ended_at = clock()
    return out


def plan_entry(path: Any, site: str) -> dict[str, Any]:
    """``site``'s entry of a plan file ({} when the plan names no such site); a missing or
    unreadable file raises (OSError, ValueError)."""
    import json
    from pathlib import Path

    return json.loads(Path(path).read_text()).get("sites", {}).get(site) or {}


def planned_accumulation(results: Any, site: str, round_no: int) -> int | None:
    """The accumulation A the newest plan of round ``round_no`` or earlier gives ``site``.

    Each round's plan (``<results>/rounds/<r>/plan.json``) fills the barrier from the step
    times measured so far (crossfed.sched.barrier); a site loop reads it when it starts the
    round, and the plan of an earlier round when the round's own is not written yet, so it
    never waits for a plan. None: no plan gives one (the site's configured A holds).
    """
    from pathlib import Path

    for r in range(round_no, 0, -1):
        try:
            entry = plan_entry(Path(results) / "rounds" / str(r) / "plan.json", site)
        except (OSError, ValueError, AttributeError):
            continue  # not written yet, or unreadable: the plan before it
        if entry.get("accumulation"):
            return int(entry["accumulation"])
    return None


def history_durations(records: Sequence[Mapping[str, Any]], site: str) -> tuple[float, ...]:
    """Round durations of ``site`` from per-round records (oldest first)."""
    timed = []
    for rec in sorted(records, key=lambda r: int(r.get("round", 0))):
        if rec.get("site") != site or rec.get("status") != _TRAINED:
            continue
        seconds = (rec.get("extra") or {}).get("round_s")
        if isinstance(seconds, int | float) and seconds > 0:
            timed.append(float(seconds))
    return tuple(timed)


def read_records(pattern_dir: Any, site: str) -> list[dict[str, Any]]:
    """Per-round records of ``site`` under ``<results>/rounds/*/train/<site>.json``."""
    import json
    from pathlib import Path

    out = []
    for path in sorted(Path(pattern_dir).glob(f"rounds/*/train/{site}.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # a record being written right now
    return out
