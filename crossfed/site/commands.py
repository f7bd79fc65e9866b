"""``crossfed site ...``: a site's training jobs (one round, or a chain in one allocation)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crossfed.cmdline import add_config, add_threads, examples, group, run_config, write_json
from crossfed.config import ConfigError, RunConfig, load_sites
from crossfed.progress import site_prefix

if TYPE_CHECKING:
    from crossfed.site.keepalive import LeaseKeeper


def _closed_round(config: RunConfig, site: str, round_no: int) -> dict[str, Any] | None:
    """A ``missed`` outcome when the coordinator has closed ``round_no`` already, else None.

    A late site's workflow has a job for every round before the one it joins; those end
    here at once, before torch is imported. A job with a checkpointed, unsent delta goes on
    to the site loop, which resends it (idempotent) whatever the round's state, and so does
    a job whose status request fails (the site loop retries and reports).
    """
    from crossfed.catchup import closed_detail, coordinator_round

    if (Path(config.results) / "sites" / site / "pending.json").exists():
        return None
    current = coordinator_round(config, site)
    if current is None or current <= round_no:
        return None
    return {
        "site": site,
        "round": round_no,
        "status": "missed",
        "detail": closed_detail(round_no, current),
        "steps": 0,
        "tokens": 0,
        "compute_s": 0.0,
        "overhead_s": 0.0,
    }


def cmd_site_run(args: argparse.Namespace) -> int:
    config = run_config(args)
    sites = load_sites(config)
    if args.site not in sites:  # before torch is imported
        raise ConfigError(f"unknown site {args.site!r}; sites are {list(sites)}")
    if args.round is not None:
        missed = _closed_round(config, args.site, args.round)
        if missed is not None:
            write_json(args.out, missed)
            print(f"{site_prefix(args.site, args.round)} missed: {missed['detail']}")
            return 0
    from crossfed.site.keepalive import keep_site_leases

    keeper = keep_site_leases(config, args.site)  # a killed job's leases beat on meanwhile
    import torch

    from crossfed.client.reach import client_for
    from crossfed.site import SiteRunner
    from crossfed.site.job import relaunch, site_job
    from crossfed.train.distributed import close_ranks, init_ranks
    from crossfed.wire.libc import keep_stream_buffers_in_heap

    keep_stream_buffers_in_heap()
    torch.set_num_threads(args.threads)
    code = relaunch(config, args.site, sys.argv[1:])
    if code is not None:
        return code
    if args.round is None:
        return _site_chain(args, config, keeper)
    entry, settings = site_job(config, args.site, args.plan)
    if entry.get("submit") is False:
        record = {"site": args.site, "round": args.round, "status": "not_planned"}
        write_json(args.out, {**record, "detail": entry.get("reason", "")})
        return 0
    ranks = init_ranks(settings.device)
    client = client_for(config, args.site) if ranks.main else None
    try:
        runner = SiteRunner(settings, client, ranks)
        runner.keeper = keeper
        outcome = runner.run_round(args.round)
    finally:
        close_ranks(ranks)
    if not ranks.main:
        return 0
    from dataclasses import asdict

    write_json(args.out, asdict(outcome))
    from crossfed.progress import mfu_text

    loss = "n/a" if outcome.loss_mean is None else f"{outcome.loss_mean:.4f}"
    print(
        f"{args.site:<10} round {args.round}/{config.rounds}  {outcome.status}: "
        f"{outcome.tokens:,} tokens, loss {loss}, {outcome.tokens_per_s:,.0f} tok/s, "
        f"MFU {mfu_text(outcome.mfu)} {outcome.detail}".rstrip()
    )
    return 0


def _site_chain(args: argparse.Namespace, config: RunConfig, keeper: LeaseKeeper | None) -> int:
    """Rounds back to back in one job (crossfed.site.loop); writes the chain outcome."""
    from crossfed.site.job import chain_job
    from crossfed.site.loop import ChainError

    template = args.round_out or str(
        Path(config.results) / "rounds" / "{round}" / "train" / f"{args.site}.json"
    )
    try:
        outcome = chain_job(
            config,
            args.site,
            through_round=config.rounds if args.through_round == "run" else args.through_round,
            plan_path=args.plan,
            until_walltime=args.until_walltime,
            round_out=template,
            keeper=keeper,
        )
    except ChainError as exc:
        raise ConfigError(str(exc)) from exc
    if outcome is None:  # a torchrun rank other than 0
        return 0
    print(
        f"{site_prefix(args.site)} chain job stopped ({outcome.stopped}): "
        f"{outcome.trained} rounds trained, "
        f"coordinator at round {outcome.next_round}; next job: {outcome.next_job} "
        f"{outcome.detail}"
    )
    if outcome.stopped == "too_short":  # fail loudly: the workflow cannot carry on this way
        raise ConfigError(f"site {args.site}: {outcome.detail}")
    write_json(args.out, outcome.to_dict())
    return 0


def _last_round(text: str) -> int | str:
    if text == "run":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a round number or 'run'") from None


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``site run`` on the crossfed parser."""
    ssub = group(
        sub, "site", "a site's training jobs",
        "crossfed site run --config config/config.yaml --site lumi --round 1",
    )  # fmt: skip
    srun = ssub.add_parser(
        "run",
        help="train outer rounds as a site (one, or a chain in one allocation)",
        description="Train as a site: lease blocks from the coordinator, run H inner steps, "
        "send the delta.\n--round trains one outer round; --through-round trains rounds back "
        "to back in one\nallocation (a Slurm chain job).",
        epilog=examples(
            "crossfed site run --config config/config.yaml --site lumi --round 3 \\",
            "    --plan results/rounds/3/plan.json --out results/rounds/3/train/lumi.json",
            "crossfed site run --config config/config.yaml --site lumi --through-round run \\",
            "    --until-walltime auto --out outcome.json",
        ),
    )
    add_config(srun)
    srun.add_argument("--site", required=True, help="this site's name in the sites file")
    which = srun.add_mutually_exclusive_group(required=True)
    which.add_argument("--round", type=int, help="train this one outer round")
    which.add_argument(
        "--through-round",
        type=_last_round,
        help="chain: train the current round and the ones after it, back to back, up to this "
        "one ('run': the config's last round, so an extended run needs no other command)",
    )
    srun.add_argument(
        "--until-walltime",
        default="none",
        help="chain: start no round that would end after the walltime: 'auto' (the Slurm "
        "allocation's end), 'none', or seconds from now",
    )
    srun.add_argument(
        "--round-out",
        help="chain: per-round record path with {round} (default: "
        "<results>/rounds/{round}/train/<site>.json)",
    )
    srun.add_argument("--plan", help="plan JSON (accumulation, whether to submit)")
    add_threads(srun)
    srun.add_argument("--out", help="write the outcome (JSON) here")
    srun.set_defaults(func=cmd_site_run)
