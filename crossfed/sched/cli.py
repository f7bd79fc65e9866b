"""``crossfed probe`` and ``crossfed plan [simulate]``: the scheduler's command line.

``add_parsers(subparsers)`` registers the subcommands on the main ``crossfed`` parser; each
handler takes the argparse Namespace and returns an exit code (2 for bad input, naming the
problem). ``python -m crossfed.sched.commands`` runs them standalone.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from crossfed.config import SitesConfigError, read_sites, read_sites_file
from crossfed.sched.planner import FixedJob, PlanError, PlanParams, make_plan, write_plan
from crossfed.sched.probe import (
    ProbeTableError,
    append_history,
    collect_probes,
    read_probes,
    write_probes,
)
from crossfed.sched.queue_model import ScenarioError, format_table, load_scenario, simulate
from crossfed.sched.sacct import (
    JobLogError,
    SacctParseError,
    SacctUnavailableError,
    SlurmDurationError,
    load_job_log,
    parse_sacct,
    per_gpu_rates,
    run_sacct,
    sacct_window_start,
    walltime_discount,
)
from crossfed.sched.slurm_messages import Advice, advice_for

INPUT_ERRORS = (
    SitesConfigError,
    ProbeTableError,
    PlanError,
    ScenarioError,
    SacctParseError,
    SlurmDurationError,
    JobLogError,
)


class CliInputError(ValueError):
    """A command-line argument or input file the scheduler commands cannot use."""


def _fail(exc: Exception) -> int:
    print(f"crossfed: error: {exc}", file=sys.stderr)
    return 2


def _now(text: str | None) -> datetime:
    if not text:
        return datetime.now().astimezone()
    try:
        return datetime.fromisoformat(text)
    except ValueError as exc:
        raise CliInputError(f"--now: not an ISO timestamp: {text!r}") from exc


# ----------------------------------------------------------------------------- probe


def cmd_probe(args: argparse.Namespace) -> int:
    """Probe every shape of the configured sites and write the probe table."""
    try:
        now = _now(args.now)
        sites = read_sites_file(args.sites)
        table = collect_probes(
            sites, now, only=args.site or None, sbatch=args.sbatch, timeout_s=args.timeout_s
        )
    except (*INPUT_ERRORS, CliInputError) as exc:
        return _fail(exc)
    write_probes(table, args.out)
    if args.history:
        append_history(table, args.history)
    if args.sacct_out:
        window = args.sacct_window_days * 86400.0
        try:
            text = run_sacct(sacct_window_start(now, window), sacct=args.sacct)
        except SacctUnavailableError as exc:
            print(f"crossfed: warning: no sacct history written: {exc}", file=sys.stderr)
        else:
            Path(args.sacct_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.sacct_out).write_text(text)
    for row in table.itertuples():
        wait = f"{row.wait_s / 3600:.2f} h" if row.wait_s == row.wait_s else "-"
        advice = advice_for(row.reason)
        hint = "" if advice is Advice.USE else f"  -> {advice}: {row.detail}"
        print(f"{row.site:<12} {row.shape or '-':<14} {row.reason:<13} wait {wait}{hint}")
    return 0


# ----------------------------------------------------------------------------- plan


def _pick(cli: Any, block: Mapping[str, Any], key: str, default: Any) -> Any:
    if cli is not None:
        return cli
    return block.get(key, default)


def _params(args: argparse.Namespace, block: Mapping[str, Any]) -> PlanParams:
    try:
        tpu = float(_pick(args.tokens_per_unit, block, "tokens_per_unit", 1.0))
        if args.target_units is not None:
            units = float(args.target_units)
        elif args.target_tokens is not None:
            units = float(args.target_tokens) / tpu
        elif "target_units" in block:
            units = float(block["target_units"])
        elif "target_tokens" in block:
            units = float(block["target_tokens"]) / tpu
        else:
            raise CliInputError(
                "no target: pass --target-units or --target-tokens, or set "
                "planner.target_units (or planner.target_tokens) in the sites config"
            )
        return PlanParams(
            units_total=units,
            units_per_round=float(_pick(args.units_per_round, block, "units_per_round", 1.0)),
            tokens_per_unit=tpu,
            round=int(args.round or 0),
            min_units_per_job=float(_pick(args.min_units_per_job, block, "min_units_per_job", 0.0)),
            reserve_s=float(_pick(args.reserve_s, block, "reserve_s", 0.0)),
            max_probe_age_s=float(_pick(args.max_probe_age_s, block, "max_probe_age_s", 3600.0)),
            gamma=float(_pick(args.gamma, block, "gamma", 1.0)),
        )
    except (PlanError, CliInputError):
        raise
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise CliInputError(f"planner settings: {exc}") from exc


def _gammas(specs: Sequence[str], sites: Sequence[str], now: datetime, window_s: float):
    """``[SITE=]FILE`` sacct captures -> gamma per site (a bare FILE applies to all)."""
    out: dict[str, float] = {}
    for spec in specs:
        site, _, path = spec.rpartition("=")
        if site and site not in sites:
            raise CliInputError(f"--sacct-history {spec!r}: unknown site {site!r}")
        p = Path(path)
        if not p.is_file():
            raise CliInputError(f"--sacct-history: file not found: {p}")
        # relative SLURM_TIME_FORMAT times count from when sacct ran: the file's mtime
        captured = datetime.fromtimestamp(p.stat().st_mtime, tz=now.tzinfo)
        d = walltime_discount(parse_sacct(p.read_text(), now=captured), now, window_s=window_s)
        if d.unparsed:
            print(
                f"crossfed: warning: {p}: {d.unparsed} row(s) with Start/End in no known "
                "time format left out of gamma (capture sacct with SLURM_TIME_FORMAT=standard)",
                file=sys.stderr,
            )
        for s in [site] if site else sites:
            out[s] = d.gamma
    return out


def load_fixed_jobs(path: str | Path) -> list[FixedJob]:
    """Running/queued jobs: a JSON list of ``{site, shape, state, start?, end?}``."""
    p = Path(path)
    if not p.is_file():
        raise CliInputError(f"jobs file not found: {p}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise CliInputError(f"{p}: invalid JSON: {exc}") from exc
    if isinstance(data, Mapping):
        data = data.get("jobs")
    if not isinstance(data, list):
        raise CliInputError(f"{p}: expected a list of jobs or {{'jobs': [...]}}")
    jobs = []
    for i, j in enumerate(data):
        if not isinstance(j, Mapping) or "site" not in j:
            raise CliInputError(f"{p}: job {i} needs at least a 'site'")
        try:
            start = datetime.fromisoformat(j["start"]) if j.get("start") else None
            end = datetime.fromisoformat(j["end"]) if j.get("end") else None
        except (TypeError, ValueError) as exc:
            raise CliInputError(f"{p}: job {i}: bad timestamp: {exc}") from exc
        jobs.append(
            FixedJob(str(j["site"]), j.get("shape"), start, end, str(j.get("state", "running")))
        )
    return jobs


def _from_run_config(args: argparse.Namespace) -> None:
    """Fill the run's target from the workflow's effective config (``--config``).

    The run's ``rounds`` is the target, one unit per round, and a unit is the tokens one
    round consumes; flags given explicitly win. Rules pass the config file rather than
    these numbers, so a rerun with more rounds changes no finished job's parameters.
    """
    from crossfed.config import load_run_config, load_sites

    config = load_run_config(Path(args.config))
    sites = load_sites(config)
    if args.sites is None:
        args.sites = config.sites_file
    if args.target_units is None and args.target_tokens is None:
        args.target_units = float(config.rounds)
    if args.units_per_round is None:
        args.units_per_round = 1.0
    if args.tokens_per_unit is None:
        args.tokens_per_unit = float(
            sum(
                config.tokens_per_round(s.micro_batch * s.ranks * s.accumulation)
                for s in sites.values()
            )
        )


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan submissions from probes, sacct history and job logs; write PLAN.json."""
    if args.config:
        try:
            _from_run_config(args)
        except ValueError as exc:  # ConfigError
            return _fail(exc)
    missing = [f"--{k}" for k in ("sites", "probes", "out") if not getattr(args, k)]
    if missing:
        return _fail(CliInputError(f"plan needs {', '.join(missing)} (or use 'plan simulate')"))
    try:
        now = _now(args.now)
        sites_file = read_sites(args.sites, keep_unknown_keys=True)
        sites = sites_file.sites
        params = _params(args, sites_file.planner)
        probes = read_probes(args.probes)
        gammas = _gammas(args.sacct_history or [], list(sites), now, args.gamma_window_days * 86400)
        priors = {s: c.tokens_per_s_per_gpu for s, c in sites.items()}
        log = load_job_log(args.job_log) if args.job_log else None
        rates = {s: r.tokens_per_s_per_gpu for s, r in per_gpu_rates(log, priors).items()}
        fixed = load_fixed_jobs(args.jobs) if args.jobs else []
        plan = make_plan(sites, probes, params, now, gammas=gammas, rates=rates, fixed=fixed)
    except (*INPUT_ERRORS, CliInputError) as exc:
        return _fail(exc)
    write_plan(plan, args.out)
    fin = plan.predicted_finish_s
    print(
        f"mode {plan.mode}; {plan.units_outstanding:g} units outstanding; "
        f"finish in {fin / 3600:.2f} h"
        if fin is not None
        else f"mode {plan.mode}"
    )
    for name, sp in plan.sites.items():
        verb = "submit" if sp.submit else "skip  "
        print(
            f"{verb} {name:<12} shape={sp.shape or '-'} jobs={sp.jobs} units={sp.units:.4g} "
            f"A={sp.accumulation if sp.accumulation is not None else '-'}  {sp.reason}"
        )
        for shape, advice in sp.advice.items():
            print(f"       {name:<12} shape {shape}: {advice}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    """Project time-to-target for a what-if scenario (paper Table 4)."""
    try:
        sc = load_scenario(args.scenario)
        proj = simulate(sc)
    except (*INPUT_ERRORS, CliInputError) as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps(proj.to_dict()))
    else:
        print(format_table(sc, proj))
    return 0


def cmd_job_log(args: argparse.Namespace) -> int:
    """The planner's job log from the measured rounds (crossfed.sched.barrier)."""
    from crossfed.sched.barrier import BarrierError, write_job_log

    try:
        sites = Path(args.sites) if args.sites else None
        print(write_job_log(Path(args.results), args.before, sites, Path(args.out)))
    except (BarrierError, OSError, ValueError, KeyError) as exc:
        return _fail(exc)
    return 0


def cmd_fill(args: argparse.Namespace) -> int:
    """A plan's accumulation from measured step times (crossfed.sched.barrier)."""
    from crossfed.sched.barrier import BarrierError, fill_plan_file

    try:
        out = Path(args.out or args.plan)
        print(fill_plan_file(Path(args.plan), Path(args.job_log), Path(args.sites), out))
    except (BarrierError, OSError, ValueError, KeyError) as exc:
        return _fail(exc)
    return 0
