"""``crossfed`` command line: one subcommand per thing a rule or a person does.

This module is the root parser, logging (``--log``, ``-v``) and dispatch; each package
registers its own subcommands from its ``commands.py``."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from crossfed.cmdline import examples
from crossfed.config import ConfigError


class _Tee(io.TextIOBase):
    """A text stream that writes to the terminal's stream and to the log file alike."""

    def __init__(self, stream: TextIO, log: TextIO, show: bool = True) -> None:
        self._stream, self._log, self._show = stream, log, show

    def write(self, text: str) -> int:
        if self._show:
            self._stream.write(text)
        if not self._log.closed:  # a handler left over after main() returned
            self._log.write(text)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()
        if not self._log.closed:
            self._log.flush()

    @property
    def stream(self) -> TextIO:
        """The terminal's stream alone."""
        return self._stream

    @property
    def log(self) -> TextIO:
        """The log file alone (writes after it closed are dropped)."""
        return _Tee(self._stream, self._log, show=False)  # type: ignore[return-value]

    def fileno(self) -> int:  # subprocesses inherit the terminal's stream
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", None) or "utf-8"


#: ``progress``: under ``--log``, what a command prints goes to the log only (set by the workflow)
TERMINAL_ENV = "CROSSFED_TERMINAL"


@contextlib.contextmanager
def _tee_to(log_file: str | None) -> Iterator[None]:
    """With ``--log``: all a command says (stdout, stderr, its traceback) also goes to the log.

    Under ``CROSSFED_TERMINAL=progress`` (the workflow's jobs) the terminal gets only the
    progress lines, warnings and errors; what the command prints goes to the log alone.
    """
    if not log_file:
        yield
        return
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a", buffering=1, encoding="utf-8", errors="replace") as log:
        out, err = sys.stdout, sys.stderr
        show_output = os.environ.get(TERMINAL_ENV) != "progress"
        sys.stdout, sys.stderr = _Tee(out, log, show=show_output), _Tee(err, log)
        try:
            yield
        except (Exception, KeyboardInterrupt):  # the terminal gets it from the interpreter
            log.write(traceback.format_exc())
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = out, err


def _log_file(argv: list[str] | None) -> str | None:
    """``--log`` of the command line, read before the full parse so usage errors reach it."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--log")
    known, _ = early.parse_known_args(argv)
    return known.log


class _ForTerminal(logging.Filter):
    """Under ``--log``: the terminal gets progress lines (``crossfed.console``) and warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name == "crossfed.console" or record.levelno >= logging.WARNING


class _LineFormatter(logging.Formatter):
    """Progress lines as ``HH:MM:SS <line>``; every other record with its level and logger."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name == "crossfed.console":
            return f"{self.formatTime(record, self.datefmt)} {record.getMessage()}"
        return super().format(record)


def _setup_logging(verbose: bool = False) -> None:
    """Log lines to stderr; under ``--log`` every line to the log file and only progress
    lines and warnings to the terminal (the rule log keeps the rest)."""
    fmt = _LineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    if isinstance(sys.stderr, _Tee):
        to_log = logging.StreamHandler(sys.stderr.log)
        to_terminal = logging.StreamHandler(sys.stderr.stream)
        to_terminal.addFilter(_ForTerminal())
        handlers: list[logging.Handler] = [to_log, to_terminal]
    else:
        handlers = [logging.StreamHandler(sys.stderr)]
    for handler in handlers:
        handler.setFormatter(fmt)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, handlers=handlers, force=True
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written; an option's default after its help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        shown = default is not None and default is not False and default is not argparse.SUPPRESS
        if shown and action.option_strings and "default" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """crossfed's parsers (subcommands' too): descriptions and examples kept as written."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The ``crossfed`` parser: every subcommand, each with a description and an example."""
    from crossfed import __version__

    parser = _Parser(
        prog="crossfed",
        description="Pool Slurm allocations from several supercomputers into one pre-training "
        "run.\n\nThe workflow (make run, or snakemake --profile <site>) calls these commands in "
        "its rules;\nthey also work by hand. Without a command crossfed prints this help.",
        epilog=examples(
            "crossfed data prepare --config config/config.yaml",
            "crossfed coordinator secrets --out secrets.yaml --site lumi --site snellius",
            "crossfed status --config config/config.yaml",
            "crossfed export --config config/config.yaml --out hf-model",
            "crossfed COMMAND --help       # what a command does, its options and an example",
        ),
    )
    parser.add_argument("--version", action="version", version=f"crossfed {__version__}")
    parser.add_argument(
        "--log", help="also write everything the command says (output, errors) to this file"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages too")
    parser.set_defaults(func=None, help_of=parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for add in _registrars():
        add(sub)
    return parser


def _registrars() -> list[Any]:
    """Each package's ``add_*`` functions, in the order ``crossfed --help`` lists them."""
    from crossfed.coordinator import commands as coordinator
    from crossfed.data import commands as data
    from crossfed.site import commands as site
    from crossfed.train import commands as train

    adds = [
        coordinator.add_coordinator,
        coordinator.add_run,
        site.add_parsers,
        coordinator.add_round,
        train.add_parsers,
        coordinator.add_views,
        data.add_parsers,
    ]
    try:
        from crossfed.sched.commands import add_parsers as add_sched
    except ImportError:  # pragma: no cover - scheduler extras absent
        return adds
    return [*adds, add_sched]


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; with ``--log`` everything it says also lands in the log file."""
    with _tee_to(_log_file(argv)):
        return _run(argv)


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.func is None:  # `crossfed` or a command group alone: its help, as pip does
        args.help_of.print_help()
        return 0
    _setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"crossfed: config error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from crossfed.client.http import Refused, Unreachable
        from crossfed.client.reach import EndpointError

        if isinstance(exc, Refused | Unreachable | EndpointError):
            print(f"crossfed: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())
