"""The run's config and its sites, read, validated and checked across each other."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from crossfed.config.run import RunConfig
from crossfed.config.schema import ConfigError, read_yaml, validate
from crossfed.config.sites import SiteConfig, read_sites
from crossfed.flavours import flavour_error


def check_model(config: RunConfig, source: str) -> None:
    """Refuse a model flavour crossfed cannot build (checked without importing torch)."""
    problem = flavour_error(config.model.flavour)
    if problem:
        raise ConfigError(f"{source}: model/flavour: {problem}")


def check_run(config: RunConfig, sites: Mapping[str, SiteConfig]) -> None:
    """Checks across the validated run config and its sites, made when the workflow is read."""
    check_model(config, "workflow config")
    unknown = sorted(set(config.here) - set(sites))
    if unknown:
        raise ConfigError(
            f"config 'here' names unknown sites {unknown}; the run's sites are {list(sites)}"
        )


def validate_run_config(data: Mapping[str, Any], source: str) -> tuple[dict[str, Any], RunConfig]:
    """A run config's mapping validated (defaults filled in), and the typed tree built from it."""
    mapping = validate(dict(data), "config.schema.yaml", source)
    config = RunConfig.from_mapping(mapping)
    check_model(config, source)
    return mapping, config


def load_run_config(path: Path | None, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """The run config with defaults; ``overrides`` are merged on top (like ``--config k=v``)."""
    data = read_yaml(path) if path else {}
    for key, value in (overrides or {}).items():
        data[key] = value
    return validate_run_config(data, str(path or "config"))[1]


def load_sites(config: RunConfig) -> dict[str, SiteConfig]:
    """The participating sites from ``config.sites_file``, validated, in file order.

    Each is a :class:`crossfed.config.SiteConfig`, the run's one site type: typed
    fields, and the schema-validated mapping (defaults filled in) it was built from.
    """
    path = Path(config.sites_file)
    sites = read_sites(path).sites
    wanted = list(config.sites) or list(sites)
    unknown = [name for name in wanted if name not in sites]
    if unknown:
        raise ConfigError(f"config 'sites' names unknown sites {unknown}; {path} has {list(sites)}")
    return {name: sites[name] for name in wanted}
