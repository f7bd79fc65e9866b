"""Several outer rounds back to back inside one Slurm allocation, and how to launch them.

A chain job trains the coordinator's current round, waits for the round to close, trains the
next one, and so on up to the run's last round. It never starts a round it could not finish
before the allocation ends: the time a round takes is estimated from the rounds already
timed (in this job or, from the per-round records, in earlier jobs of the site), and the next
round starts only if it fits with ``margin_s`` to spare. The workflow then submits the next
job of the chain, which continues from whatever round is current by then. A job that Slurm
kills anyway (walltime, node failure, ``scancel``) loses at most its one in-flight lease: the
lease's TTL returns its blocks to the pool, and the retried job carries on.

The pure parts (parsing ``squeue``, estimating, deciding) take ``now`` and text; ``run_chain``
wires them to a site runner and a coordinator client; ``slurm_allocation`` and
``srun_per_node`` are the only functions that know about Slurm's tools and environment.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Protocol

from crossfed.fileio import write_atomic

#: statuses of run_round after which the site's part of that round is over
_TRAINED = "accepted"
_UNSET_TIMES = {"", "N/A", "NONE", "UNKNOWN", "UNLIMITED", "INVALID"}


class ChainError(ValueError):
    """Settings or Slurm answers a chain job cannot work with."""


# ----------------------------------------------------------------------------- allocation


@dataclass(frozen=True)
class Allocation:
    """The Slurm job this process runs in: its id, nodes and when it ends."""

    job_id: str
    nodes: tuple[str, ...]
    end: float | None  # epoch seconds; None when Slurm reports no limit

    @property
    def head(self) -> str:
        """The first node: torchrun's rendezvous host."""
        return self.nodes[0]


def parse_end_time(text: str) -> float | None:
    """Epoch seconds of an ``squeue -o %e`` end time (the cluster's local time), or None."""
    value = text.strip()
    if value.upper() in _UNSET_TIMES:
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError as exc:
        raise ChainError(f"squeue end time is not an ISO timestamp: {value!r}") from exc


def parse_squeue_job(text: str) -> tuple[float | None, str]:
    """``squeue -h -j ID -o %e|%N`` output -> (end time, compressed node list)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or "|" not in lines[0]:
        raise ChainError(f"unexpected squeue output: {text.strip()[:200]!r}")
    end, nodelist = lines[0].split("|", 1)
    return parse_end_time(end), nodelist.strip()


Runner = Callable[[Sequence[str]], str]


def _run(cmd: Sequence[str]) -> str:
    """Run a Slurm client command with standard (ISO) times, whatever the user's format."""
    from crossfed.sched.sacct import slurm_client_env

    try:
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=60, env=slurm_client_env()
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ChainError(f"{cmd[0]} failed: {exc}") from exc
    if proc.returncode != 0:
        raise ChainError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[:300]}")
    return proc.stdout


def slurm_allocation(env: Mapping[str, str] | None = None, run: Runner = _run) -> Allocation | None:
    """The allocation named by ``SLURM_JOB_ID``, asked of squeue; None outside Slurm.

    Snakemake's Slurm job step strips most ``SLURM_*`` variables before it runs a rule, so
    the node list and end time come from squeue and scontrol, not from the environment.
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    end, nodelist = parse_squeue_job(run(["squeue", "-h", "-j", job_id, "-o", "%e|%N"]))
    nodes = tuple(run(["scontrol", "show", "hostnames", nodelist]).split()) if nodelist else ()
    if not nodes:
        raise ChainError(f"squeue shows no nodes for running job {job_id}")
    return Allocation(job_id, nodes, end)


def srun_per_node(alloc: Allocation) -> list[str]:
    """``srun`` that starts one task on every node of the allocation (one torchrun each).

    Used in the batch step itself: the rule is submitted with Snakemake's ``mpi`` resource,
    so the job step runs it without wrapping it in its own single-task ``srun`` (a step
    inside that step would find the node's CPUs taken).
    """
    n = len(alloc.nodes)
    return [
        "srun",
        f"--jobid={alloc.job_id}",
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]


def parse_node_address(text: str, node: str) -> str:
    """NodeAddr from ``scontrol show node`` output (the node name when none is given)."""
    match = re.search(r"\bNodeAddr=(\S+)", text)
    return match.group(1) if match else node


def node_address(node: str, run: Runner = _run) -> str:
    """How other nodes reach ``node`` (its NodeAddr: node names need not resolve)."""
    return parse_node_address(run(["scontrol", "show", "node", node]), node)


def rendezvous_endpoint(address: str, port: int = 29400) -> str:
    """torchrun's c10d rendezvous at the allocation's head node."""
    return f"{address}:{port}"


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
    """What the chain needs of a site runner (crossfed.site.SiteRunner)."""

    def run_round(self, round_no: int, accumulation: int | None = None) -> Any: ...


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
) -> tuple[str, int]:
    """What a chain does next at the coordinator's round ``current``.

    ``("stop", current)`` when the run is complete or the round would not fit (``out`` then
    says why), ``("wait", current)`` while this site's part of the round is in, else
    ``("train", current)``. Pure: the caller polls the coordinator and keeps the clock.
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
    delay = settings.poll_s
    while True:
        decision = None
        if client is not None:
            current = int(client.status()["round"])
            decision = next_action(current, done, settings, out, durations, clock())
        action, current = share(decision)
        if action == "stop":
            break
        if action == "wait":
            sleep(delay)
            delay = min(delay * 2, settings.max_poll_s)
            continue
        delay = settings.poll_s
        # rank 0's alone: the runner hands the round's A to the other ranks with the lease
        accumulation = accumulation_for(current) if client is not None else None
        log(f"[{site}] round {current}: starting (estimate {out.estimate_s or 0:.0f}s)")
        started = clock()
        outcome = runner.run_round(current, accumulation)
        seconds = clock() - started
        status = str(getattr(outcome, "status", "unknown"))
        out.rounds.append(
            ChainRecord(current, status, seconds, str(getattr(outcome, "detail", "")))
        )
        if status == _TRAINED:
            durations.append(seconds)
        if on_round is not None:
            on_round(outcome, seconds)
        done.add(current)
    out.ended_at = clock()
    return out


def planned_accumulation(results: Any, site: str, round_no: int) -> int | None:
    """The accumulation A the newest plan of round ``round_no`` or earlier gives ``site``.

    Each round's plan (``<results>/rounds/<r>/plan.json``) fills the barrier from the step
    times measured so far (crossfed.train.barrier); a site loop reads it when it starts the
    round, and the plan of an earlier round when the round's own is not written yet, so it
    never waits for a plan. None: no plan gives one (the site's configured A holds).
    """
    import json
    from pathlib import Path

    for r in range(round_no, 0, -1):
        path = Path(results) / "rounds" / str(r) / "plan.json"
        try:
            entry = json.loads(path.read_text()).get("sites", {}).get(site) or {}
        except FileNotFoundError:
            continue
        except (OSError, ValueError, AttributeError):
            continue  # a plan being replaced or unreadable: the one before it
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


# ----------------------------------------------------------------------------- the job


def tokens_per_round(config: Mapping[str, Any], site: Mapping[str, Any], accumulation: int) -> int:
    """Tokens one site trains in one round: H * seq_len * B * W * A."""
    windows = site["micro_batch"] * site["ranks"] * accumulation
    return int(config["inner"]["steps"]) * int(config["data"]["seq_len"]) * windows


def proxy_env(config: Mapping[str, Any]) -> dict[str, str]:
    """Environment that sends the site's HTTP(S) requests through its forward proxy."""
    proxy = config["connectivity"]["https_proxy"]
    if not proxy:
        return {}
    no_proxy = config["connectivity"]["no_proxy"]
    return {
        "https_proxy": proxy,
        "HTTPS_PROXY": proxy,
        "http_proxy": proxy,
        "HTTP_PROXY": proxy,
        "no_proxy": no_proxy,
        "NO_PROXY": no_proxy,
    }


def short_requests(site: Mapping[str, Any]) -> bool:
    """Whether the site sends every delta as its own upload plus short JSON requests.

    A site behind an HTTP forward proxy (``transport: proxy``) never puts a delta inside the
    round message: the proxy's load balancer reaps long requests, and a separate, idempotent
    blob upload is retried on its own.
    """
    return site.get("transport") == "proxy"


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


def relaunch_ranks(ranks: int, argv: Sequence[str], launcher: Mapping[str, Any]) -> int:
    """Run ``crossfed <argv>`` again as ``ranks`` torchrun processes; their exit code.

    Inside a Slurm allocation of several nodes, ``srun`` starts one torchrun per node and
    they meet at the head node; otherwise torchrun runs here as the launcher config says.
    """
    from crossfed.train.distributed import (
        DistributedError,
        python_torchrun,
        relaunch_under_torchrun,
        torchrun_argv,
    )

    alloc = slurm_allocation()
    if alloc is None or len(alloc.nodes) == 1:
        return relaunch_under_torchrun(ranks, argv, launcher)
    nodes = len(alloc.nodes)
    if ranks % nodes:
        raise DistributedError(f"{ranks} ranks do not spread evenly over {nodes} nodes")
    cmd = srun_per_node(alloc) + torchrun_argv(
        ranks // nodes,
        argv,
        torchrun=launcher.get("command") or python_torchrun(),
        nnodes=nodes,
        rdzv_endpoint=rendezvous_endpoint(node_address(alloc.head)),
    )
    return subprocess.call(cmd)


def chain_job(
    config: dict[str, Any],
    site: str,
    *,
    through_round: int,
    plan_path: str | None,
    until_walltime: str,
    round_out: str,
    log: Callable[[str], None] = print,
) -> ChainOutcome | None:
    """Run one chain job of ``site`` (the CLI's ``site run --through-round``).

    Under torchrun every rank calls this; rank 0 talks to the coordinator and returns the
    outcome, the other ranks return None.
    """
    import json
    from dataclasses import replace
    from pathlib import Path

    from crossfed.config import ConfigError, load_sites
    from crossfed.coordinator.embedded import client_for
    from crossfed.launch import site_settings
    from crossfed.site import SiteRunner
    from crossfed.train.distributed import broadcast_object, close_ranks, init_ranks

    sites = load_sites(config)
    if site not in sites:
        raise ConfigError(f"unknown site {site!r}; sites are {list(sites)}")
    entry: dict[str, Any] = {}
    if plan_path and Path(plan_path).exists():
        entry = json.loads(Path(plan_path).read_text()).get("sites", {}).get(site, {})
    now = time.time()
    if entry and entry.get("submit") is False:
        out = ChainOutcome(site, "not_planned", started_at=now, ended_at=now)
        out.detail = str(entry.get("reason", ""))
        return out
    accumulation = entry.get("accumulation") or sites[site]["accumulation"]
    settings = site_settings(config, site, sites[site], accumulation)
    if short_requests(sites[site]):
        settings = replace(settings, inline_max_bytes=0)
    os.environ.update(proxy_env(config))
    ranks = init_ranks(settings.device)
    alloc = None
    deadline: float | None = None
    if until_walltime == "auto":
        alloc = slurm_allocation() if ranks.main else None
        deadline = alloc.end if alloc else None
    elif until_walltime not in ("", "none"):
        try:
            deadline = now + float(until_walltime)
        except ValueError as exc:
            raise ChainError(
                f"--until-walltime must be 'auto', 'none' or seconds, got {until_walltime!r}"
            ) from exc
    if deadline is not None:  # a round that runs long stops in time to send what it trained
        stop_at = deadline - float(config["chain"]["margin_s"])
        settings = replace(settings, stop_training_at=stop_at)
    prior = config["chain"]["round_prior_s"]
    if prior is None:
        prior = round_prior_s(
            tokens_per_round(config, sites[site], accumulation), entry.get("tokens_per_s")
        )
    chain = ChainSettings(
        through_round=through_round,
        deadline=deadline,
        margin_s=float(config["chain"]["margin_s"]),
        prior_s=prior,
        history_s=history_durations(read_records(config["results"], site), site),
    )

    def record(outcome: Any, seconds: float) -> None:
        outcome.extra["round_s"] = seconds
        if alloc is not None:
            outcome.extra["slurm_job_id"] = alloc.job_id
        path = Path(round_out.format(round=outcome.round, site=site))
        write_atomic(path, json.dumps(asdict(outcome), indent=2, default=str) + "\n")
        log(
            f"[{site} r{outcome.round}] {outcome.status} in {seconds:.1f}s: {outcome.tokens} "
            f"tokens, loss {outcome.loss_mean} {outcome.detail}"
        )

    client = client_for(config, site) if ranks.main else None
    if ranks.main:
        left = "no walltime" if deadline is None else f"{deadline - now:.0f}s of walltime"
        log(f"[{site}] chain job: rounds up to {through_round}, {left}, margin {chain.margin_s:g}s")
    try:
        runner = SiteRunner(settings, client, ranks)
        out = run_chain(
            site,
            runner,
            client,
            chain,
            share=lambda decision: broadcast_object(decision, ranks),
            on_round=record if ranks.main else None,
            accumulation_for=lambda r: planned_accumulation(config["results"], site, r),
            log=log if ranks.main else lambda _: None,
        )
    finally:
        close_ranks(ranks)
    if not ranks.main:
        return None
    out.slurm_job_id = alloc.job_id if alloc else None
    return out


def planned_job(plan: Mapping[str, Any] | None, site: str, site_cfg: Mapping[str, Any]) -> dict:
    """Shape of a site's next chain job from a plan (or its first shape when unplanned).

    The job asks for the shape's full walltime (capped by the site's maximum): a chain job
    trains as many rounds as fit, so a longer allocation only means fewer queue waits.
    """
    from crossfed.sched.sacct import SlurmDurationError, parse_slurm_duration

    entry = (plan or {}).get("sites", {}).get(site, {}) or {}
    shapes = list(site_cfg.get("shapes") or [])
    if not shapes:
        raise ChainError(f"site {site!r} has no job shapes; a Slurm site needs at least one")
    shape = next((s for s in shapes if s["name"] == entry.get("shape")), shapes[0])
    try:
        wall = parse_slurm_duration(shape["walltime"])
    except SlurmDurationError as exc:
        raise ChainError(f"site {site!r} shape {shape['name']!r}: {exc}") from exc
    cap = float(site_cfg.get("max_walltime_h") or math.inf) * 3600.0
    wall = min(wall or cap, cap)
    if not math.isfinite(wall) or wall <= 0:
        raise ChainError(f"site {site!r} shape {shape['name']!r}: no finite walltime")
    nodes, per_node = int(shape["nodes"]), int(shape.get("gpus_per_node", 0))
    return {
        "shape": shape["name"],
        "partition": shape["partition"],
        "nodes": nodes,
        "gpus_per_node": per_node,
        "gpus": nodes * per_node,
        "walltime_s": wall,
        "runtime_min": max(1, math.ceil(wall / 60.0 - 1e-9)),
        "submit": entry.get("submit", True) is not False,
        "accumulation": entry.get("accumulation"),
    }
