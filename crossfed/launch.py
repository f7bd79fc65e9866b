"""From a validated run config to the objects the coordinator and a site job run with."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from crossfed.coordinator.runspec import LeasePolicy, RoundPolicy, RunSpec
from crossfed.outer import OuterConfig
from crossfed.train.schedule import LRSchedule
from crossfed.train.windows import read_meta

if TYPE_CHECKING:  # the site's modules import torchtitan: only a site job needs them
    from crossfed.site import SiteSettings


def run_spec(config: dict[str, Any], sites: dict[str, dict[str, Any]]) -> RunSpec:
    """The coordinator's view of this run; the data's meta.json fixes N and the vocabulary."""
    meta = read_meta(Path(config["data"]["dir"]))
    inner = config["inner"]
    return RunSpec(
        n_windows=int(meta["n_windows"]),
        block_size=config["data"]["block_size"],
        data_seed=config["data"]["seed"],
        flavour=config["model"]["flavour"],
        vocab_size=int(meta["vocab_size"]),
        seq_len=int(meta["seq_len"]),
        model_seed=config["model"]["seed"],
        inner_steps=inner["steps"],
        sites={name: site["ranks"] for name, site in sites.items()},
        outer=OuterConfig(**config["outer"]),
        schedule=LRSchedule(
            peak_lr=inner["lr"],
            warmup_steps=inner["warmup_steps"],
            total_steps=inner["steps"] * config["rounds"],
            min_lr_factor=inner["min_lr_factor"],
        ),
        rounds=RoundPolicy(**config["round_policy"]),
        leases=LeasePolicy(
            alpha=config["darl"]["alpha"],
            beta_rtt=config["darl"]["beta_rtt"],
            min_ttl_s=config["darl"]["min_ttl_s"],
            initial_ttl_s=config["darl"]["initial_ttl_s"],
        ),
    )


def site_settings(
    config: dict[str, Any], site_name: str, site: dict[str, Any], accumulation: int | None = None
) -> SiteSettings:
    """Settings of one site job; ``accumulation`` may come from the plan (filling the barrier)."""
    from crossfed.site import SiteSettings
    from crossfed.train.distributed import ParallelConfig
    from crossfed.train.inner import InnerConfig

    inner = config["inner"]
    return SiteSettings(
        site=site_name,
        data_dir=Path(config["data"]["dir"]),
        work_dir=Path(config["results"]) / "sites",
        block_size=config["data"]["block_size"],
        data_seed=config["data"]["seed"],
        inner=InnerConfig(
            micro_batch=site["micro_batch"],
            ranks=site["ranks"],
            accumulation=accumulation or site["accumulation"],
            weight_decay=inner["weight_decay"],
            grad_clip=inner["grad_clip"],
            slowdown=site["slowdown"],
            min_step_s=site["min_step_s"],
        ),
        heartbeat_s=config["darl"]["heartbeat_s"],
        inline_max_bytes=config["transport"]["inline_max_bytes"],
        compress=config["transport"]["compress"],
        error_feedback=config["transport"]["error_feedback"],
        device=config["model"]["device"],
        launcher=config["launcher"]["kind"],
        parallel=ParallelConfig(
            compile=config["model"]["compile"],
            activation_checkpointing=config["model"]["activation_checkpointing"],
        ),
        checkpoint_every=inner["checkpoint_every"],
        rounds=config["rounds"],
        lease_wait_s=config["darl"]["initial_ttl_s"]
        + config["round_policy"]["join_window_s"]
        + 30.0,
    )
