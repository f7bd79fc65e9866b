"""YAML read and validated against the JSON schemas in workflow/schemas/, defaults filled in.

Every problem is named in one ``ConfigError``: where it is, what is wrong and the likely fix.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator, ValidationError, validators

from crossfed.flavours import did_you_mean

SCHEMAS = Path(__file__).resolve().parents[2] / "workflow" / "schemas"


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


def _describe(error: ValidationError) -> str:
    """One schema error as a user reads it: where, what, and the likely fix."""
    where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
    schema = error.schema if isinstance(error.schema, dict) else {}
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = list(schema.get("properties", {}))
        problems = []
        for key in (k for k in error.instance if k not in known):
            hint = did_you_mean(str(key), known) or f"; known keys: {', '.join(known)}"
            problems.append(f"{where}: unknown key {key!r}{hint}")
        return "; ".join(problems)
    if error.validator == "enum":
        allowed = [str(v) for v in error.validator_value]
        hint = did_you_mean(error.instance, allowed) if isinstance(error.instance, str) else ""
        return f"{where}: {error.instance!r} is not one of {', '.join(allowed)}{hint}"
    if error.validator == "required":
        missing = [k for k in error.validator_value if k not in error.instance]
        keys = "key" if len(missing) == 1 else "keys"
        about = schema.get("description")
        text = f"{where}: missing required {keys} {', '.join(repr(k) for k in missing)}"
        return text + (f" ({about})" if about else "")
    if error.validator == "pattern" and schema.get("description"):
        return f"{where}: {error.instance!r} is not {schema['description']}"
    about = schema.get("description") if error.validator == "minItems" else None
    return f"{where}: {error.message}" + (f" ({about})" if about else "")


_SCALARS = {"integer": int, "number": (int, float), "boolean": bool, "null": type(None)}


def _typed(value: Any, schema: dict[str, Any]) -> Any:
    """Scalars given as strings where the schema wants no string, read as YAML scalars.

    Snakemake parses a nested ``--config data="{'seq_len': 64}"`` with YAML's base loader,
    so every nested value arrives as a string; a top-level ``rounds=3`` arrives typed.
    """
    if isinstance(value, dict):
        props = schema.get("properties", {})
        rest = schema.get("additionalProperties")
        rest = rest if isinstance(rest, dict) else {}
        return {k: _typed(v, props.get(k, rest)) for k, v in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_typed(v, schema["items"]) for v in value]
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds or []
    if not isinstance(value, str) or "string" in kinds or not kinds:
        return value
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    if isinstance(parsed, str) and "number" in kinds:  # YAML 1.1 reads 1.2e4 as a string
        try:
            parsed = float(parsed)
        except ValueError:
            return value
    wanted = tuple(t for k in kinds if k in _SCALARS for t in _as_tuple(_SCALARS[k]))
    if isinstance(parsed, wanted) and not (isinstance(parsed, bool) and bool not in wanted):
        return parsed
    return value


def _as_tuple(kinds: Any) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def validate(data: dict[str, Any], schema: str | dict[str, Any], source: str) -> dict[str, Any]:
    """Validate ``data`` against a schema (a file name under ``workflow/schemas/``, or the
    schema itself), filling defaults.

    Every problem is named in one ConfigError: where it is, and the likely fix.
    """
    if isinstance(schema, str):
        schema = yaml.safe_load((SCHEMAS / schema).read_text())
    data = _typed(copy.deepcopy(data), schema)
    # defaults of nested objects appear only once their parent exists: validate twice
    for _ in range(2):
        errors = sorted(_Validator(schema).iter_errors(data), key=lambda e: list(e.path))
        if errors:
            problems = list(dict.fromkeys(_describe(e) for e in errors))
            raise ConfigError(f"{source}: {'; '.join(problems)}")
    return data


def read_yaml(path: Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file (empty: ``{}``)."""
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
