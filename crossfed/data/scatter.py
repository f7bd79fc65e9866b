"""Data preparation as separate jobs: a plan, one part per group of shards, and the gather.

``crossfed data prepare --plan`` fixes the tokenizer (trains it once on the corpus' first
256 M characters, as the one-process preparation does, or installs the given one) and splits
the shards into ``jobs`` contiguous groups; ``--part I`` tokenises group ``I`` into a flat
token file of its own; the gather concatenates the parts in shard order and cuts them into
the window store that ``crossfed data prepare`` writes in one process: the same windows, the
same held-out tail, the same meta.json, byte for byte. The number of jobs is how the store
was made, not what it holds: no field of meta.json records it, so sites that prepare in
different numbers of jobs derive the same block space.

The plan and the parts live in ``<data dir>/.prepare``; the gather removes them.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from crossfed.data.corpus import iter_documents
from crossfed.data.prepare import (
    PrepareError,
    Request,
    finish,
    log_written,
    sha256_file,
    start,
)
from crossfed.data.tokenizer import TOKENIZER_FILE, eos_id, load_tokenizer, vocab_size
from crossfed.data.windows import (
    DTYPES,
    META_FILE,
    Progress,
    dtype_for_vocab,
    windows_from_token_files,
    write_tokens,
)
from crossfed.fileio import atomic_file

PARTS_DIR = ".prepare"
PLAN_FORMAT = "crossfed-prepare-plan-v1"
PART_FORMAT = "crossfed-prepare-part-v1"
PROGRESS_EVERY_S = 5.0

Log = Callable[[str], None]


def parts_dir(out_dir: Path) -> Path:
    """Where the plan and the parts of a store in ``out_dir`` are kept until the gather."""
    return Path(out_dir) / PARTS_DIR


def plan_path(out_dir: Path, jobs: int) -> Path:
    """The plan of a preparation in ``jobs`` parts."""
    return parts_dir(out_dir) / f"plan-of-{jobs}.json"


def part_paths(out_dir: Path, index: int, jobs: int) -> tuple[Path, Path]:
    """Token file and record of part ``index`` of ``jobs``."""
    stem = parts_dir(out_dir) / f"part-{index}-of-{jobs}"
    return stem.with_suffix(".bin"), stem.with_suffix(".json")


def groups(n_shards: int, jobs: int) -> list[tuple[int, int]]:
    """``jobs`` contiguous, non-empty ``[lo, hi)`` ranges of ``n_shards`` shards, in order."""
    if jobs < 1:
        raise PrepareError(f"the number of preparation jobs must be at least 1, got {jobs}")
    if jobs > n_shards:
        raise PrepareError(
            f"{jobs} preparation jobs for {n_shards} shard(s): each job tokenises whole shards, "
            f"so give at most {n_shards} jobs (data.prepare_jobs, --jobs), or split the corpus "
            "into more shards"
        )
    return [(k * n_shards // jobs, (k + 1) * n_shards // jobs) for k in range(jobs)]


def _write_json(path: Path, record: dict) -> None:
    with atomic_file(path) as f:
        f.write((json.dumps(record, indent=2, sort_keys=True) + "\n").encode())


def _read_json(path: Path, what: str, how: str) -> dict:
    if not path.is_file():
        raise PrepareError(f"{path}: {what} not found; {how}")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PrepareError(f"{path}: {what} is not valid JSON ({exc}); {how}") from exc
    if not isinstance(record, dict):
        raise PrepareError(f"{path}: {what} is not a JSON object; {how}")
    return record


def plan(req: Request, jobs: int, log: Log) -> dict:
    """Write the corpus (embedded), the tokenizer and the plan of ``jobs`` parts."""
    n_shards = req.shards if req.sources is None else len(req.sources)
    ranges = groups(n_shards, jobs)  # refused before any work
    started = time.monotonic()
    shutil.rmtree(parts_dir(req.out_dir), ignore_errors=True)  # parts of any earlier plan
    sources, tok_path = start(req, log)
    tok = load_tokenizer(tok_path)
    record = {
        "format": PLAN_FORMAT,
        "jobs": jobs,
        "params": req.params,
        "sources": [str(p) for p in sources],
        "groups": [list(r) for r in ranges],
        "tokenizer_sha256": sha256_file(tok_path),
        "vocab_size": vocab_size(tok),
        "eos_id": eos_id(tok),
    }
    _write_json(plan_path(req.out_dir, jobs), record)
    sizes = [hi - lo for lo, hi in ranges]
    log(
        f"plan: {len(sources)} shard(s) in {jobs} part(s) of {min(sizes)}-{max(sizes)} shard(s) "
        f"in {time.monotonic() - started:.1f} s"
    )
    return record


def _how(req: Request, jobs: int) -> str:
    return (
        f"make the plan again (`crossfed data prepare --plan`, {jobs} jobs, for {req.out_dir}) "
        "and its parts"
    )


def read_plan(req: Request, jobs: int) -> dict:
    """The plan of ``jobs`` parts, checked against these settings and the installed tokenizer."""
    path = plan_path(req.out_dir, jobs)
    record = _read_json(path, "preparation plan", _how(req, jobs))
    if record.get("format") != PLAN_FORMAT or record.get("jobs") != jobs:
        raise PrepareError(f"{path}: not a plan of {jobs} parts; {_how(req, jobs)}")
    if record.get("params") != req.params:
        raise PrepareError(
            f"{path}: planned for other data settings ({record.get('params')}, now "
            f"{req.params}); {_how(req, jobs)}"
        )
    if req.sources is not None and record.get("sources") != [str(p) for p in req.sources]:
        raise PrepareError(f"{path}: planned for other input shards; {_how(req, jobs)}")
    tok_path = req.out_dir / TOKENIZER_FILE
    if not tok_path.is_file() or sha256_file(tok_path) != record.get("tokenizer_sha256"):
        raise PrepareError(f"{tok_path}: not the tokenizer the plan fixed; {_how(req, jobs)}")
    if req.tokenizer is not None and sha256_file(req.tokenizer) != record["tokenizer_sha256"]:
        raise PrepareError(f"{req.tokenizer}: not the tokenizer the plan fixed; {_how(req, jobs)}")
    return record


def part(req: Request, index: int, jobs: int, log: Log) -> dict:
    """Tokenise part ``index`` of the plan of ``jobs`` parts; return its record."""
    started = time.monotonic()
    record = read_plan(req, jobs)
    if not 0 <= index < jobs:
        raise PrepareError(f"part {index} of a plan of {jobs} parts: give 0 to {jobs - 1}")
    lo, hi = record["groups"][index]
    sources = [Path(p) for p in record["sources"][lo:hi]]
    tok = load_tokenizer(req.out_dir / TOKENIZER_FILE)
    last = [time.monotonic()]

    def report(p: Progress) -> None:
        if time.monotonic() - last[0] >= PROGRESS_EVERY_S:
            last[0] = time.monotonic()
            log(f"part {index}: {p.documents} documents, {p.tokens} tokens")

    bin_path, json_path = part_paths(req.out_dir, index, jobs)
    json_path.unlink(missing_ok=True)  # a part counts once its record is written
    counts = write_tokens(
        iter_documents(sources), tok, bin_path, eos=record["eos_id"], progress=report
    )
    done = {
        "format": PART_FORMAT,
        "part": index,
        "jobs": jobs,
        "source": [p.name for p in sources],
        "source_sha256": [sha256_file(p) for p in sources],
        "tokenizer_sha256": record["tokenizer_sha256"],
        **counts,
    }
    _write_json(json_path, done)
    seconds = time.monotonic() - started
    log(
        f"part {index} of {jobs}: {len(sources)} shard(s), {counts['n_documents']} documents, "
        f"{counts['n_tokens']} tokens in {seconds:.1f} s"
    )
    return done


def _read_part(req: Request, record: dict, index: int, jobs: int) -> tuple[Path, dict]:
    bin_path, json_path = part_paths(req.out_dir, index, jobs)
    how = f"run `crossfed data prepare --part {index}` ({jobs} jobs) for {req.out_dir} again"
    done = _read_json(json_path, f"record of part {index}", how)
    lo, hi = record["groups"][index]
    names = [Path(p).name for p in record["sources"][lo:hi]]
    if (
        done.get("format") != PART_FORMAT
        or (done.get("part"), done.get("jobs")) != (index, jobs)
        or done.get("tokenizer_sha256") != record["tokenizer_sha256"]
        or done.get("source") != names
        or done.get("dtype") != dtype_for_vocab(record["vocab_size"])
    ):
        raise PrepareError(f"{json_path}: not part {index} of this plan; {how}")
    expected = done["n_tokens"] * np.dtype(DTYPES[done["dtype"]]).itemsize
    if not bin_path.is_file() or bin_path.stat().st_size != expected:
        raise PrepareError(
            f"{bin_path}: missing or not the {done['n_tokens']} {done['dtype']} tokens its "
            f"record promises; {how}"
        )
    return bin_path, done


def gather(req: Request, jobs: int, log: Log) -> dict:
    """Cut the parts of the plan of ``jobs`` parts into the store; return its meta."""
    started = time.monotonic()
    if not plan_path(req.out_dir, jobs).exists() and (meta := req.up_to_date()):
        log(
            f"prepare: {req.out_dir} is up to date ({meta['n_windows']} train windows); "
            "nothing to gather"
        )
        return meta
    record = read_plan(req, jobs)
    parts = [_read_part(req, record, k, jobs) for k in range(jobs)]
    (req.out_dir / META_FILE).unlink(missing_ok=True)
    meta = windows_from_token_files(
        [path for path, _ in parts],
        req.out_dir,
        seq_len=req.seq_len,
        vocab_size=record["vocab_size"],
        eos=record["eos_id"],
        n_documents=sum(done["n_documents"] for _, done in parts),
        val_fraction=req.val_fraction,
    )
    sources = [Path(p) for p in record["sources"]]
    digests = [digest for _, done in parts for digest in done["source_sha256"]]
    finish(req, meta, req.out_dir / TOKENIZER_FILE, sources, digests)
    shutil.rmtree(parts_dir(req.out_dir), ignore_errors=True)
    log(f"gather: {jobs} part(s) in {time.monotonic() - started:.1f} s")
    log_written(meta, req.out_dir, started, log)
    return meta
