"""Pre-tokenised fixed-length windows in raw NumPy memmaps (train.bin, val.bin, meta.json).

Documents are tokenised in batches, each followed by the EOS id, concatenated and cut into
non-overlapping windows of ``seq_len + 1`` tokens; the ragged tail is dropped. The last
``val_fraction`` of the windows go to ``val.bin`` and never into the training block space.
Both files are row-major arrays of shape ``(n, seq_len + 1)`` with no header.

The same store can be made in parts: :func:`write_tokens` writes one group of shards' token
stream, and :func:`windows_from_token_files` concatenates the groups' streams in order and
cuts them exactly as :func:`write_windows` cuts the whole stream (same bytes, same meta).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import IO

import numpy as np
from tokenizers import Tokenizer

from crossfed.data.tokenizer import vocab_size as tokenizer_vocab_size
from crossfed.fileio import atomic_file, replace_durably, temp_beside

FORMAT = "crossfed-windows-v1"
META_FILE = "meta.json"
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
REQUIRED_META = ("format", "seq_len", "window_len", "dtype", "vocab_size", "eos_id", "n_windows")
DEFAULT_BATCH_CHARS = 4 << 20  # text per encode_batch call
_HASH_CHUNK = 16 << 20


class WindowStoreError(ValueError):
    """A window store is missing, inconsistent with its meta.json, or read out of range."""


@dataclass(frozen=True)
class Progress:
    """Running totals reported while windows are written."""

    documents: int
    tokens: int
    windows: int


def dtype_for_vocab(vocab_size: int) -> str:
    """Smallest unsigned dtype holding every id below ``vocab_size``."""
    if vocab_size < 1:
        raise WindowStoreError(f"vocab_size must be positive, got {vocab_size}")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def val_window_count(n_total: int, val_fraction: float) -> int:
    """Windows held out: ``floor(n_total * val_fraction)``, at least one when the fraction > 0."""
    if not 0.0 <= val_fraction < 1.0:
        raise WindowStoreError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_fraction == 0.0:
        return 0
    return max(1, math.floor(n_total * val_fraction))


def _text_batches(docs: Iterable[str], batch_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def token_stream(
    docs: Iterable[str], tok: Tokenizer, eos: int, batch_chars: int = DEFAULT_BATCH_CHARS
) -> Iterator[tuple[int, np.ndarray]]:
    """(documents in batch, int64 ids) per batch: each document's ids followed by ``eos``."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # same ids, no offsets
    for batch in _text_batches(docs, batch_chars):
        encodings = encode(batch, add_special_tokens=False)
        ids = chain.from_iterable(chain(enc.ids, (eos,)) for enc in encodings)
        total = sum(len(enc.ids) for enc in encodings) + len(encodings)
        yield len(batch), np.fromiter(ids, dtype=np.int64, count=total)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_windows(
    docs: Iterable[str],
    tok: Tokenizer,
    out_dir: Path,
    *,
    seq_len: int,
    eos: int,
    val_fraction: float = 0.05,
    batch_chars: int = DEFAULT_BATCH_CHARS,
    progress: Callable[[Progress], None] | None = None,
) -> dict:
    """Tokenise ``docs`` into ``out_dir``/train.bin and val.bin; return their meta fields.

    Streams: only one batch of ids and one partial window are held in memory. Both files are
    written to temporary names, fsynced and renamed; meta.json is left to :func:`write_meta`.
    """
    if seq_len < 1:
        raise WindowStoreError(f"seq_len must be at least 1, got {seq_len}")
    val_window_count(1, val_fraction)  # validates the fraction before any work
    vocab, dtype_name = _check_tokenizer(tok, eos)
    dtype = np.dtype(DTYPES[dtype_name])
    window_len = seq_len + 1
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, val_path = out_dir / SPLIT_FILES["train"], out_dir / SPLIT_FILES["val"]

    n_docs = n_tokens = n_total = 0
    carry = np.empty(0, dtype=np.int64)
    with temp_beside(train_path) as all_tmp, temp_beside(val_path) as val_tmp:
        with open(all_tmp, "wb") as f:
            for count, ids in token_stream(docs, tok, eos, batch_chars):
                if ids.size and int(ids.max()) >= vocab:
                    raise WindowStoreError(f"token id {int(ids.max())} >= vocab size {vocab}")
                n_docs += count
                n_tokens += ids.size
                stream = np.concatenate((carry, ids)) if carry.size else ids
                full = stream.size // window_len
                f.write(stream[: full * window_len].astype(dtype).tobytes())
                carry = stream[full * window_len :].copy()
                n_total += full
                if progress is not None:
                    progress(Progress(n_docs, n_tokens, n_total))
            f.flush()
            os.fsync(f.fileno())
        n_val = val_window_count(n_total, val_fraction)
        n_train = n_total - n_val
        if n_train < 1:
            raise WindowStoreError(
                f"corpus too small: {n_tokens} tokens make {n_total} window(s) of {window_len}, "
                f"leaving none for training after {n_val} held out"
            )
        row = window_len * dtype.itemsize
        with open(all_tmp, "r+b") as f, open(val_tmp, "wb") as v:
            f.seek(n_train * row)
            left = n_val * row
            while left:
                chunk = f.read(min(left, _HASH_CHUNK))
                v.write(chunk)
                left -= len(chunk)
            v.flush()
            os.fsync(v.fileno())
            f.truncate(n_train * row)
            f.flush()
            os.fsync(f.fileno())
        replace_durably(all_tmp, train_path)
        replace_durably(val_tmp, val_path)
    return _store_meta(
        seq_len=seq_len,
        dtype_name=dtype_name,
        vocab=vocab,
        eos=eos,
        n_train=n_train,
        n_val=n_val,
        n_docs=n_docs,
        n_tokens=n_tokens,
        sha256={
            SPLIT_FILES["train"]: _sha256_file(train_path),
            SPLIT_FILES["val"]: _sha256_file(val_path),
        },
    )


def _store_meta(
    *,
    seq_len: int,
    dtype_name: str,
    vocab: int,
    eos: int,
    n_train: int,
    n_val: int,
    n_docs: int,
    n_tokens: int,
    sha256: dict[str, str],
) -> dict:
    """The meta fields of a written store (both ways of writing one return exactly these)."""
    window_len = seq_len + 1
    return {
        "format": FORMAT,
        "seq_len": seq_len,
        "window_len": window_len,
        "dtype": dtype_name,
        "vocab_size": vocab,
        "eos_id": eos,
        "n_windows": n_train,
        "n_val_windows": n_val,
        "n_documents": n_docs,
        "n_tokens": n_tokens,
        "n_tokens_dropped": n_tokens - (n_train + n_val) * window_len,
        "sha256": sha256,
    }


def _check_tokenizer(tok: Tokenizer, eos: int) -> tuple[int, str]:
    vocab = tokenizer_vocab_size(tok)
    if not 0 <= eos < vocab:
        raise WindowStoreError(f"eos id {eos} outside the vocabulary (size {vocab})")
    return vocab, dtype_for_vocab(vocab)


def write_tokens(
    docs: Iterable[str],
    tok: Tokenizer,
    path: Path,
    *,
    eos: int,
    batch_chars: int = DEFAULT_BATCH_CHARS,
    progress: Callable[[Progress], None] | None = None,
) -> dict:
    """Tokenise ``docs`` into one flat file of ids in the store's dtype (each doc + ``eos``).

    Written to a temporary name, fsynced and renamed. Returns ``dtype``, ``vocab_size``,
    ``eos_id``, ``n_documents`` and ``n_tokens``.
    """
    vocab, dtype_name = _check_tokenizer(tok, eos)
    dtype = np.dtype(DTYPES[dtype_name])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n_docs = n_tokens = 0
    with temp_beside(path) as tmp:
        with open(tmp, "wb") as f:
            for count, ids in token_stream(docs, tok, eos, batch_chars):
                if ids.size and int(ids.max()) >= vocab:
                    raise WindowStoreError(f"token id {int(ids.max())} >= vocab size {vocab}")
                n_docs += count
                n_tokens += ids.size
                f.write(ids.astype(dtype).tobytes())
                if progress is not None:
                    progress(Progress(n_docs, n_tokens, 0))
            f.flush()
            os.fsync(f.fileno())
        replace_durably(tmp, path)
    return {
        "dtype": dtype_name,
        "vocab_size": vocab,
        "eos_id": eos,
        "n_documents": n_docs,
        "n_tokens": n_tokens,
    }


def _copy_into(sources: Iterator[bytes], sinks: Sequence[tuple[IO[bytes], int]]) -> list[str]:
    """Route the concatenated ``sources`` bytes into ``sinks`` (file, byte budget) in turn.

    Bytes past the last budget are dropped; returns each sink's SHA-256.
    """
    digests = [hashlib.sha256() for _ in sinks]
    k, left = 0, sinks[0][1] if sinks else 0
    for chunk in sources:
        view = memoryview(chunk)
        while view.nbytes and k < len(sinks):
            if left == 0:
                k += 1
                left = sinks[k][1] if k < len(sinks) else 0
                continue
            piece = view[:left]
            sinks[k][0].write(piece)
            digests[k].update(piece)
            left -= piece.nbytes
            view = view[piece.nbytes :]
    return [d.hexdigest() for d in digests]


def _chunks(paths: Sequence[Path]) -> Iterator[bytes]:
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                yield chunk


def windows_from_token_files(
    parts: Sequence[Path],
    out_dir: Path,
    *,
    seq_len: int,
    vocab_size: int,
    eos: int,
    n_documents: int,
    val_fraction: float = 0.05,
) -> dict:
    """Cut the concatenation of ``parts`` (from :func:`write_tokens`) into train.bin/val.bin.

    The result is byte for byte what :func:`write_windows` makes of the same documents in
    one stream: the same windows, the same held-out tail, the same meta fields.
    """
    if seq_len < 1:
        raise WindowStoreError(f"seq_len must be at least 1, got {seq_len}")
    val_window_count(1, val_fraction)
    if not 0 <= eos < vocab_size:
        raise WindowStoreError(f"eos id {eos} outside the vocabulary (size {vocab_size})")
    dtype_name = dtype_for_vocab(vocab_size)
    itemsize = np.dtype(DTYPES[dtype_name]).itemsize
    sizes = [Path(p).stat().st_size for p in parts]
    for path, size in zip(parts, sizes, strict=True):
        if size % itemsize:
            raise WindowStoreError(f"{path}: {size} bytes is not a whole number of {dtype_name}")
    n_tokens = sum(sizes) // itemsize
    window_len = seq_len + 1
    n_total = n_tokens // window_len
    n_val = val_window_count(n_total, val_fraction)
    n_train = n_total - n_val
    if n_train < 1:
        raise WindowStoreError(
            f"corpus too small: {n_tokens} tokens make {n_total} window(s) of {window_len}, "
            f"leaving none for training after {n_val} held out"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, val_path = out_dir / SPLIT_FILES["train"], out_dir / SPLIT_FILES["val"]
    row = window_len * itemsize
    with temp_beside(train_path) as train_tmp, temp_beside(val_path) as val_tmp:
        with open(train_tmp, "wb") as t, open(val_tmp, "wb") as v:
            digests = _copy_into(_chunks(parts), [(t, n_train * row), (v, n_val * row)])
            for f in (t, v):
                f.flush()
                os.fsync(f.fileno())
        replace_durably(train_tmp, train_path)
        replace_durably(val_tmp, val_path)
    return _store_meta(
        seq_len=seq_len,
        dtype_name=dtype_name,
        vocab=vocab_size,
        eos=eos,
        n_train=n_train,
        n_val=n_val,
        n_docs=n_documents,
        n_tokens=n_tokens,
        sha256=dict(zip(SPLIT_FILES.values(), digests, strict=True)),
    )


def write_meta(out_dir: Path, meta: dict) -> Path:
    """Write meta.json atomically (the last file of a store to appear)."""
    path = Path(out_dir) / META_FILE
    with atomic_file(path) as f:
        f.write((json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
    return path


def read_meta(data_dir: Path) -> dict:
    """Parse and check ``data_dir``/meta.json."""
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise WindowStoreError(f"{path}: not found (run `crossfed data prepare` first)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WindowStoreError(f"{path}: invalid JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise WindowStoreError(f"{path}: expected a JSON object")
    if meta.get("format") != FORMAT:
        raise WindowStoreError(f"{path}: format is {meta.get('format')!r}, expected {FORMAT!r}")
    missing = [key for key in REQUIRED_META if key not in meta]
    if missing:
        raise WindowStoreError(f"{path}: missing field(s) {', '.join(missing)}")
    if meta["dtype"] not in DTYPES:
        raise WindowStoreError(f"{path}: dtype {meta['dtype']!r} not one of {sorted(DTYPES)}")
    for key in ("seq_len", "window_len", "vocab_size", "n_windows", "n_val_windows"):
        value = meta.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise WindowStoreError(f"{path}: {key} must be a non-negative integer, got {value!r}")
    if meta["window_len"] != meta["seq_len"] + 1:
        raise WindowStoreError(
            f"{path}: window_len {meta['window_len']} != seq_len {meta['seq_len']} + 1"
        )
    return meta


class WindowStore:
    """Read side of a window store: one split as a read-only memmap of fixed windows."""

    def __init__(self, path: Path, meta: dict, n_windows: int) -> None:
        self.path = path
        self.meta = meta
        self.n_windows = n_windows
        self.window_len: int = meta["window_len"]
        self.seq_len: int = meta["seq_len"]
        self.vocab_size: int = meta["vocab_size"]
        self.eos_id: int = meta["eos_id"]
        self.dtype = np.dtype(DTYPES[meta["dtype"]])
        self._data = np.memmap(path, dtype=self.dtype, mode="r", shape=(n_windows, self.window_len))

    @classmethod
    def open(cls, data_dir: Path, split: str = "train") -> WindowStore:
        """Open ``split`` ("train" or "val") of the store in ``data_dir``, checking its size."""
        if split not in SPLIT_FILES:
            raise WindowStoreError(f"unknown split {split!r}; expected one of {list(SPLIT_FILES)}")
        meta = read_meta(data_dir)
        n = meta["n_windows"] if split == "train" else meta.get("n_val_windows", 0)
        path = Path(data_dir) / SPLIT_FILES[split]
        if n == 0:
            raise WindowStoreError(f"{path}: the {split} split has no windows")
        if not path.is_file():
            raise WindowStoreError(f"{path}: not found")
        expected = n * meta["window_len"] * np.dtype(DTYPES[meta["dtype"]]).itemsize
        actual = path.stat().st_size
        if actual != expected:
            raise WindowStoreError(
                f"{path}: {actual} bytes, but meta.json promises {n} windows x "
                f"{meta['window_len']} {meta['dtype']} = {expected} bytes (truncated or stale?)"
            )
        return cls(path, meta, n)

    def __len__(self) -> int:
        return self.n_windows

    def windows(self, start: int, stop: int) -> np.ndarray:
        """Windows ``start:stop`` as an int64 array of shape (stop - start, window_len)."""
        if not 0 <= start <= stop <= self.n_windows:
            raise WindowStoreError(
                f"window range [{start}, {stop}) outside [0, {self.n_windows}) of {self.path}"
            )
        return np.array(self._data[start:stop], dtype=np.int64)

    def take(self, indices: np.ndarray) -> np.ndarray:
        """The windows at ``indices`` (any order) as an int64 array (len, window_len)."""
        idx = np.asarray(indices)
        if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise WindowStoreError(
                f"indices must be a 1-D integer array, got {idx.dtype} of shape {idx.shape}"
            )
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.n_windows):
            raise WindowStoreError(
                f"window index out of range [0, {self.n_windows}) of {self.path}"
            )
        return np.array(self._data[idx.astype(np.int64, copy=False)], dtype=np.int64)

    def verify(self) -> None:
        """Check this split's SHA-256 against meta.json (reads the whole file)."""
        expected = self.meta.get("sha256", {}).get(self.path.name)
        if expected is None:
            raise WindowStoreError(f"{self.path}: meta.json holds no sha256 for it")
        actual = _sha256_file(self.path)
        if actual != expected:
            raise WindowStoreError(f"{self.path}: sha256 {actual} != meta.json {expected}")
