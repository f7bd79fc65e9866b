"""``crossfed data prepare``: the command line of data preparation (one process, or N jobs).

The store itself is built by :mod:`crossfed.data.prepare` (one process) or
:mod:`crossfed.data.scatter` (a plan, N parts, a gather).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from crossfed.cmdline import examples, group
from crossfed.data import scatter
from crossfed.data.corpus import CorpusError
from crossfed.data.prepare import (
    DEFAULT_SEQ_LEN,
    DEFAULT_SHARDS,
    DEFAULT_VAL_FRACTION,
    DEFAULT_VOCAB_SIZE,
    PrepareError,
    _print,
    prepare,
    request,
)
from crossfed.data.tokenizer import TokenizerError
from crossfed.data.windows import WindowStoreError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register the ``data`` group and its ``prepare`` on the crossfed parser."""
    dsub = group(
        sub, "data", "data preparation",
        "crossfed data prepare --config config/config.yaml",
        "crossfed data prepare --out data --input c4/en --tokenizer tokenizer.json",
    )  # fmt: skip
    add_parser(dsub)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``prepare`` subcommand on ``subparsers``."""
    parser = subparsers.add_parser(
        "prepare",
        help="tokenise a corpus into fixed windows (train.bin, val.bin, meta.json)",
        description=(
            "Tokenise C4-format shards (or, with no --input, an embedded corpus of Python's own "
            "documentation)\ninto fixed windows of seq_len + 1 tokens for training; a "
            "tokenizer is trained unless one is given.\nUp to date output is left as it is."
        ),
        epilog=examples(
            "crossfed data prepare --config config/config.yaml",
            "crossfed data prepare --out data --input c4/en --tokenizer tokenizer.json "
            "--seq-len 2048",
        ),
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="take every setting from this run config's `data` block (the workflow's way: its "
        "rule then holds no data settings that a rerun could see change); flags are ignored",
    )
    parser.add_argument("--out", type=Path, help="output directory (required without --config)")
    parser.add_argument(
        "--input",
        type=Path,
        action="append",
        default=None,
        help="C4 shard file or directory of *.json.gz / *.jsonl(.gz) (repeatable; "
        "default: the embedded corpus)",
    )
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help="existing HF tokenizer.json (default: train)"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help="vocabulary of the tokenizer trained here (a given tokenizer has its own)",
    )
    parser.add_argument(
        "--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="tokens a training window holds"
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help="share of windows held out for evaluation (never leased)",
    )
    parser.add_argument(
        "--shards", type=int, default=DEFAULT_SHARDS, help="shards of the embedded corpus"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="prepare in this many separate jobs over groups of shards (with --config: "
        "data.prepare_jobs); with no stage below, more than 1 means --gather",
    )
    stage = parser.add_mutually_exclusive_group()
    stage.add_argument(
        "--plan",
        action="store_true",
        help="stage 1 of --jobs: write the corpus and tokenizer, plan the groups of shards",
    )
    stage.add_argument(
        "--part",
        type=int,
        metavar="I",
        help="stage 2 of --jobs: tokenise group I (0 to jobs - 1) of the plan",
    )
    stage.add_argument(
        "--gather",
        action="store_true",
        help="stage 3 of --jobs: cut the groups' tokens into the store (the same bytes as one job)",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Handler of `crossfed data prepare`; returns the exit code."""
    if args.config is not None:
        from crossfed.config import load_run_config

        data = load_run_config(args.config).data
        args.out, args.tokenizer = Path(data.dir), data.tokenizer
        args.input = [Path(p) for p in data.inputs] or None
        args.vocab_size, args.seq_len = data.vocab_size, data.seq_len
        args.val_fraction, args.shards = data.val_fraction, data.shards
        args.jobs = data.prepare_jobs
    if args.out is None:
        print("crossfed data prepare: error: --out (or --config) is required", file=sys.stderr)
        return 2
    settings = dict(
        inputs=args.input,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        val_fraction=args.val_fraction,
        shards=args.shards,
    )
    try:
        if args.jobs < 1:
            raise PrepareError(f"--jobs must be at least 1, got {args.jobs}")
        if not (args.plan or args.gather or args.part is not None or args.jobs > 1):
            prepare(args.out, force=args.force, **settings)
            return 0
        req = request(args.out, **settings)
        if args.plan:
            scatter.plan(req, args.jobs, _print)
        elif args.part is not None:
            scatter.part(req, args.part, args.jobs, _print)
        else:
            scatter.gather(req, args.jobs, _print)
    except (PrepareError, CorpusError, TokenizerError, WindowStoreError) as exc:
        print(f"crossfed data prepare: error: {exc}", file=sys.stderr)
        return 1
    return 0
