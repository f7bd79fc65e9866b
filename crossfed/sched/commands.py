"""The scheduler's subcommands on the ``crossfed`` parser, without importing the scheduler.

``add_parsers`` registers ``probe`` and ``plan [simulate | job-log | fill]``; each handler imports
:mod:`crossfed.sched.cli` (the planner, pandas) only when its command runs, so every other
``crossfed`` command (a workflow's merge or train job) starts without them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from crossfed.cmdline import examples


def _handler(name: str) -> Callable[[argparse.Namespace], int]:
    """``crossfed.sched.cli.<name>``, imported when the command runs."""

    def run(args: argparse.Namespace) -> int:
        from crossfed.sched import cli

        return getattr(cli, name)(args)

    run.__name__ = run.__qualname__ = name
    return run


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``probe`` and ``plan`` (with ``plan simulate``) on the crossfed parser."""
    p = subparsers.add_parser(
        "probe",
        help="sbatch --test-only per job shape -> probe table",
        description="Ask each site's Slurm when a job of every configured shape would start "
        "(sbatch --test-only;\nnothing is submitted) and write the probe table, each shape's "
        "reason and the advice for it.",
        epilog=examples(
            "crossfed probe --sites profiles/slurm/sites.yaml --site lumi --out probe.csv",
            "crossfed probe --sites profiles/slurm/sites.yaml --out probe.csv "
            "--sacct-out sacct.txt",
        ),
    )
    p.add_argument("--sites", required=True, help="the sites file (config/sites.yaml)")
    p.add_argument("--out", required=True, help="probe table to write (CSV)")
    p.add_argument("--history", help="probe history CSV to append to")
    p.add_argument("--now", help="ISO timestamp to use as now (default: the clock)")
    p.add_argument("--site", action="append", help="probe only this site (repeatable)")
    p.add_argument("--sbatch", default="sbatch", help="sbatch executable")
    p.add_argument("--timeout-s", type=float, default=30.0, help="per-probe timeout")
    p.add_argument("--sacct-out", help="also capture sacct history here (raw text)")
    p.add_argument("--sacct", default="sacct", help="sacct executable")
    p.add_argument(
        "--sacct-window-days", type=float, default=14.0, help="days of sacct history to capture"
    )
    p.set_defaults(func=_handler("cmd_probe"))

    q = subparsers.add_parser(
        "plan",
        help="queue-aware placement -> PLAN.json",
        description="Plan which sites submit, with which shape and accumulation, from the "
        "probe table, the sites'\nsacct history (walltime discount gamma) and measured rounds "
        "(the waterfill); write PLAN.json.\nOptions left out come from the sites file's "
        "planner block. 'plan simulate' projects\ntime-to-target for a what-if queue scenario.",
        epilog=examples(
            "crossfed plan --config config/config.yaml --probes probe.csv --out plan.json",
            "crossfed plan --sites profiles/slurm/sites.yaml --probes probe.csv "
            "--target-units 8 --out plan.json",
            "crossfed plan simulate scenario.yaml",
        ),
    )
    q.add_argument(
        "--config",
        help="the run config: its sites file, and its rounds as the target (one unit a round)",
    )
    q.add_argument("--sites", help="config/sites.yaml")
    q.add_argument("--probes", help="probe table or probe history (CSV)")
    q.add_argument("--out", help="plan to write (JSON)")
    q.add_argument("--round", type=int, default=0, help="outer rounds already completed")
    q.add_argument(
        "--sacct-history",
        action="append",
        metavar="[SITE=]FILE",
        help="captured 'sacct -X -P -n' output; SITE= limits it to one site (repeatable)",
    )
    q.add_argument(
        "--gamma-window-days",
        type=float,
        default=14.0,
        help="days of sacct history the walltime discount gamma is measured over",
    )
    q.add_argument(
        "--job-log", help="completed rounds per site (CSV/JSON: site,tokens,seconds,gpus)"
    )
    q.add_argument("--jobs", help="running/queued jobs to keep (JSON)")
    q.add_argument("--now", help="ISO timestamp to use as now (default: the clock)")
    target = q.add_mutually_exclusive_group()
    target.add_argument(
        "--target-units", type=float, help="work to plan, in units (with --config: the rounds)"
    )
    target.add_argument("--target-tokens", type=float, help="work to plan, in tokens")
    q.add_argument("--units-per-round", type=float, help="R: units one outer round consumes")
    q.add_argument(
        "--tokens-per-unit", type=float, help="tokens in one unit (with --config: one round's)"
    )
    q.add_argument(
        "--min-units-per-job",
        type=float,
        help="drop a site whose whole chain of jobs would carry fewer units",
    )
    q.add_argument("--reserve-s", type=float, help="rho: reserve seconds padded onto last jobs")
    q.add_argument(
        "--max-probe-age-s",
        type=float,
        help="a site whose newest probe is older than this is not planned",
    )
    q.add_argument("--gamma", type=float, help="walltime discount when no sacct history is given")
    q.set_defaults(func=_handler("cmd_plan"))
    qs = q.add_subparsers(dest="plan_command", metavar="{simulate,job-log,fill}")
    s = qs.add_parser(
        "simulate",
        help="time-to-target for a queue scenario (Table 4)",
        description="Project the time to the target for a what-if queue scenario (the "
        "paper's Table 4).",
        epilog="example:\n  crossfed plan simulate config/scenarios/table4_a.yaml --json",
    )
    s.add_argument("scenario", help="scenario YAML")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=_handler("cmd_simulate"))
    log = qs.add_parser(
        "job-log",
        help="measured rounds -> the planner's job log (CSV)",
        description="Write the planner's job log (site, round, tokens, seconds, GPUs, step "
        "time) from the sites'\nper-round records (<results>/rounds/<r>/train/<site>.json) "
        "of the rounds before one.",
        epilog="example:\n  crossfed plan job-log --results results --before 3 --sites "
        "config/sites.yaml --out job_log.csv",
    )
    log.add_argument("--results", required=True, help="the run's results folder")
    log.add_argument("--before", type=int, required=True, help="rounds before this one")
    log.add_argument("--sites", help="the sites file, for the GPUs of each job shape")
    log.add_argument("--out", required=True, help="job log to write (CSV)")
    log.set_defaults(func=_handler("cmd_job_log"))
    fill = qs.add_parser(
        "fill",
        help="fill the barrier: a plan's accumulation from measured step times",
        description="Set each submitting site's accumulation A in a plan so that the sites "
        "reach the round barrier\ntogether, from the step times in the job log (paper "
        "Fig. 2a); the slowest site keeps its configured A.",
        epilog="example:\n  crossfed plan fill --plan draft.json --job-log job_log.csv "
        "--sites config/sites.yaml --out plan.json",
    )
    fill.add_argument("--plan", required=True, help="the plan (JSON)")
    fill.add_argument("--job-log", required=True, help="the job log (CSV, plan job-log)")
    fill.add_argument("--sites", required=True, help="the sites file (configured accumulation)")
    fill.add_argument("--out", help="the filled plan (default: --plan, rewritten in place)")
    fill.set_defaults(func=_handler("cmd_fill"))


def build_parser() -> argparse.ArgumentParser:
    """A parser with just the scheduler commands (``python -m crossfed.sched.commands``)."""
    parser = argparse.ArgumentParser(prog="crossfed")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
