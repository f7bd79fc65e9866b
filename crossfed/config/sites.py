"""The run's sites (``config/sites.yaml``): one type, ``SiteConfig``, for every part.

``read_sites`` is the one loader of a sites file: it validates the file against
``workflow/schemas/sites.schema.yaml`` (defaults filled in) and builds each site's
``SiteConfig`` with ``parse_site``, which adds the checks across keys. Pure (file reads aside).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from crossfed.config.durations import SlurmDurationError, parse_slurm_duration
from crossfed.config.schema import SCHEMAS, ConfigError, validate


class SitesConfigError(ConfigError):
    """config/sites.yaml is missing, unreadable or does not match its schema."""


@dataclass(frozen=True)
class Shape:
    """A job shape: partition, node count, GPUs per node and walltime."""

    name: str
    partition: str
    nodes: int
    gpus_per_node: int
    walltime_s: float

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class SiteConfig(Mapping[str, Any]):
    """One site of ``config/sites.yaml``: typed fields, and the validated mapping itself.

    The run's one site type: the planner and probes read the fields, the workflow and the
    site jobs may also read it as the mapping it was validated as (``site["ranks"]``,
    ``site.get("transport")``; the schema's defaults filled in).
    """

    name: str
    ranks: int
    micro_batch: int
    accumulation: int
    tokens_per_s_per_gpu: float
    scheduler: str = "none"
    rtt_ms: float = 0.0
    max_walltime_s: float = math.inf
    qos_max_nodes: int = 1
    account: str | None = None
    shapes: tuple[Shape, ...] = ()
    slowdown: float = 1.0  # local simulation only
    min_step_s: float = 0.0  # local simulation only
    transport: str = "direct"
    streams: int | None = None  # None: the config's transport.streams
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    @property
    def has_scheduler(self) -> bool:
        return self.scheduler != "none"

    def shape(self, name: str) -> Shape | None:
        return next((s for s in self.shapes if s.name == name), None)


def _need(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise SitesConfigError(f"{where}: missing required key {key!r}")
    return d[key]


def _num(value: Any, key: str, where: str, *, integer: bool = False, minimum: float = 0) -> Any:
    if isinstance(value, str) and not integer:  # YAML 1.1 reads ``1.2e4`` as a string
        try:
            value = float(value)
        except ValueError:
            pass
    ok_type = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_type):
        kind = "an integer" if integer else "a number"
        raise SitesConfigError(f"{where}: {key!r} must be {kind}, got {value!r}")
    if value < minimum or (not integer and not math.isfinite(value)):
        raise SitesConfigError(f"{where}: {key!r} must be >= {minimum}, got {value!r}")
    return value


def _parse_shape(raw: Any, where: str) -> Shape:
    if not isinstance(raw, Mapping):
        raise SitesConfigError(f"{where}: a shape must be a mapping, got {raw!r}")
    name = str(_need(raw, "name", where))
    where = f"{where} {name!r}"
    wall = _need(raw, "walltime", where)
    try:
        wall_s = parse_slurm_duration(wall)
    except SlurmDurationError as exc:
        raise SitesConfigError(f"{where}: walltime: {exc}") from exc
    if wall_s is None or wall_s <= 0:
        raise SitesConfigError(f"{where}: walltime must be a finite positive duration")
    return Shape(
        name=name,
        partition=str(_need(raw, "partition", where)),
        nodes=_num(_need(raw, "nodes", where), "nodes", where, integer=True, minimum=1),
        gpus_per_node=_num(raw.get("gpus_per_node", 0), "gpus_per_node", where, integer=True),
        walltime_s=wall_s,
    )


def parse_site(name: str, raw: Any) -> SiteConfig:
    """Validate one site mapping; unknown keys are kept in ``extra``."""
    where = f"sites.{name}"
    if not isinstance(raw, Mapping):
        raise SitesConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    scheduler = str(raw.get("scheduler", "none")).lower()
    if scheduler not in {"none", "slurm"}:
        raise SitesConfigError(f"{where}: scheduler must be 'none' or 'slurm', got {scheduler!r}")
    shapes_raw = raw.get("shapes") or []
    if not isinstance(shapes_raw, list):
        raise SitesConfigError(f"{where}: shapes must be a list")
    shapes = tuple(_parse_shape(s, f"{where}.shapes[{i}]") for i, s in enumerate(shapes_raw))
    names = [s.name for s in shapes]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SitesConfigError(f"sites/{name}/shapes: shape names used twice: {twice}")
    if scheduler == "slurm" and not shapes:
        raise SitesConfigError(f"{where}: a slurm site needs at least one shape")
    max_wall_h = raw.get("max_walltime_h")
    max_wall = math.inf
    if max_wall_h is not None:
        max_wall = _num(max_wall_h, "max_walltime_h", where) * 3600.0
    elif scheduler == "slurm":
        raise SitesConfigError(f"{where}: missing required key 'max_walltime_h'")
    qos_default = None if scheduler == "slurm" else 1
    qos = raw.get("qos_max_nodes", qos_default)
    if qos is None:
        raise SitesConfigError(f"{where}: missing required key 'qos_max_nodes'")
    account = raw.get("account")
    known = {
        "ranks",
        "micro_batch",
        "accumulation",
        "rtt_ms",
        "scheduler",
        "max_walltime_h",
        "qos_max_nodes",
        "tokens_per_s_per_gpu",
        "account",
        "shapes",
        "slowdown",
        "min_step_s",
        "transport",
        "streams",
    }
    streams = raw.get("streams")
    return SiteConfig(
        name=name,
        ranks=_num(_need(raw, "ranks", where), "ranks", where, integer=True, minimum=1),
        micro_batch=_num(
            _need(raw, "micro_batch", where), "micro_batch", where, integer=True, minimum=1
        ),
        accumulation=_num(
            raw.get("accumulation", 1), "accumulation", where, integer=True, minimum=1
        ),
        tokens_per_s_per_gpu=float(
            _num(_need(raw, "tokens_per_s_per_gpu", where), "tokens_per_s_per_gpu", where)
        ),
        scheduler=scheduler,
        rtt_ms=float(_num(raw.get("rtt_ms", 0), "rtt_ms", where)),
        max_walltime_s=float(max_wall),
        qos_max_nodes=_num(qos, "qos_max_nodes", where, integer=True, minimum=1),
        account=None if account in (None, "") else str(account),
        shapes=shapes,
        slowdown=float(_num(raw.get("slowdown", 1.0), "slowdown", where, minimum=1)),
        min_step_s=float(_num(raw.get("min_step_s", 0.0), "min_step_s", where)),
        transport=str(raw.get("transport", "direct")),
        streams=None
        if streams is None
        else _num(streams, "streams", where, integer=True, minimum=1),
        extra={k: v for k, v in raw.items() if k not in known},
        raw=dict(raw),
    )


def parse_sites(data: Any, *, source: str = "sites config") -> dict[str, SiteConfig]:
    """Each site of a loaded sites mapping built into its ``SiteConfig`` (``read_sites``
    checks the file against the schema first)."""
    if not isinstance(data, Mapping) or not isinstance(data.get("sites"), Mapping):
        raise SitesConfigError(f"{source}: expected a top-level 'sites:' mapping")
    if not data["sites"]:
        raise SitesConfigError(f"{source}: 'sites:' is empty")
    return {str(n): parse_site(str(n), raw) for n, raw in data["sites"].items()}


def load_sites_yaml(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a sites.yaml, with clear errors for a missing or broken file."""
    p = Path(path)
    if not p.is_file():
        raise SitesConfigError(f"sites config not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise SitesConfigError(f"{p}: invalid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise SitesConfigError(f"{p}: expected a mapping at the top level")
    return dict(data)


@dataclass(frozen=True)
class SitesFile:
    """A sites file, validated: its sites in file order, and its ``planner:`` defaults."""

    sites: dict[str, SiteConfig]
    planner: dict[str, Any]


def _sites_schema(keep_unknown_keys: bool) -> dict[str, Any]:
    schema = yaml.safe_load((SCHEMAS / "sites.schema.yaml").read_text())
    if keep_unknown_keys:
        schema["properties"]["sites"]["additionalProperties"]["additionalProperties"] = True
    return schema


def read_sites(path: str | Path, *, keep_unknown_keys: bool = False) -> SitesFile:
    """The one loader of a sites file: read, checked against the sites schema (defaults
    filled in), and each site built into a :class:`SiteConfig`.

    A site's key the schema does not know is refused (naming the likely key), or, with
    ``keep_unknown_keys``, kept in the site's ``extra``: the scheduler's command-line tools
    read files written for other versions. Every problem is one ``SitesConfigError``.
    """
    raw = load_sites_yaml(path)
    if not isinstance(raw.get("sites"), Mapping):
        raise SitesConfigError(f"{path}: expected a top-level 'sites:' mapping")
    try:
        data = validate(raw, _sites_schema(keep_unknown_keys), str(path))
    except ConfigError as exc:
        raise SitesConfigError(str(exc)) from exc
    try:
        sites = parse_sites(data, source=str(path))
    except SitesConfigError as exc:
        raise SitesConfigError(f"{path}: {exc}") from exc
    return SitesFile(sites=sites, planner=dict(data.get("planner") or {}))


def read_sites_file(path: str | Path) -> dict[str, SiteConfig]:
    """The sites of a sites file given to the scheduler's tools (``crossfed probe`` and
    ``crossfed plan``'s ``--sites``): schema-checked as a run's are, a site's unknown keys
    kept in ``extra``."""
    return read_sites(path, keep_unknown_keys=True).sites
