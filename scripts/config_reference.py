"""Write docs/config-reference.md from the JSON schemas in workflow/schemas/.

    .venv/bin/python scripts/config_reference.py           # rewrite the page
    .venv/bin/python scripts/config_reference.py --check   # exit 1 if the page is not current

Every key of both files, with its type and bounds, its default and the schema's description.
A schema keyword this script does not know stops it, so the page never leaves a rule out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
SCHEMAS = REPO / "workflow" / "schemas"
PAGE = REPO / "docs" / "config-reference.md"

#: (schema file, the file it validates)
FILES = [("config.schema.yaml", "config/config.yaml"), ("sites.schema.yaml", "config/sites.yaml")]

#: keywords rendered below; anything else in a schema is an error
KNOWN = {
    "$schema", "title", "description", "type", "default", "properties", "additionalProperties",
    "required", "items", "enum", "const", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "minLength", "minItems", "minProperties", "pattern", "propertyNames",
    "allOf", "if", "then",
}  # fmt: skip


def check_keywords(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        return
    unknown = set(schema) - KNOWN
    if unknown:
        raise SystemExit(f"{where}: schema keywords this page cannot show: {sorted(unknown)}")
    for name, sub in schema.get("properties", {}).items():
        check_keywords(sub, f"{where}/{name}")
    for key in ("items", "additionalProperties", "propertyNames", "if", "then"):
        check_keywords(schema.get(key), f"{where}/{key}")
    for i, sub in enumerate(schema.get("allOf", [])):
        check_keywords(sub, f"{where}/allOf/{i}")


def literal(value: Any) -> str:
    """A value as it is written in the YAML file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list | dict):
        return yaml.safe_dump(value, default_flow_style=True).strip()
    return str(value)


def code(value: Any) -> str:
    """``value`` as code in a table cell; one with a pipe as HTML, which both Python-Markdown
    and GitHub show without the escape a pipe needs in a cell."""
    shown = literal(value)
    if "|" not in shown:
        return f"`{shown}`"
    for char, entity in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("|", "&#124;")):
        shown = shown.replace(char, entity)
    return f"<code>{shown}</code>"


def size(value: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale and value % scale == 0:
            return f" ({value // scale} {unit})"
    return ""


def at_least(n: int, noun: str, one: str, nouns: str | None = None) -> str:
    return one if n == 1 else f"at least {n} {nouns or noun + 's'}"


def kind(schema: dict[str, Any]) -> str:
    """The type column: the type, its allowed values or bounds, its pattern."""
    if "enum" in schema:
        text = "one of " + ", ".join(code(v) for v in schema["enum"])
    else:
        types = schema.get("type", "any")
        text = " or ".join(types) if isinstance(types, list) else types
        if text == "array" and isinstance(schema.get("items"), dict):
            inner = schema["items"]
            text = f"list of {inner.get('type', 'object')}"
    bounds = []
    for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="),
                      ("exclusiveMaximum", "<")):  # fmt: skip
        if key in schema:
            bounds.append(f"{sign} {schema[key]}")
    if "minLength" in schema:
        bounds.append(at_least(schema["minLength"], "character", "non-empty"))
    if "minItems" in schema:
        bounds.append(at_least(schema["minItems"], "item", "non-empty"))
    if "minProperties" in schema:
        bounds.append(at_least(schema["minProperties"], "entry", "non-empty", "entries"))
    if "pattern" in schema:
        bounds.append(f"matching {code(schema['pattern'])}")
    return ", ".join([text, *bounds])


def default(schema: dict[str, Any], key: str, required: bool) -> str:
    if required:
        return "required"
    if "default" not in schema:
        return "unset"
    value = schema["default"]
    extra = size(value) if key.endswith("_bytes") and isinstance(value, int) else ""
    return code(value) + extra


def text(value: str | None) -> str:
    return " ".join((value or "").split()).replace("|", "\\|")


def conditions(schema: dict[str, Any]) -> dict[str, str]:
    """What an ``allOf`` of if/then adds to each key: "when `x` is `v`: required, ..."."""
    notes: dict[str, str] = {}
    for rule in schema.get("allOf", []):
        ((field, spec),) = rule["if"]["properties"].items()
        then = rule["then"]
        parts: dict[str, list[str]] = {name: ["required"] for name in then.get("required", [])}
        for name, extra in then.get("properties", {}).items():
            shown = {k: v for k, v in extra.items() if k != "description"}
            part = kind({"type": "", **shown}).lstrip(", ")
            if "description" in extra:
                part += f" ({text(extra['description'])})"
            parts.setdefault(name, []).append(part)
        for name, said in parts.items():
            note = f"when `{field}` is {code(spec['const'])}: {', '.join(said)}"
            notes[name] = f"{notes[name]}; {note}" if name in notes else note
    return notes


def table(schema: dict[str, Any], prefix: str) -> list[str]:
    """One row per key of an object schema; its object-valued keys get their own tables."""
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    required = set(schema.get("required", []))
    notes = conditions(schema)
    for name, sub in schema.get("properties", {}).items():
        if sub.get("type") == "object" and ("properties" in sub or "additionalProperties" in sub):
            about = f"see [`{prefix}{name}`](#{anchor(prefix + name)})"
            rows.append(f"| `{prefix}{name}` | object | | {about} |")
            continue
        described = text(sub.get("description"))
        if name in notes:
            described = f"{described}; {notes[name]}" if described else notes[name]
        rows.append(
            f"| `{prefix}{name}` | {kind(sub)} | {default(sub, name, name in required)} "
            f"| {described} |"
        )
    return rows


def sentence(value: str) -> str:
    """``value`` as a sentence: a capital first letter, a full stop."""
    value = value[:1].upper() + value[1:]
    return value if value.endswith(".") else value + "."


def anchor(key: str) -> str:
    """The heading id of a section named after ``key`` (Python-Markdown's and GitHub's)."""
    return "".join(c for c in key.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def sections(schema: dict[str, Any], prefix: str, title: str) -> list[str]:
    """A heading and table for this object, then one for each object inside it."""
    out = [f"### {title}", ""]
    if schema.get("description") and prefix:
        out += [sentence(text(schema["description"])), ""]
    out += table(schema, prefix) + [""]
    if schema.get("additionalProperties") is not False:
        out += ["Other keys are allowed here.", ""]
    nested = []
    for name, sub in schema.get("properties", {}).items():
        if sub.get("type") != "object":
            continue
        if "properties" in sub:
            nested.append((sub, f"{prefix}{name}.", f"`{prefix}{name}`"))
        elif isinstance(sub.get("additionalProperties"), dict):
            # a map: every entry's key is a name (a site's), its value this schema
            entry = sub["additionalProperties"]
            names = sub.get("propertyNames", {}).get("pattern")
            heading = f"{prefix}{name}"
            about = f"A map from a name to its entry, `{heading}.<name>` below"
            if names:
                about += f"; a name matches {code(names)}"
            if "minProperties" in sub:
                least = at_least(sub["minProperties"], "entry", "at least one entry", "entries")
                about += f"; {least}"
            lines = [f"### `{heading}`", "", about + "."]
            if sub.get("description"):
                lines[-1] = sentence(text(sub["description"])) + " " + lines[-1]
            nested_out = [*lines, ""]
            nested_out += sections(entry, f"{heading}.<name>.", f"`{heading}.<name>`")
            nested.append((None, nested_out, None))
    for sub, child_prefix, child_title in nested:
        if sub is None:
            out += child_prefix
        else:
            out += sections(sub, child_prefix, child_title)
    for name, sub in schema.get("properties", {}).items():
        items = sub.get("items")
        if sub.get("type") == "array" and isinstance(items, dict) and "properties" in items:
            out += sections(items, f"{prefix}{name}[].", f"`{prefix}{name}[]`")
    return out


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "Every key of the two configuration files, from the JSON schemas that check them",
        "(`workflow/schemas/`). The default is what a key left out of a file becomes;",
        "`config/config.yaml`, the local run's file, sets some keys to other values. A list",
        "key is written `key[]`, a site's entry `sites.<name>`. Unknown keys are refused",
        "everywhere (but a site's, in a file given to `crossfed probe` or `crossfed plan`:",
        "kept). [Configuration](configuration.md) explains the keys most runs set.",
        "",
        "This page is generated by `scripts/config_reference.py`; edit the schemas, then run",
        "`.venv/bin/python scripts/config_reference.py`.",
        "",
    ]
    for schema_name, target in FILES:
        schema = yaml.safe_load((SCHEMAS / schema_name).read_text())
        check_keywords(schema, schema_name)
        out += [f"## `{target}`", ""]
        out += [f"{text(schema.get('description'))} Schema: `workflow/schemas/{schema_name}`.", ""]
        out += sections(schema, "", "Top-level keys")
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is not current")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = PAGE.exists() and PAGE.read_text() == page
        if not current:
            print(f"{PAGE.relative_to(REPO)} is not current: run scripts/config_reference.py")
        return 0 if current else 1
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
