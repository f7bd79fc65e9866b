"""What a run is, as the coordinator knows it: block space, model, outer step, policies."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from crossfed import moments, rowcounts
from crossfed.darl.blockspace import BlockSpace, BlockSpaceError
from crossfed.flavours import flavour_error
from crossfed.outer_presets import DEFAULT_PRESET, OuterConfig
from crossfed.train.schedule import (
    DEFAULT_MIN_LR_FACTOR,
    LRSchedule,
    default_warmup_steps,
    round_steps,
)

if TYPE_CHECKING:
    from crossfed.config import RunConfig, SiteConfig


class RunSpecError(ValueError):
    """A run spec that is missing fields or has impossible values."""


@dataclass(frozen=True)
class RoundPolicy:
    """When a round closes (see ``crossfed.coordinator.rounds.close_decision``)."""

    join_window_s: float = 5.0
    deadline_s: float = 3600.0


@dataclass(frozen=True)
class LeasePolicy:
    """DARL lease sizing and TTL: TTL = max(min_ttl_s, alpha*t_step + beta_rtt*RTT).

    ``probe_share``: in a run of several sites, a site whose pace is not known yet (no step
    time, no commit: the first round, a late joiner) is granted this share of its phase, a
    short probe, so a lease sized blind never holds its round while faster sites wait;
    1.0 grants the phase whole (``LeaseBook.grant_size``).
    """

    alpha: float = 2.5
    beta_rtt: float = 2.0
    min_ttl_s: float = 10.0
    initial_ttl_s: float = 60.0
    probe_share: float = 0.25


@dataclass(frozen=True)
class RunSpec:
    """Everything the coordinator needs to serve one training run."""

    n_windows: int
    block_size: int
    data_seed: int
    flavour: str
    vocab_size: int
    seq_len: int
    model_seed: int
    inner_steps: int
    sites: dict[str, int]  # site name -> ranks
    outer: OuterConfig = field(default_factory=OuterConfig)
    schedule: LRSchedule = field(default_factory=LRSchedule)
    rounds: RoundPolicy = field(default_factory=RoundPolicy)
    leases: LeasePolicy = field(default_factory=LeasePolicy)
    #: the sites' AdamW second moment at a merge (``inner.second_moment``,
    #: :mod:`crossfed.moments`): ``shared`` or ``own``; None is not yet decided (a config
    #: that leaves it unset), resolved when the run is stored (:func:`resolve_unset`)
    second_moment: str | None = None
    #: how the outer step weights an embedding's rows (``outer.embedding_rows``,
    #: :mod:`crossfed.rowcounts`): ``counts`` or ``shares``; None is not yet decided,
    #: resolved when the run is stored (:func:`resolve_unset`)
    embedding_rows: str | None = None
    #: the first ``early_rounds`` rounds train ``early_steps`` inner steps each, the later
    #: ones ``inner_steps`` (``inner.early_rounds``; docs/quality.md, "Early rounds")
    early_rounds: int = 0
    early_steps: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def round_steps(self, round_no: int) -> int:
        """H of round ``round_no``: the inner steps each site trains in it."""
        return round_steps(self.inner_schedule(), round_no)

    def inner_schedule(self) -> dict[str, int]:
        """What a site needs to size any round's phase (:meth:`round_steps`)."""
        return {
            "steps": self.inner_steps,
            "early_rounds": self.early_rounds,
            "early_steps": self.early_steps,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        try:
            spec = cls(
                n_windows=int(data["n_windows"]),
                block_size=int(data["block_size"]),
                data_seed=int(data["data_seed"]),
                flavour=str(data["flavour"]),
                vocab_size=int(data["vocab_size"]),
                seq_len=int(data["seq_len"]),
                model_seed=int(data["model_seed"]),
                inner_steps=int(data["inner_steps"]),
                sites={str(k): int(v) for k, v in dict(data["sites"]).items()},
                outer=OuterConfig(**data.get("outer", {})),
                schedule=LRSchedule(**data.get("schedule", {})),
                rounds=RoundPolicy(**data.get("rounds", {})),
                leases=LeasePolicy(**data.get("leases", {})),
                # a run stored before the setting existed kept each site's own
                second_moment=data.get("second_moment", moments.LEGACY_MODE),
                # a run stored before the setting existed weighted every row by token shares
                embedding_rows=data.get("embedding_rows", rowcounts.LEGACY_MODE),
                # a run stored before early rounds existed has none
                early_rounds=int(data.get("early_rounds", 0)),
                early_steps=int(data.get("early_steps", 0)),
            )
        except KeyError as exc:
            raise RunSpecError(f"run spec is missing field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise RunSpecError(f"run spec has a bad value: {exc}") from exc
        if spec.n_windows < 1 or spec.block_size < 1:
            raise RunSpecError("n_windows and block_size must be positive")
        try:  # the block space the coordinator will build, checked before anything is stored
            BlockSpace(spec.n_windows, spec.block_size, spec.data_seed)
        except BlockSpaceError as exc:
            raise RunSpecError(f"block space: {exc}") from exc
        if spec.inner_steps < 1:
            raise RunSpecError("inner_steps (H) must be >= 1")
        if spec.early_rounds < 0:
            raise RunSpecError(f"early_rounds must be >= 0, got {spec.early_rounds}")
        if spec.early_rounds and spec.early_steps < 1:
            raise RunSpecError(
                f"early_steps must be >= 1 with early_rounds {spec.early_rounds}, "
                f"got {spec.early_steps}"
            )
        if not spec.sites:
            raise RunSpecError("a run needs at least one site")
        warmup = spec.schedule.warmup_steps
        if warmup is not None and (type(warmup) is not int or warmup < 0):
            raise RunSpecError(f"schedule.warmup_steps must be an integer >= 0, got {warmup!r}")
        floor = spec.schedule.min_lr_factor
        if floor is not None and (
            type(floor) not in (int, float) or not 0.0 <= floor <= 1.0  # bool is no number
        ):
            raise RunSpecError(f"schedule.min_lr_factor must be a number in [0, 1], got {floor!r}")
        share = spec.leases.probe_share
        if not 0.0 < share <= 1.0:
            raise RunSpecError(f"leases.probe_share must be in (0, 1], got {share}")
        if spec.second_moment is not None and spec.second_moment not in moments.MODES:
            raise RunSpecError(
                f"second_moment must be one of {', '.join(moments.MODES)}, "
                f"got {spec.second_moment!r}"
            )
        if spec.embedding_rows is not None and spec.embedding_rows not in rowcounts.MODES:
            raise RunSpecError(
                f"embedding_rows must be one of {', '.join(rowcounts.MODES)}, "
                f"got {spec.embedding_rows!r}"
            )
        problem = flavour_error(spec.flavour)
        if problem:
            raise RunSpecError(f"flavour: {problem}")
        return spec


def resolve_unset(spec: RunSpec, existing: RunSpec | None) -> RunSpec:
    """``spec`` with every setting its config may leave unset (None) decided: its outer
    preset, its second-moment mode, its embedding rows' weighting, its warmup and its
    learning-rate floor. One left unset takes the existing run's, or for a new run the
    default (:data:`~crossfed.outer_presets.DEFAULT_PRESET`, :data:`~crossfed.moments.DEFAULT_MODE`,
    :data:`~crossfed.rowcounts.DEFAULT_MODE`,
    :func:`~crossfed.train.schedule.default_warmup_steps` of the run's length and
    :data:`~crossfed.train.schedule.DEFAULT_MIN_LR_FACTOR`).

    So a changed default never changes a run in progress: a run keeps the settings it was
    created with when its config leaves ``outer.preset``, ``inner.second_moment``,
    ``outer.embedding_rows``, ``inner.warmup_steps`` or ``inner.min_lr_factor`` unset, and a
    run extended by more rounds keeps the warmup its first length gave it.
    """
    if spec.outer.preset is None:
        preset = existing.outer.preset if existing is not None else DEFAULT_PRESET
        spec = replace(spec, outer=replace(spec.outer, preset=preset))
    if spec.second_moment is None:
        mode = existing.second_moment if existing is not None else moments.DEFAULT_MODE
        spec = replace(spec, second_moment=mode)
    if spec.embedding_rows is None:
        rows = existing.embedding_rows if existing is not None else rowcounts.DEFAULT_MODE
        spec = replace(spec, embedding_rows=rows)
    if spec.schedule.warmup_steps is None:
        warmup = (
            existing.schedule.warmup_steps
            if existing is not None
            else default_warmup_steps(spec.schedule.total_steps)
        )
        spec = replace(spec, schedule=replace(spec.schedule, warmup_steps=warmup))
    if spec.schedule.min_lr_factor is None:
        floor = existing.schedule.min_lr_factor if existing is not None else DEFAULT_MIN_LR_FACTOR
        spec = replace(spec, schedule=replace(spec.schedule, min_lr_factor=floor))
    return spec


#: the only field a rerun may change on an existing run: more rounds lengthen the schedule
EXTENSIBLE = ("schedule.total_steps",)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out.update(_flatten(inner, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def differences(old: RunSpec, new: RunSpec) -> dict[str, tuple[Any, Any]]:
    """Dotted field name -> (old, new) for every field where the two specs differ."""
    before, after = _flatten(old.to_dict()), _flatten(new.to_dict())
    return {
        name: (before.get(name), after.get(name))
        for name in sorted(set(before) | set(after))
        if before.get(name) != after.get(name)
    }


def describe(changes: dict[str, tuple[Any, Any]]) -> str:
    """``a.b: 1 -> 2, c: x -> y`` for an error message."""
    return ", ".join(f"{name}: {old!r} -> {new!r}" for name, (old, new) in changes.items())


def schedule_steps(rounds: int, inner_steps: int, early_rounds: int, early_steps: int) -> int:
    """Inner steps of a run of ``rounds`` rounds whose first ``early_rounds`` train
    ``early_steps`` each and the rest ``inner_steps``: its LR schedule's length."""
    early = min(rounds, early_rounds)
    return early * early_steps + (rounds - early) * inner_steps


def run_spec(config: RunConfig, sites: Mapping[str, SiteConfig]) -> RunSpec:
    """The coordinator's view of a validated run config; the data's meta.json fixes N and the
    vocabulary (``crossfed run init`` sends it, a rerun compares against it)."""
    from pathlib import Path

    from crossfed.data.windows import read_meta

    meta = read_meta(Path(config.data.dir))
    inner, outer, darl = config.inner, config.outer, config.darl
    early_steps = inner.early_steps if inner.early_rounds else 0  # none: as runs before them
    return RunSpec(
        n_windows=int(meta["n_windows"]),
        block_size=config.data.block_size,
        data_seed=config.data.seed,
        flavour=config.model.flavour,
        vocab_size=int(meta["vocab_size"]),
        seq_len=int(meta["seq_len"]),
        model_seed=config.model.seed,
        inner_steps=inner.steps,
        sites={name: site.ranks for name, site in sites.items()},
        outer=OuterConfig(
            eta=outer.eta,
            beta=outer.beta,
            solo_full_step=outer.solo_full_step,
            preset=outer.preset,
        ),
        schedule=LRSchedule(
            peak_lr=inner.lr,
            warmup_steps=inner.warmup_steps,
            total_steps=schedule_steps(config.rounds, inner.steps, inner.early_rounds, early_steps),
            min_lr_factor=inner.min_lr_factor,
        ),
        rounds=RoundPolicy(
            join_window_s=config.round_policy.join_window_s,
            deadline_s=config.round_policy.deadline_s,
        ),
        leases=LeasePolicy(
            alpha=darl.alpha,
            beta_rtt=darl.beta_rtt,
            min_ttl_s=darl.min_ttl_s,
            initial_ttl_s=darl.initial_ttl_s,
            probe_share=darl.probe_share,
        ),
        second_moment=inner.second_moment,
        embedding_rows=outer.embedding_rows,
        early_rounds=inner.early_rounds,
        early_steps=early_steps,
    )
