"""What every package's ``commands.py`` builds its subcommands from.

A command group that prints its help when called alone (:func:`group`), an epilog of
examples (:func:`examples`), the ``--config``/``--set`` pair (:func:`add_config`) and the run
config it names (:func:`run_config`), ``--threads`` (:func:`add_threads`), argparse types for
counts and seconds, and a command's JSON answer (:func:`write_json`).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from crossfed.config import RunConfig, load_run_config
from crossfed.fileio import write_atomic

#: the --config default of the commands that read the run config
DEFAULT_CONFIG = "config/config.yaml"


def examples(*lines: str) -> str:
    """An epilog of example command lines."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def group(sub: argparse._SubParsersAction, name: str, text: str, *example: str) -> Any:
    """A command with subcommands; without one it prints its help."""
    parser = sub.add_parser(
        name, help=text, description=text[:1].upper() + text[1:] + ".",
        epilog=examples(*example),
    )  # fmt: skip
    parser.set_defaults(func=None, help_of=parser)
    return parser.add_subparsers(dest="action", metavar="ACTION", title="actions")


def add_config(parser: argparse.ArgumentParser) -> None:
    """``--config`` (the run config YAML) and ``--set KEY=VALUE`` overrides."""
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="run config YAML")
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a top-level config key (repeatable)",
    )


def add_threads(parser: argparse.ArgumentParser) -> None:
    """``--threads``: the CPU threads torch may use."""
    parser.add_argument("--threads", type=int, default=1, help="CPU threads torch may use")


def run_config(args: argparse.Namespace) -> RunConfig:
    """The run config ``--config`` names, with the ``--set`` overrides applied."""
    overrides = {}
    for item in getattr(args, "set", None) or []:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value) if value[:1] in "[{0123456789-tf" else value
    return load_run_config(Path(args.config) if args.config else None, overrides)


def write_json(path: str | None, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` (atomically), or print it without one."""
    text = json.dumps(data, indent=2, default=str)
    if path:
        write_atomic(path, text + "\n")
    else:
        print(text)


def non_negative(text: str) -> int:
    """A whole number >= 0 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be finite and > 0")
    return value
