"""From a validated run config to the objects the coordinator and a site job run with."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from crossfed.coordinator.runspec import LeasePolicy, RoundPolicy, RunSpec
from crossfed.outer import OuterConfig
from crossfed.sched.sites import SiteConfig
from crossfed.train.schedule import LRSchedule
from crossfed.train.windows import read_meta


def run_spec(config: dict[str, Any], sites: Mapping[str, SiteConfig]) -> RunSpec:
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
        sites={name: site.ranks for name, site in sites.items()},
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
