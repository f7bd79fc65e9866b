"""Run and site configuration: YAML validated against the JSON schemas in workflow/schemas/."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator, validators

SCHEMAS = Path(__file__).resolve().parent.parent / "workflow" / "schemas"


class ConfigError(ValueError):
    """A config file that is missing, unreadable or does not match its schema."""


def _with_defaults(cls):
    """A validator that fills in schema defaults while validating (as Snakemake's does)."""
    validate_properties = cls.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return validators.extend(cls, {"properties": set_defaults})


_Validator = _with_defaults(Draft202012Validator)


def validate(data: dict[str, Any], schema_name: str, source: str) -> dict[str, Any]:
    """Validate ``data`` against ``workflow/schemas/<schema_name>``, filling defaults."""
    schema = yaml.safe_load((SCHEMAS / schema_name).read_text())
    data = copy.deepcopy(data)
    # defaults of nested objects appear only once their parent exists: validate twice
    for _ in range(2):
        errors = sorted(_Validator(schema).iter_errors(data), key=lambda e: list(e.path))
        if errors:
            first = errors[0]
            where = "/".join(str(p) for p in first.path) or "(top level)"
            raise ConfigError(f"{source}: {where}: {first.message}")
    return data


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


def load_run_config(path: Path | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run config with defaults; ``overrides`` are merged on top (like ``--config k=v``)."""
    data = read_yaml(path) if path else {}
    for key, value in (overrides or {}).items():
        data[key] = value
    return validate(data, "config.schema.yaml", str(path or "config"))


def load_sites(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The participating sites from ``config['sites_file']``, validated, in file order."""
    path = Path(config["sites_file"])
    sites = validate(read_yaml(path), "sites.schema.yaml", str(path))["sites"]
    wanted = config.get("sites") or list(sites)
    unknown = [name for name in wanted if name not in sites]
    if unknown:
        raise ConfigError(f"config 'sites' names unknown sites {unknown}; {path} has {list(sites)}")
    return {name: sites[name] for name in wanted}


def dumps(config: dict[str, Any]) -> str:
    """Stable JSON of a config, for digests and logs."""
    return json.dumps(config, sort_keys=True)
