"""The run's configuration, the bottom layer every other package reads it from.

``schema``: YAML validated against workflow/schemas/ (defaults filled in); ``sites``: the
run's one site type, ``SiteConfig``; ``durations``: Slurm time limits; ``load``: the run
config and its sites, checked across each other. Imports neither torch nor another crossfed
package above it.
"""

from crossfed.config.durations import (
    SlurmDurationError,
    format_slurm_duration,
    parse_slurm_duration,
)
from crossfed.config.load import (
    check_model,
    check_run,
    dumps,
    load_run_config,
    load_sites,
    tokens_per_round,
)
from crossfed.config.schema import SCHEMAS, ConfigError, read_yaml, validate
from crossfed.config.sites import (
    Shape,
    SiteConfig,
    SitesConfigError,
    load_sites_yaml,
    parse_site,
    parse_sites,
    read_sites_file,
)

__all__ = [
    "SCHEMAS",
    "ConfigError",
    "Shape",
    "SiteConfig",
    "SitesConfigError",
    "SlurmDurationError",
    "check_model",
    "check_run",
    "dumps",
    "format_slurm_duration",
    "load_run_config",
    "load_sites",
    "load_sites_yaml",
    "parse_site",
    "parse_sites",
    "parse_slurm_duration",
    "read_sites_file",
    "read_yaml",
    "tokens_per_round",
    "validate",
]
