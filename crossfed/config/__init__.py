"""The run's configuration, the bottom layer every other package reads it from.

``schema``: YAML validated against workflow/schemas/ (defaults filled in); ``run``: the run
config as one typed tree, ``RunConfig``; ``sites``: the run's one site type, ``SiteConfig``;
``durations``: Slurm time limits; ``load``: the run config and its sites, read and checked
across each other. Imports neither torch nor a crossfed package above it.
"""

from crossfed.config.durations import (
    SlurmDurationError,
    format_slurm_duration,
    parse_slurm_duration,
)
from crossfed.config.load import (
    check_model,
    check_run,
    load_run_config,
    load_sites,
    validate_run_config,
)
from crossfed.config.run import (
    BlobsSection,
    ChainSection,
    ConnectivitySection,
    CoordinatorSection,
    DarlSection,
    DataSection,
    EvalSection,
    InnerSection,
    LauncherSection,
    ModelSection,
    OuterSection,
    OverlapSection,
    RoundPolicySection,
    RunConfig,
    S3Section,
    Section,
    SoftwareSection,
    TransportSection,
    dumps,
)
from crossfed.config.schema import SCHEMAS, ConfigError, read_yaml, validate
from crossfed.config.sites import (
    Shape,
    SiteConfig,
    SitesConfigError,
    SitesFile,
    load_sites_yaml,
    parse_site,
    parse_sites,
    read_sites,
    read_sites_file,
)

__all__ = [
    "SCHEMAS",
    "BlobsSection",
    "ChainSection",
    "ConfigError",
    "ConnectivitySection",
    "CoordinatorSection",
    "DarlSection",
    "DataSection",
    "EvalSection",
    "InnerSection",
    "LauncherSection",
    "ModelSection",
    "OuterSection",
    "OverlapSection",
    "RoundPolicySection",
    "RunConfig",
    "S3Section",
    "Section",
    "Shape",
    "SiteConfig",
    "SitesConfigError",
    "SitesFile",
    "SlurmDurationError",
    "SoftwareSection",
    "TransportSection",
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
    "read_sites",
    "read_sites_file",
    "read_yaml",
    "validate",
    "validate_run_config",
]
