"""The run config as one typed tree: a frozen dataclass per section of
``workflow/schemas/config.schema.yaml`` under :class:`RunConfig`.

The tree is built once, from the mapping the schema validated (its defaults filled in): the
schema stays the one source of defaults and rules, so no field has a default here.
``as_dict`` gives the mapping back for what needs one (a stored config, a digest).
tests/unit/test_config_tree.py keeps the fields equal to the schema's properties.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import cache
from typing import Any, ClassVar, Self, get_origin, get_type_hints

from crossfed.config.schema import ConfigError


class Section:
    """A part of the run config: a frozen dataclass whose fields are its schema's properties."""

    #: keys the schema neither requires nor defaults: None here, left out of ``as_dict``
    ABSENT: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "") -> Self:
        """The section of a schema-validated mapping; nested sections are built too."""
        values: dict[str, Any] = {}
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"{where or '(top level)'}: unknown keys {unknown}")
        for f in fields(cls):
            kind = _hints(cls)[f.name]
            if f.name not in data:
                if f.name not in cls.ABSENT:
                    raise ConfigError(f"{where or '(top level)'}: missing key {f.name!r}")
                values[f.name] = None
            elif isinstance(kind, type) and issubclass(kind, Section):
                inner = f"{where}/{f.name}" if where else f.name
                values[f.name] = kind.from_mapping(data[f.name], inner)
            elif get_origin(kind) is tuple:
                values[f.name] = tuple(data[f.name])
            else:
                values[f.name] = data[f.name]
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """The mapping this section was built from (lists for tuples)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in self.ABSENT:
                continue
            if isinstance(value, Section):
                value = value.as_dict()
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


@dataclass(frozen=True)
class SoftwareSection(Section):
    """How Slurm jobs find crossfed on the compute nodes."""

    container: str | None
    modules: tuple[str, ...]


@dataclass(frozen=True)
class ConnectivitySection(Section):
    """How a site's compute nodes reach the coordinator."""

    https_proxy: str | None
    no_proxy: str


@dataclass(frozen=True)
class ChainSection(Section):
    """Several rounds per Slurm allocation."""

    margin_s: float
    round_prior_s: float | None
    max_jobs: int


@dataclass(frozen=True)
class ModelSection(Section):
    """The model: flavour, initial weights, device and torchtitan's options."""

    flavour: str
    seed: int
    device: str
    compile: bool
    activation_checkpointing: str


@dataclass(frozen=True)
class LauncherSection(Section):
    """How a site job runs its W ranks."""

    kind: str
    command: str
    nnodes: int
    rdzv_endpoint: str | None


@dataclass(frozen=True)
class DataSection(Section):
    """The corpus, the tokenizer, the window store and the block permutation."""

    dir: str
    inputs: tuple[str, ...]
    tokenizer: str | None
    vocab_size: int
    seq_len: int
    val_fraction: float
    shards: int
    prepare_jobs: int
    block_size: int
    seed: int


@dataclass(frozen=True)
class InnerSection(Section):
    """The inner phase: H AdamW steps (fewer in the early rounds), the LR schedule and
    checkpoints."""

    steps: int
    early_rounds: int
    early_steps: int
    lr: float
    warmup_steps: int | None
    min_lr_factor: float | None
    weight_decay: float
    grad_clip: float
    second_moment: str | None
    checkpoint_every: int
    checkpoint_background: bool


@dataclass(frozen=True)
class OuterSection(Section):
    """The outer step's preset and its settings."""

    preset: str | None
    eta: float
    beta: float
    solo_full_step: bool
    embedding_rows: str | None


@dataclass(frozen=True)
class DarlSection(Section):
    """DARL leases: TTL, the probe share and heartbeats."""

    alpha: float
    beta_rtt: float
    min_ttl_s: float
    initial_ttl_s: float
    probe_share: float
    heartbeat_s: float


@dataclass(frozen=True)
class RoundPolicySection(Section):
    """When a round closes."""

    join_window_s: float
    deadline_s: float


@dataclass(frozen=True)
class TransportSection(Section):
    """How deltas and models travel: inline limit, parts, streams and the codec."""

    inline_max_bytes: int
    part_bytes: int
    streams: int
    stream_min_bytes: int
    compress: str
    error_feedback: bool


@dataclass(frozen=True)
class OverlapSection(Section):
    """Overlapped rounds and their fold-in rule."""

    enabled: bool
    rule: str
    alpha: float
    max_stale: float
    stale_burst: float
    stale_weight: float


@dataclass(frozen=True)
class EvalSection(Section):
    """Evaluations of the global models."""

    max_windows: int
    batch: int
    device: str


@dataclass(frozen=True)
class CoordinatorSection(Section):
    """Where the coordinator is, its state and secrets, and the embedded one's address."""

    url: str
    state_dir: str
    secrets: str
    host: str
    port: int
    max_request_s: float


#: ``blobs.s3.merge_worker`` for a merge worker beside the embedded coordinator (the local
#: profile starts it); otherwise the setting is a worker's URL
EMBEDDED_WORKER = "embedded"


@dataclass(frozen=True)
class S3Section(Section):
    """The S3-compatible store of ``blobs.backend: s3``."""

    ABSENT: ClassVar[tuple[str, ...]] = ("endpoint", "bucket", "merge_worker")

    endpoint: str | None
    bucket: str | None
    region: str
    prefix: str
    url_expiry_s: float
    part_bytes: int
    merge_worker: str | None


@dataclass(frozen=True)
class BlobsSection(Section):
    """Where deltas and global models live."""

    backend: str
    s3: S3Section


@dataclass(frozen=True)
class RunConfig(Section):
    """One pooled pre-training run: the validated ``config.yaml`` (and overrides), typed."""

    run_name: str
    rounds: int
    results: str
    sites_file: str
    sites: tuple[str, ...]
    here: tuple[str, ...]
    software: SoftwareSection
    connectivity: ConnectivitySection
    chain: ChainSection
    model: ModelSection
    launcher: LauncherSection
    data: DataSection
    inner: InnerSection
    outer: OuterSection
    darl: DarlSection
    round_policy: RoundPolicySection
    transport: TransportSection
    overlap: OverlapSection
    eval: EvalSection
    coordinator: CoordinatorSection
    blobs: BlobsSection

    def tokens_per_round(self, windows_per_step: int) -> int:
        """Tokens one site trains in one round: H * seq_len * (B * W * A windows a step)."""
        return int(self.inner.steps) * int(self.data.seq_len) * windows_per_step


def dumps(config: RunConfig | Mapping[str, Any]) -> str:
    """Stable JSON of a config, for digests and logs."""
    data = config.as_dict() if isinstance(config, RunConfig) else dict(config)
    return json.dumps(data, sort_keys=True)
