"""What a rerun of the workflow may change about a run in progress, checked when it is read.

A run's finished rounds are history: their data, model, sites and outer settings are fixed
when the run is created. A rerun may add rounds (``rounds`` up: the learning-rate schedule
follows the longer run) and change what only the coming rounds use (a site's accumulation,
shapes, walltime, the evaluation batch, ...). A change that would give the finished rounds
another meaning (other data, another block space, another model or set of sites) is refused
here, before Snakemake plans a job, with a message that says what to do; so no rerun ever
replans a finished round or deletes what the coordinator accepted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from crossfed.config import ConfigError

if TYPE_CHECKING:
    from crossfed.config import RunConfig, SiteConfig

_NEW_RUN = (
    "to train with these settings, start a new run in another results directory "
    "(a copy of the config with `results`, `data.dir` and `coordinator.state_dir` under a "
    "new folder), or put the setting back as the run has it"
)


def data_changes(config: RunConfig) -> list[str]:
    """How the config's data settings differ from the data prepared in ``data.dir``.

    Empty when nothing is prepared yet or the preparation matches. Input shards are compared
    by name (hashing a large corpus at every workflow read would take minutes); a given
    tokenizer by its digest.
    """
    data = config.data
    meta_path = Path(data.dir) / "meta.json"
    if not meta_path.exists():
        return []
    from crossfed.data.corpus import CorpusError, resolve_inputs
    from crossfed.data.prepare import preparation_params, sha256_file

    meta = json.loads(meta_path.read_text())
    inputs, tokenizer = data.inputs, data.tokenizer
    wanted = preparation_params(
        embedded=not inputs,
        trained=tokenizer is None,
        vocab_size=data.vocab_size,
        seq_len=data.seq_len,
        val_fraction=data.val_fraction,
        shards=data.shards,
    )
    had = meta.get("params", {})
    changes = [
        f"data.{_setting(key)}: prepared with {had.get(key)!r}, config says {value!r}"
        for key, value in wanted.items()
        if key != "python" and had.get(key) != value
    ]
    if inputs:
        try:
            names = [p.name for p in resolve_inputs([Path(p) for p in inputs])]
        except CorpusError as exc:
            changes.append(f"data.inputs: {exc}")
        else:
            if had.get("corpus") == "inputs" and names != meta.get("source"):
                changes.append(
                    f"data.inputs: prepared from {_few(meta.get('source', []))}, config gives "
                    f"{_few(names)}"
                )
    if tokenizer and had.get("tokenizer") == "given":
        path = Path(tokenizer)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            changes.append(f"data.tokenizer: {path}: no such file")
        elif sha256_file(path) != meta.get("tokenizer_sha256"):
            changes.append(f"data.tokenizer: {path} is not the tokenizer the data were made with")
    return changes


def _setting(key: str) -> str:
    return {"corpus": "inputs", "tokenizer": "tokenizer"}.get(key, key)


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return f"[{shown}{', ...' if len(names) > 3 else ''}] ({len(names)} shards)"


def check_rerun(config: RunConfig, sites: Mapping[str, SiteConfig]) -> None:
    """Refuse a config that would change a run in progress other than by adding rounds."""
    results = Path(config.results)
    changed = data_changes(config)
    if changed:
        raise ConfigError(
            f"{config.data.dir} holds the data this run was prepared from, and this "
            f"config asks for other data: {'; '.join(changed)}. Nothing was changed; " + _NEW_RUN
        )
    run_path = results / "run.json"
    if not run_path.exists():
        return
    from crossfed.coordinator.runspec import (
        EXTENSIBLE,
        RunSpec,
        describe,
        differences,
        resolve_unset,
        run_spec,
    )

    recorded = RunSpec.from_dict(json.loads(run_path.read_text())["spec"])
    changes = differences(recorded, resolve_unset(run_spec(config, dict(sites)), recorded))
    refused = {name: change for name, change in changes.items() if name not in EXTENSIBLE}
    if refused:
        raise ConfigError(
            f"{run_path} records a run that this config would change ({describe(refused)}); "
            "a run in progress keeps its data, model, sites and outer settings (more rounds "
            "are fine). Nothing was changed; " + _NEW_RUN
        )
    done = rounds_closed(results)
    if config.rounds < done:
        raise ConfigError(
            f"rounds: {config.rounds}, but this run has closed {done} rounds already "
            f"(results/rounds/*/merge.json); a run can be extended, not shortened. Nothing "
            f"was changed; give rounds >= {done}"
        )


def rounds_closed(results: Path) -> int:
    """The highest round whose merge the workflow has recorded."""
    closed = [int(p.parent.name) for p in results.glob("rounds/*/merge.json")]
    return max(closed, default=0)
