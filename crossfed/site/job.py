"""One site job: settings from the config, the site loop on every rank, the outcome.

``chain_job`` is the CLI's ``site run --through-round``: it reads the site's plan entry, sets
the walltime and the proxy, builds the runner and runs the loop (crossfed.site.loop);
``site_settings`` maps the run config to a site's settings.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crossfed.fileio import write_atomic
from crossfed.progress import site_prefix
from crossfed.site.loop import (
    ChainError,
    ChainOutcome,
    ChainSettings,
    history_durations,
    plan_entry,
    planned_accumulation,
    read_records,
    round_prior_s,
    run_chain,
)
from crossfed.site.slurm import slurm_allocation

if TYPE_CHECKING:  # the runner imports torchtitan: only a training job needs it
    from crossfed.config import ConnectivitySection, RunConfig, SiteConfig
    from crossfed.site.keepalive import LeaseKeeper
    from crossfed.site.records import SiteSettings


def proxy_env(connectivity: ConnectivitySection) -> dict[str, str]:
    """Environment that sends the site's HTTP(S) requests through its forward proxy."""
    proxy = connectivity.https_proxy
    if not proxy:
        return {}
    no_proxy = connectivity.no_proxy
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


def site_job(
    config: RunConfig, site: str, plan_path: str | None
) -> tuple[dict[str, Any], SiteSettings]:
    """What every site job reads before it trains, one round or many: the site (unknown:
    an error naming the sites), its plan entry ({} without a plan), its settings with the
    plan's accumulation, and the forward proxy's environment (set for this process)."""
    from crossfed.config import ConfigError, load_sites

    sites = load_sites(config)
    if site not in sites:
        raise ConfigError(f"unknown site {site!r}; sites are {list(sites)}")
    entry = plan_entry(plan_path, site) if plan_path and Path(plan_path).exists() else {}
    accumulation = entry.get("accumulation") or sites[site].accumulation
    settings = site_settings(config, site, sites[site], accumulation)
    if short_requests(sites[site]):
        settings = replace(settings, inline_max_bytes=0)
    os.environ.update(proxy_env(config.connectivity))
    return entry, settings


def relaunch(config: RunConfig, site: str, argv: list[str]) -> int | None:
    """Under ``launcher: torchrun``, outside torchrun: run this job again as the site's ranks
    (one torchrun per node of the allocation) and return their exit code; else None."""
    from crossfed.config import load_sites
    from crossfed.launchenv import under_torchrun
    from crossfed.site.slurm import relaunch_ranks

    if config.launcher.kind != "torchrun" or under_torchrun():
        return None
    return relaunch_ranks(load_sites(config)[site].ranks, argv, config.launcher)


def chain_job(
    config: RunConfig,
    site: str,
    *,
    through_round: int,
    plan_path: str | None,
    until_walltime: str,
    round_out: str,
    log: Callable[[str], None] = print,
    keeper: LeaseKeeper | None = None,
) -> ChainOutcome | None:
    """Run one chain job of ``site`` (the CLI's ``site run --through-round``).

    Under torchrun every rank calls this; rank 0 talks to the coordinator and returns the
    outcome, the other ranks return None.
    """
    from crossfed.client.reach import client_for
    from crossfed.site.runner import SiteRunner
    from crossfed.train.distributed import broadcast_object, close_ranks, init_ranks

    entry, settings = site_job(config, site, plan_path)
    now = time.time()
    if entry.get("submit") is False:
        out = ChainOutcome(site, "not_planned", started_at=now, ended_at=now)
        out.detail = str(entry.get("reason", ""))
        return out
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
        stop_at = deadline - float(config.chain.margin_s)
        settings = replace(settings, stop_training_at=stop_at)
    prior = config.chain.round_prior_s
    if prior is None:
        prior = round_prior_s(
            config.tokens_per_round(settings.inner.windows_per_step), entry.get("tokens_per_s")
        )
    chain = ChainSettings(
        through_round=through_round,
        deadline=deadline,
        margin_s=float(config.chain.margin_s),
        prior_s=prior,
        history_s=history_durations(read_records(config.results, site), site),
    )

    def record(outcome: Any, seconds: float) -> None:
        outcome.extra["round_s"] = seconds
        if alloc is not None:
            outcome.extra["slurm_job_id"] = alloc.job_id
        path = Path(round_out.format(round=outcome.round, site=site))
        if outcome.extra.get("already") and path.exists():
            return  # the job that sent the delta recorded the round, with what it trained
        write_atomic(path, json.dumps(asdict(outcome), indent=2, default=str) + "\n")
        log(
            f"{site_prefix(site, outcome.round)} {outcome.status} in {seconds:.1f}s: "
            f"{outcome.tokens} tokens, loss {outcome.loss_mean} {outcome.detail}"
        )

    client = client_for(config, site) if ranks.main else None
    if ranks.main:
        left = "no walltime" if deadline is None else f"{deadline - now:.0f}s of walltime"
        log(
            f"{site_prefix(site)} chain job: rounds up to {through_round}, {left}, "
            f"margin {chain.margin_s:g}s"
        )
    try:
        runner = SiteRunner(settings, client, ranks)
        runner.keeper = keeper
        out = run_chain(
            site,
            runner,
            client,
            chain,
            share=lambda decision: broadcast_object(decision, ranks),
            on_round=record if ranks.main else None,
            accumulation_for=lambda r: planned_accumulation(config.results, site, r),
            log=log if ranks.main else lambda _: None,
        )
    finally:
        close_ranks(ranks)
    if not ranks.main:
        return None
    out.slurm_job_id = alloc.job_id if alloc else None
    return out


def site_settings(
    config: RunConfig, site_name: str, site: SiteConfig, accumulation: int | None = None
) -> SiteSettings:
    """Settings of one site job; ``accumulation`` may come from the plan (filling the barrier)."""
    from crossfed.site.records import SiteSettings
    from crossfed.train.distributed import ParallelConfig
    from crossfed.train.inner import InnerConfig
    from crossfed.train.overlap import OverlapConfig

    inner, transport, model, overlap = config.inner, config.transport, config.model, config.overlap
    return SiteSettings(
        site=site_name,
        data_dir=Path(config.data.dir),
        work_dir=Path(config.results) / "sites",
        block_size=config.data.block_size,
        data_seed=config.data.seed,
        inner=InnerConfig(
            micro_batch=site.micro_batch,
            ranks=site.ranks,
            accumulation=accumulation or site.accumulation,
            weight_decay=inner.weight_decay,
            grad_clip=inner.grad_clip,
            slowdown=site.slowdown,
            min_step_s=site.min_step_s,
        ),
        heartbeat_s=config.darl.heartbeat_s,
        inline_max_bytes=transport.inline_max_bytes,
        compress=transport.compress,
        error_feedback=transport.error_feedback,
        device=model.device,
        launcher=config.launcher.kind,
        parallel=ParallelConfig(
            compile=model.compile,
            activation_checkpointing=model.activation_checkpointing,
        ),
        checkpoint_every=inner.checkpoint_every,
        checkpoint_background=inner.checkpoint_background,
        rounds=config.rounds,
        overlap=OverlapConfig(**overlap.as_dict()),  # the section's keys are its fields
        lease_wait_s=config.darl.initial_ttl_s + config.round_policy.join_window_s + 30.0,
    )
