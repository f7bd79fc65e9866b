"""`crossfed data prepare`: corpus shards -> tokenizer.json -> train.bin / val.bin / meta.json."""

from __future__ import annotations

import hashlib
import platform
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from crossfed.data.corpus import (
    iter_documents,
    resolve_inputs,
    write_embedded_corpus,
)
from crossfed.data.tokenizer import (
    TOKENIZER_FILE,
    eos_id,
    load_tokenizer,
    train_tokenizer,
)
from crossfed.data.windows import (
    META_FILE,
    Progress,
    WindowStore,
    WindowStoreError,
    read_meta,
    write_meta,
    write_windows,
)
from crossfed.fileio import atomic_file

CORPUS_DIR = "corpus"
CREATED_BY = "crossfed data prepare"
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_SEQ_LEN = 128
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SHARDS = 4
TOKENIZER_TRAIN_CHARS = 256 << 20  # a trained tokenizer sees at most this much text
PROGRESS_EVERY_S = 5.0

Log = Callable[[str], None]


class PrepareError(ValueError):
    """Invalid `crossfed data prepare` parameters."""


def _print(line: str) -> None:
    print(line, flush=True)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _check_params(vocab_size: int, seq_len: int, val_fraction: float, shards: int) -> None:
    if seq_len < 1:
        raise PrepareError(f"--seq-len must be at least 1, got {seq_len}")
    if vocab_size < 257:
        raise PrepareError(f"--vocab-size must be at least 257, got {vocab_size}")
    if not 0.0 <= val_fraction < 1.0:
        raise PrepareError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if shards < 1:
        raise PrepareError(f"--shards must be at least 1, got {shards}")


def preparation_params(
    *,
    embedded: bool,
    trained: bool,
    vocab_size: int,
    seq_len: int,
    val_fraction: float,
    shards: int,
) -> dict:
    """The settings a preparation is made from, as ``meta.json`` records them in ``params``."""
    return {
        "corpus": "embedded" if embedded else "inputs",
        "python": platform.python_version() if embedded else None,
        "shards": shards if embedded else None,
        "tokenizer": "trained" if trained else "given",
        "vocab_size": vocab_size if trained else None,
        "seq_len": seq_len,
        "val_fraction": val_fraction,
    }


def _up_to_date(
    out_dir: Path, params: dict, sources: list[Path] | None, tokenizer: Path | None
) -> dict | None:
    """The existing meta if ``out_dir`` already holds exactly this preparation, else None."""
    try:
        meta = read_meta(out_dir)
        for split in ("train", "val"):
            if split == "train" or meta.get("n_val_windows"):
                WindowStore.open(out_dir, split)
    except WindowStoreError:
        return None
    if meta.get("params") != params or meta.get("created_by") != CREATED_BY:
        return None
    if sources is None:  # embedded corpus: the shards recorded in meta must be intact
        sources = [out_dir / CORPUS_DIR / name for name in meta.get("source", [])]
    if [p.name for p in sources] != meta.get("source"):
        return None
    if not all(p.is_file() for p in sources):
        return None
    if [sha256_file(p) for p in sources] != meta.get("source_sha256"):
        return None
    tok_path = out_dir / TOKENIZER_FILE
    if not tok_path.is_file() or sha256_file(tok_path) != meta.get("tokenizer_sha256"):
        return None
    if tokenizer is not None and sha256_file(tokenizer) != meta.get("tokenizer_sha256"):
        return None
    return meta


def _write_corpus(corpus_dir: Path, shards: int, log: Log) -> list[Path]:
    paths = write_embedded_corpus(corpus_dir, shards)
    keep = {p.name for p in paths}
    for stale in corpus_dir.glob("c4-train.*-of-*.json.gz"):
        if stale.name not in keep:
            stale.unlink()
    size = sum(p.stat().st_size for p in paths)
    log(f"corpus: wrote {len(paths)} embedded shard(s) to {corpus_dir} ({size / 1e6:.2f} MB gz)")
    return paths


def _limited(docs: Iterable[str], max_chars: int, counts: list[int]) -> Iterator[str]:
    for doc in docs:
        if counts[1] >= max_chars:
            return
        counts[0] += 1
        counts[1] += len(doc)
        yield doc


def _install_tokenizer(
    out_dir: Path, tokenizer: Path | None, sources: list[Path], vocab_size: int, log: Log
) -> Path:
    target = out_dir / TOKENIZER_FILE
    if tokenizer is not None:
        if tokenizer.resolve() != target.resolve():
            data = tokenizer.read_bytes()
            with atomic_file(target) as f:
                f.write(data)
        log(f"tokenizer: using {tokenizer} as-is")
        return target
    counts = [0, 0]
    docs = _limited(iter_documents(sources), TOKENIZER_TRAIN_CHARS, counts)
    train_tokenizer(docs, vocab_size, target)
    log(
        f"tokenizer: trained byte-level BPE, vocab {vocab_size}, on {counts[0]} documents "
        f"({counts[1] / 1e6:.2f} M chars)"
    )
    return target


@dataclass(frozen=True)
class Request:
    """One preparation's settings, checked: what every way of preparing starts from."""

    out_dir: Path
    sources: list[Path] | None  # None: the embedded corpus, written into out_dir/corpus
    tokenizer: Path | None  # None: train one
    vocab_size: int
    seq_len: int
    val_fraction: float
    shards: int
    params: dict  # as meta.json records them

    def up_to_date(self) -> dict | None:
        """The existing meta if ``out_dir`` already holds exactly this preparation."""
        return _up_to_date(self.out_dir, self.params, self.sources, self.tokenizer)


def request(
    out_dir: Path,
    *,
    inputs: Sequence[Path] | None = None,
    tokenizer: Path | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seq_len: int = DEFAULT_SEQ_LEN,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    shards: int = DEFAULT_SHARDS,
) -> Request:
    """Check the settings (a given tokenizer is loaded once, inputs are resolved)."""
    _check_params(vocab_size, seq_len, val_fraction, shards)
    if tokenizer is not None:
        tokenizer = Path(tokenizer)
        tokenizer = tokenizer / TOKENIZER_FILE if tokenizer.is_dir() else tokenizer
        load_tokenizer(tokenizer)  # fail early on a missing or invalid file
    sources = resolve_inputs(inputs) if inputs else None
    params = preparation_params(
        embedded=sources is None,
        trained=tokenizer is None,
        vocab_size=vocab_size,
        seq_len=seq_len,
        val_fraction=val_fraction,
        shards=shards,
    )
    return Request(
        Path(out_dir), sources, tokenizer, vocab_size, seq_len, val_fraction, shards, params
    )


def start(req: Request, log: Log) -> tuple[list[Path], Path]:
    """Invalidate the store, write the embedded corpus if needed, fix the tokenizer.

    Returns the source shards and the store's tokenizer.json.
    """
    req.out_dir.mkdir(parents=True, exist_ok=True)
    (req.out_dir / META_FILE).unlink(missing_ok=True)  # valid only once meta.json is back
    sources = req.sources
    if sources is None:
        sources = _write_corpus(req.out_dir / CORPUS_DIR, req.shards, log)
    tok_path = _install_tokenizer(req.out_dir, req.tokenizer, sources, req.vocab_size, log)
    return sources, tok_path


def finish(
    req: Request, meta: dict, tok_path: Path, sources: list[Path], source_sha256: list[str]
) -> dict:
    """Add the provenance fields to a written store's ``meta`` and write its meta.json."""
    meta.update(
        tokenizer_sha256=sha256_file(tok_path),
        source=[p.name for p in sources],
        source_sha256=source_sha256,
        params=req.params,
        created_by=CREATED_BY,
    )
    write_meta(req.out_dir, meta)
    return meta


def log_written(meta: dict, out_dir: Path, started: float, log: Log) -> None:
    """The closing lines of a preparation."""
    log(
        f"windows: {meta['n_documents']} documents, {meta['n_tokens']} tokens, "
        f"{meta['n_windows'] + meta['n_val_windows']} windows"
    )
    log(
        f"prepare: wrote {out_dir}: {meta['n_windows']} train + {meta['n_val_windows']} val "
        f"windows of {meta['window_len']} {meta['dtype']} tokens (vocab {meta['vocab_size']}, "
        f"eos {meta['eos_id']}, {meta['n_tokens_dropped']} tail tokens dropped) "
        f"in {time.monotonic() - started:.1f} s"
    )


def prepare(
    out_dir: Path,
    *,
    inputs: Sequence[Path] | None = None,
    tokenizer: Path | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seq_len: int = DEFAULT_SEQ_LEN,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    shards: int = DEFAULT_SHARDS,
    force: bool = False,
    log: Log = _print,
) -> dict:
    """Prepare a window store in ``out_dir`` and return its meta (skips work when current)."""
    started = time.monotonic()
    req = request(
        out_dir,
        inputs=inputs,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        seq_len=seq_len,
        val_fraction=val_fraction,
        shards=shards,
    )
    out_dir = req.out_dir
    if not force and (meta := req.up_to_date()):
        log(f"prepare: {out_dir} is up to date ({meta['n_windows']} train windows); nothing to do")
        return meta

    sources, tok_path = start(req, log)
    tok = load_tokenizer(tok_path)
    eos = eos_id(tok)

    last = [time.monotonic()]

    def report(p: Progress) -> None:
        if time.monotonic() - last[0] >= PROGRESS_EVERY_S:
            last[0] = time.monotonic()
            log(f"windows: {p.documents} documents, {p.tokens} tokens, {p.windows} windows")

    meta = write_windows(
        iter_documents(sources),
        tok,
        out_dir,
        seq_len=seq_len,
        eos=eos,
        val_fraction=val_fraction,
        progress=report,
    )
    finish(req, meta, tok_path, sources, [sha256_file(p) for p in sources])
    log_written(meta, out_dir, started, log)
    return meta
