"""The typed run config (crossfed.config.RunConfig) and the JSON schema cannot drift apart:
the same keys at every level, types that follow the schema's, the schema's defaults."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any, get_type_hints

import pytest
import yaml

from crossfed.config import (
    ConfigError,
    RunConfig,
    Section,
    load_run_config,
    read_yaml,
    validate,
    validate_run_config,
)
from tests.conftest import REPO

SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
SCALARS: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "null": type(None),
}


def expected_type(schema: dict[str, Any]) -> Any:
    """The Python type a schema property maps to (sections aside)."""
    kinds = schema.get("type")
    if kinds is None:  # an enum alone: its values' types
        kinds = sorted({"null" if v is None else "string" for v in schema["enum"]})
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    if kinds == ["array"]:
        item = SCALARS[schema["items"]["type"]]
        return tuple[item, ...]
    kind = SCALARS[kinds[0]]
    for other in kinds[1:]:
        kind = kind | SCALARS[other]
    return kind


def sections(cls: type[Section] = RunConfig, schema: dict[str, Any] = SCHEMA, where: str = ""):
    """Every (section class, its schema, its path) of the tree, the top one first."""
    yield cls, schema, where or "(top level)"
    hints = get_type_hints(cls)
    for name, sub in schema["properties"].items():
        if sub.get("type") == "object":
            yield from sections(hints[name], sub, f"{where}{name}/")


def test_every_section_has_exactly_the_schema_properties_in_order() -> None:
    seen = 0
    for cls, schema, where in sections():
        assert [f.name for f in fields(cls)] == list(schema["properties"]), where
        seen += 1
    assert seen == 17  # the top level, its 15 sections and blobs/s3


def test_every_field_has_the_type_the_schema_gives() -> None:
    for cls, schema, where in sections():
        hints = get_type_hints(cls)
        for name, sub in schema["properties"].items():
            if sub.get("type") == "object":
                assert isinstance(hints[name], type) and issubclass(hints[name], Section)
                assert sub.get("additionalProperties") is False, f"{where}{name}"
                continue
            wanted = expected_type(sub)
            if name in cls.ABSENT:  # no default: left out, None here
                wanted = wanted | None
            assert hints[name] == wanted, f"{where}{name}: {hints[name]} != {wanted}"


def test_only_keys_without_a_default_may_be_absent() -> None:
    for cls, schema, where in sections():
        no_default = [k for k, sub in schema["properties"].items() if "default" not in sub]
        assert list(cls.ABSENT) == no_default, where
        assert not set(cls.ABSENT) & set(schema.get("required", [])), where


def defaults(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema's defaults, section by section, as the tree holds them."""
    out: dict[str, Any] = {}
    for name, sub in schema["properties"].items():
        if sub.get("type") == "object":
            out[name] = defaults(sub)
        elif "default" in sub:
            value = sub["default"]
            out[name] = tuple(value) if isinstance(value, list) else value
        else:
            out[name] = None
    return out


def tree(value: Any) -> Any:
    if isinstance(value, Section):
        return {f.name: tree(getattr(value, f.name)) for f in fields(value)}
    return value


def test_a_config_of_defaults_only_builds_and_holds_the_schema_defaults() -> None:
    config = load_run_config(None)
    assert isinstance(config, RunConfig)
    assert tree(config) == defaults(SCHEMA)
    assert config.inner.steps == 25 and config.coordinator.state_dir == "results/coordinator"
    assert config.sites == () and config.software.modules == () and config.data.inputs == ()
    assert config.blobs.s3.endpoint is None and config.blobs.s3.region == "us-east-1"
    assert hash(config) == hash(load_run_config(None))  # frozen all the way down


@pytest.mark.parametrize(
    "path",
    [
        "config/config.yaml",
        "lumi/crossfed.yaml",
        "frontier/crossfed.yaml",
        "profiles/slurm/crossfed.yaml",
        "profiles/snellius/crossfed.yaml",
    ],
)
def test_the_tree_gives_back_the_validated_mapping_of_every_shipped_config(path: str) -> None:
    mapping, config = validate_run_config(read_yaml(REPO / path), path)
    assert config.as_dict() == mapping
    assert RunConfig.from_mapping(mapping) == config


def test_an_s3_store_keeps_what_was_given_and_leaves_out_what_was_not() -> None:
    blobs = {"backend": "s3", "s3": {"bucket": "runs", "prefix": "qwen/"}}
    config = load_run_config(None, {"blobs": blobs})
    assert config.blobs.s3.bucket == "runs" and config.blobs.s3.endpoint is None
    written = config.blobs.as_dict()
    assert "endpoint" not in written["s3"] and written["s3"]["bucket"] == "runs"
    assert validate({"blobs": written}, "config.schema.yaml", "again")["blobs"] == written
    moved = replace(config, blobs=replace(config.blobs, backend="file"))
    assert moved.as_dict()["blobs"]["backend"] == "file"  # the mapping follows the fields


def test_a_merge_worker_is_a_url_or_embedded_and_anything_else_is_named() -> None:
    for value in ("embedded", "https://worker.example.org:8471", "http://10.0.0.5:8471"):
        blobs = {"backend": "s3", "s3": {"bucket": "runs", "merge_worker": value}}
        assert load_run_config(None, {"blobs": blobs}).blobs.s3.merge_worker == value
    assert load_run_config(None, {}).blobs.s3.merge_worker is None
    for value in ("worker.example.org:8471", "ftp://worker", "Embedded"):
        blobs = {"backend": "s3", "s3": {"bucket": "runs", "merge_worker": value}}
        with pytest.raises(ConfigError, match="merge_worker"):
            load_run_config(None, {"blobs": blobs})


def test_the_tree_is_built_from_a_validated_mapping_only(tmp_path: Path) -> None:
    mapping = validate({}, "config.schema.yaml", "defaults")
    del mapping["inner"]["steps"]
    with pytest.raises(ConfigError, match=r"inner: missing key 'steps'"):
        RunConfig.from_mapping(mapping)
    with pytest.raises(ConfigError, match=r"\(top level\): unknown keys \['extra'\]"):
        RunConfig.from_mapping({**validate({}, "config.schema.yaml", "defaults"), "extra": 1})


def test_tokens_per_round_is_steps_times_window_length_times_windows() -> None:
    config = load_run_config(None, {"inner": {"steps": 3}, "data": {"seq_len": 16}})
    assert config.tokens_per_round(5) == 3 * 16 * 5
